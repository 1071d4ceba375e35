#!/usr/bin/env bash
# The tested matrix: sets up each stack named (default: both) in a virtual environment of its own,
# .venv-<stack> (scripts/setup.sh with STACK and HVDTRAIN_VENV), and runs the smoke subset on it:
# the default job for one epoch at np=2 on Fashion-MNIST, the N ranks == 1 process oracles (with and
# without synchronized BatchNorm), SyncBN against its float64 global-batch oracle, an exact resume
# mid-epoch, the gradient exchange at 2 and 3 ranks, and the streamed datasets (their shards in one
# process; an image folder at np=2 trains exactly as in memory). The full suite runs on the default stack (README's test command).
#   bash scripts/matrix.sh            # tf2.15 and tf2.21
#   bash scripts/matrix.sh tf2.15     # the pinned older stack only (what .ci/run adds)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACKS=("$@")
((${#STACKS[@]})) || STACKS=(tf2.15 tf2.21)
SMOKE=(
  tests/test_cli.py::test_default_job_one_epoch_on_fashion_mnist
  tests/test_trainer.py::test_broadcast_and_oracle_without_batch_norm
  tests/test_trainer.py::test_sync_bn_cnn_matches_global_batch
  tests/model/test_sync_bn.py::test_matches_global_batch_oracle
  tests/test_cli.py::test_resume_mid_epoch_is_exact
  tests/test_kerases.py
  tests/test_exchange.py
  tests/model/test_fused_bn.py
  tests/data/test_tfrecord.py
  tests/data/test_folder.py
  tests/data/test_function.py
  tests/tools/test_make_tfrecords.py
  tests/data/test_images.py
  tests/data/test_stream.py::test_image_folder_trains_exactly_as_in_memory
  tests/test_losses.py
  tests/test_metrics.py
  tests/test_task.py
  tests/test_config.py
)
status=0
for stack in "${STACKS[@]}"; do
  venv="$ROOT/.venv-$stack"
  echo "[matrix] $stack: setting up $venv"
  STACK="$stack" HVDTRAIN_VENV="$venv" bash "$ROOT/scripts/setup.sh"
  versions=$("$venv/bin/python" -c 'import sys, tensorflow as tf, horovod; print(f"Python {sys.version.split()[0]}, TensorFlow {tf.__version__}, horovod {horovod.__version__}")' 2>/dev/null)
  start=$SECONDS
  if (cd "$ROOT" && "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider "${SMOKE[@]}"); then
    echo "[matrix] $stack ($versions): smoke subset PASSED in $((SECONDS - start)) s"
  else
    echo "[matrix] $stack ($versions): smoke subset FAILED"
    status=1
  fi
done
exit $status
