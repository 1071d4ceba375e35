#!/usr/bin/env bash
# Sets up everything hvdtrain needs on a fresh Debian machine, as root, and is idempotent:
# a second run finds what exists and takes seconds.
#   1. Debian packages: OpenMPI (Horovod's MPI controller and `mpirun`), the Fashion-MNIST data.
#   2. A virtual environment (.venv, or $HVDTRAIN_VENV) with the stack's pinned TensorFlow, tf-keras, numpy, mpi4py.
#   3. Horovod 0.28.1 built from its sdist against exactly that TensorFlow, with Gloo and MPI, after
#      applying scripts/horovod-patches/*.patch (each says what it fixes and the upstream thread).
#   4. hvdtrain itself, installed editable.
#   5. hvdtrain's CPU kernels for synchronized BatchNorm, compiled against that TensorFlow.
#
# Stacks (STACK=...):
#   tf2.21 (default)  TensorFlow 2.21.0 + tf-keras 2.21.0 on the newest of Python 3.13, 3.12, 3.11, 3.10 found
#   tf2.15            TensorFlow 2.15.1 + tf-keras 2.15.1 on Python 3.11 (TF 2.15 has no wheels for 3.12+)
# PYTHON=/path/to/python picks the interpreter; HVDTRAIN_VENV the environment's directory.
#
# The console gets one line per phase that has work to do; everything the tools print (apt, pip,
# the compilers) goes to setup.log (HVDTRAIN_SETUP_LOG), whose last lines are shown on a failure.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=2  # quiet TensorFlow start-up banners in the checks below
export TF_USE_LEGACY_KERAS=1   # tf.keras is Keras 2 (tf-keras) on TF >= 2.16, as hvdtrain's import sets it

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVDTRAIN_VENV:-$ROOT/.venv}"
STACK="${STACK:-tf2.21}"
HOROVOD_VERSION=0.28.1

if [[ "$STACK" == tf2.21 ]]; then LOG="$ROOT/setup.log"; else LOG="$ROOT/setup-$STACK.log"; fi
LOG="${HVDTRAIN_SETUP_LOG:-$LOG}"
: > "$LOG"
exec 3>&1 4>&2 >>"$LOG" 2>&1  # the tools' output to the log; the phase lines to fd 3 (the console)
log() { printf '[setup] %s\n' "$*" | tee /dev/fd/3; }
die() { printf '[setup] error: %s\n' "$*" | tee /dev/fd/4; exit 1; }
failed() {
  local status=$?
  { printf '[setup] error: the command at scripts/setup.sh line %s failed (exit %s); the last lines of %s:\n' \
      "$1" "$status" "$LOG"; tail -n 40 "$LOG" | sed 's/^/  | /'; } >&4
  exit "$status"
}
trap 'failed $LINENO' ERR

case "$STACK" in
  tf2.21) PYTHONS=(3.13 3.12 3.11 3.10); TF_KERAS=2.21.0 ;;
  tf2.15) PYTHONS=(3.11 3.10); TF_KERAS=2.15.1 ;;
  *) die "STACK must be tf2.21 or tf2.15, got '$STACK'" ;;
esac
REQUIREMENTS="$ROOT/requirements/$STACK.txt"

# The first interpreter of the stack's versions that runs: on PATH (a pyenv shim for a version that
# is not selected fails to run, so each is tried), then pyenv's own builds.
find_python() {
  local v c
  for v in "${PYTHONS[@]}"; do
    for c in "python$v" /usr/bin/"python$v" /usr/local/bin/"python$v" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v"*/bin/"python$v"; do
      if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import venv, ensurepip' >/dev/null 2>&1; then
        echo "$c"; return 0
      fi
    done
  done
  return 1
}

# 1. Debian packages ------------------------------------------------------------------------
APT_PACKAGES=(libopenmpi-dev openmpi-bin dataset-fashion-mnist openssh-server openssh-client iproute2 git)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  [[ $(id -u) -eq 0 ]] || die "Debian packages missing (${missing[*]}); run as root or install them first"
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Without the console's descriptors: a service the packages start must not hold the console open.
  apt-get update -qq 3>&- 4>&-
  apt-get install -y -qq --no-install-recommends "${missing[@]}" 3>&- 4>&-
fi

# 2. Virtual environment with the stack's pinned Python packages --------------------------------
STACK_FILE="$VENV/.hvdtrain-stack"
if [[ -x "$VENV/bin/python" && "$(cat "$STACK_FILE" 2>/dev/null)" != "$STACK" ]]; then
  log "$VENV holds another stack ($(cat "$STACK_FILE" 2>/dev/null || echo unknown)); recreating it for $STACK"
  rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  PYTHON="${PYTHON:-$(find_python)}" || die "no Python ${PYTHONS[*]} found for stack $STACK (set PYTHON=/path/to/python)"
  log "creating virtual environment $VENV with $("$PYTHON" -V) for stack $STACK"
  "$PYTHON" -m venv "$VENV"
  echo "$STACK" > "$STACK_FILE"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if ! "$PY" -c 'import tensorflow, tf_keras, mpi4py, tqdm, pytest, xdist, matplotlib, yaml, cloudpickle, psutil, tensorboard' 2>/dev/null; then
  log "installing Python requirements ($REQUIREMENTS)"
  "${PIP[@]}" --upgrade pip 'setuptools<70' wheel
  "${PIP[@]}" --only-binary=mpi4py -r "$REQUIREMENTS"
  # tf-keras requires the package `tensorflow`, which tensorflow-cpu provides under another name:
  # without --no-deps pip would install both, one over the other.
  "${PIP[@]}" --no-deps "tf-keras==$TF_KERAS"
fi

# 3. Horovod, patched and built against the TensorFlow above ----------------------------------
# Rebuilt whenever TensorFlow or the patch set changes: Horovod's TF ops are compiled against TF's C++ ABI.
TF_VERSION=$("$PY" -c 'import tensorflow as tf; print(tf.__version__)')
PATCHES=("$ROOT"/scripts/horovod-patches/*.patch)
BUILD_ID="horovod $HOROVOD_VERSION, tensorflow $TF_VERSION, patches $(cat "${PATCHES[@]}" | sha256sum | cut -c1-16)"
STAMP="$VENV/.horovod-build"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$BUILD_ID" ]] \
   || ! "$PY" -c 'import horovod.tensorflow as hvd; assert hvd.gloo_built() and hvd.mpi_built()' 2>/dev/null; then
  log "building $BUILD_ID, with ${#PATCHES[@]} patches (about 5 minutes on 2 cores)"
  SRC="$(mktemp -d)"
  trap 'rm -rf "$SRC"' EXIT
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: --no-build-isolation -d "$SRC" "horovod==$HOROVOD_VERSION"
  tar -xzf "$SRC/horovod-$HOROVOD_VERSION.tar.gz" -C "$SRC"
  for patch in "${PATCHES[@]}"; do
    echo "applying $(basename "$patch")"
    git -C "$SRC/horovod-$HOROVOD_VERSION" apply --whitespace=nowarn "$patch"
  done
  "$PY" -m pip uninstall -y -q horovod >/dev/null 2>&1 || true
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
  MAKEFLAGS="-j$(nproc)" \
    "${PIP[@]}" --no-build-isolation --no-deps --no-cache-dir "$SRC/horovod-$HOROVOD_VERSION"
  "$PY" -c 'import horovod.tensorflow as hvd; assert hvd.gloo_built() and hvd.mpi_built(), "horovod built without gloo/mpi"'
  echo "$BUILD_ID" > "$STAMP"
fi

# 4. hvdtrain itself ---------------------------------------------------------------------
if ! (cd / && "$PY" -c 'import hvdtrain') 2>/dev/null; then  # from /: not found merely via the cwd
  log "installing hvdtrain (editable)"
  "${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"
fi
# 5. hvdtrain's single-pass CPU kernels for SyncBatchNormalization, compiled against this TensorFlow.
if ! "$PY" -c 'import os, sys; from hvdtrain.model import sync_bn_kernels as k
sys.exit(not (os.path.exists(k.LIBRARY) and k._stamp_matches()))'; then
  log "compiling hvdtrain's CPU kernels for SyncBatchNormalization"
  "$PY" -m hvdtrain.model.sync_bn_kernels
fi
"$PY" -c 'from hvdtrain.model import sync_bn_kernels as k; assert k._library() is not None, "kernels failed to build"'

log "ready: $VENV ($("$PY" -V), TensorFlow $TF_VERSION, tf-keras $TF_KERAS, horovod $HOROVOD_VERSION patched); log: $LOG"
