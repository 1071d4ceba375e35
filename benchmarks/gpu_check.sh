#!/usr/bin/env bash
# GPU check: TensorFlow with CUDA and Horovod built for it, ResNet-50 on 224x224 synthetic data at
# np=1 with mixed precision (images/s), and GPU pinning by local rank.
#
# Run on a machine with NVIDIA GPUs, a CUDA 12.2 driver or newer, Python 3.9-3.11 and network
# access to PyPI (TensorFlow 2.15.1's GPU wheel pulls CUDA 12.2 and cuDNN 8.9 as pip packages):
#
#     bash benchmarks/gpu_check.sh            # writes benchmarks/figures/scaling_gpu.png too
#
# Steps: a venv with tensorflow[and-cuda]==2.15.1; Horovod 0.28.1 built with NCCL for GPU
# allreduce (HOROVOD_GPU_OPERATIONS=NCCL; the nvidia-nccl-cu12 wheel provides NCCL); one rank
# per GPU, each seeing only the GPU at its local rank; the throughput benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q 'tensorflow[and-cuda]==2.15.1' numpy==1.26.4 'cmake<4' tqdm matplotlib psutil
  NCCL_HOME=$("$VENV/bin/python" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) + "/nccl")')
  # Horovod's CMake looks for libnccl.so; the wheel ships libnccl.so.2.
  ln -sf "$NCCL_HOME/lib/libnccl.so.2" "$NCCL_HOME/lib/libnccl.so"
  HOROVOD_NCCL_HOME=$NCCL_HOME HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "$VENV/bin/pip" install -q --no-build-isolation --no-cache-dir horovod==0.28.1
  "$VENV/bin/pip" install -q -e .
fi
"$VENV/bin/horovodrun" --check-build
nvidia-smi --query-gpu=index,name,memory.total --format=csv

# Pinning: each rank must see exactly one GPU, the one at its local rank.
NGPU=$(nvidia-smi -L | wc -l)
"$VENV/bin/horovodrun" -np "$NGPU" --gloo "$VENV/bin/python" - <<'EOF'
from hvdtrain.runtime.dist import init_distributed
import tensorflow as tf
ctx = init_distributed()
visible = tf.config.get_visible_devices("GPU")
assert ctx.device == "/GPU:0" and len(visible) == 1, (ctx, visible)
print(f"rank {ctx.rank} local rank {ctx.local_rank}: sees {visible[0].name} only -> pinning OK", flush=True)
ctx.close()
EOF

"$VENV/bin/python" benchmarks/scaling.py --models resnet50 --gpu --mixed-precision --max-np 1 --repeats 1 --batch-size 128 \
  --plot benchmarks/figures/scaling_gpu.png
