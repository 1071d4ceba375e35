"""Worker: start hvdtrain's distributed context and print how many of this process's threads run
at nice 19 (Horovod's, when hvdtrain makes them yield to the compute) and how many at nice 0."""
import os

from hvdtrain.dist import init_distributed

ctx = init_distributed(threads=1, use_gpu=False)
nice = []
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/stat") as f:
        nice.append(int(f.read().rsplit(")", 1)[1].split()[16]))  # field 19 of stat: nice
print(f"rank {ctx.rank}: nice19={nice.count(19)} nice0={nice.count(0)}", flush=True)
ctx.close()
