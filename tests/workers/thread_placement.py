"""Worker: start hvdtrain's distributed context and print, as one JSON line, where this process's
threads may run: the rank's share of the cores, the union of every thread's CPU affinity, each
thread's nice level (19 for Horovod's, when hvdtrain makes them yield to the compute), the nice
levels of the threads ``ctx.horovod_threads`` names, the union of those threads' affinity and of the
others', and how many threads may run off the share."""
import json
import os
import sys

from hvdtrain.runtime.dist import init_distributed

ctx = init_distributed(threads=1, use_gpu=False)
nice, horovod_nice, thread_cores, elsewhere = [], set(), set(), 0
horovod_cores, other_cores = set(), set()
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/stat") as f:
        nice.append(int(f.read().rsplit(")", 1)[1].split()[16]))  # field 19 of stat: nice
    if int(tid) in ctx.horovod_threads:
        horovod_nice.add(nice[-1])
    thread_cores |= os.sched_getaffinity(int(tid))
    (horovod_cores if int(tid) in ctx.horovod_threads else other_cores).update(os.sched_getaffinity(int(tid)))
    elsewhere += os.sched_getaffinity(int(tid)) != set(ctx.cpu_cores)
placement = {"rank": ctx.rank, "cores": sorted(ctx.cpu_cores), "thread_cores": sorted(thread_cores),
             "nice19": nice.count(19), "nice0": nice.count(0), "horovod_nice": sorted(horovod_nice),
             "horovod_threads": len(ctx.horovod_threads), "threads_elsewhere": elsewhere,
             "horovod_cores": sorted(horovod_cores), "other_cores": sorted(other_cores)}
# One write, newline included: print() writes the line and its end separately when unbuffered, and
# the ranks' output would then interleave.
sys.stdout.write(f"placement {json.dumps(placement)}\n")
sys.stdout.flush()
ctx.close()
