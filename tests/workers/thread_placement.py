"""Worker: start hvdtrain's distributed context and print, as one JSON line, where this process's
threads may run: the rank's share of the cores, the union of every thread's CPU affinity, each
thread's nice level (19 for Horovod's, when hvdtrain makes them yield to the compute), and the nice
levels of the threads ``ctx.horovod_threads`` names."""
import json
import os

from hvdtrain.dist import init_distributed

ctx = init_distributed(threads=1, use_gpu=False)
nice, horovod_nice, thread_cores = [], set(), set()
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/stat") as f:
        nice.append(int(f.read().rsplit(")", 1)[1].split()[16]))  # field 19 of stat: nice
    if int(tid) in ctx.horovod_threads:
        horovod_nice.add(nice[-1])
    thread_cores |= os.sched_getaffinity(int(tid))
print("placement " + json.dumps({"rank": ctx.rank, "cores": sorted(ctx.cpu_cores), "thread_cores": sorted(thread_cores),
                                 "nice19": nice.count(19), "nice0": nice.count(0),
                                 "horovod_nice": sorted(horovod_nice)}), flush=True)
ctx.close()
