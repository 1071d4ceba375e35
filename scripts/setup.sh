#!/usr/bin/env bash
# Sets up everything hvdtrain needs on a fresh Debian machine, as root, and is idempotent:
# a second run finds what exists and takes seconds.
#   1. Debian packages: OpenMPI (Horovod's MPI controller and `mpirun`), the Fashion-MNIST data.
#   2. A virtual environment (.venv, or $HVDTRAIN_VENV) with pinned TensorFlow, numpy, mpi4py.
#   3. Horovod built from source against exactly that TensorFlow, with Gloo and MPI.
#   4. hvdtrain itself, installed editable.
#   5. hvdtrain's CPU kernels for synchronized BatchNorm, compiled against that TensorFlow.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=2  # quiet TensorFlow start-up banners in the checks below

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVDTRAIN_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

log() { printf '[setup] %s\n' "$*"; }

# 1. Debian packages ------------------------------------------------------------------------
APT_PACKAGES=(libopenmpi-dev openmpi-bin dataset-fashion-mnist openssh-server openssh-client iproute2)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "[setup] error: Debian packages missing (${missing[*]}); run as root or install them first" >&2
    exit 1
  fi
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. Virtual environment with pinned Python packages ----------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if ! "$PY" -c 'import tensorflow, mpi4py, tqdm, pytest, matplotlib' 2>/dev/null; then
  log "installing Python requirements (TensorFlow, numpy, mpi4py, ...)"
  "${PIP[@]}" --upgrade pip 'setuptools<70' wheel
  "${PIP[@]}" --only-binary=mpi4py -r "$ROOT/requirements.txt"
fi

# 3. Horovod, built against the TensorFlow above ---------------------------------------------
# Rebuilt whenever TensorFlow changes: Horovod's TF ops are compiled against TF's C++ ABI.
TF_VERSION=$("$PY" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)
STAMP="$VENV/.horovod-built-against-tf"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$TF_VERSION" ]] \
   || ! "$PY" -c 'import horovod.tensorflow as hvd; assert hvd.gloo_built() and hvd.mpi_built()' 2>/dev/null; then
  log "building horovod==0.28.1 against TensorFlow $TF_VERSION (about 4 minutes on 2 cores)"
  "$PY" -m pip uninstall -y -q horovod >/dev/null 2>&1 || true
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
  MAKEFLAGS="-j$(nproc)" \
    "${PIP[@]}" --no-build-isolation --no-cache-dir horovod==0.28.1
  "$PY" -c 'import horovod.tensorflow as hvd; assert hvd.gloo_built() and hvd.mpi_built(), "horovod built without gloo/mpi"'
  echo "$TF_VERSION" > "$STAMP"
fi

# 4. hvdtrain itself ---------------------------------------------------------------------
if ! (cd / && "$PY" -c 'import hvdtrain') 2>/dev/null; then  # from /: not found merely via the cwd
  log "installing hvdtrain (editable)"
  "${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"
fi
# 5. hvdtrain's single-pass CPU kernels for SyncBatchNormalization, compiled against this TensorFlow.
"$PY" -m hvdtrain.sync_bn_kernels 2>&1 | grep -v -e '^WARNING' -e 'oneDNN' -e 'cpu_feature' -e 'AVX' || true
"$PY" -c 'from hvdtrain import sync_bn_kernels as k; assert k._library() is not None, "kernels failed to build"'

log "ready: $VENV (TensorFlow $TF_VERSION, horovod $("$PY" -c 'import horovod; print(horovod.__version__)'))"
