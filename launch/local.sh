#!/usr/bin/env bash
# Single host: N ranks on this machine, one per GPU (or sharing the CPU cores).
#
# Edit: NP (ranks; on a GPU host at most its GPU count), ARGS (hvdtrain flags, see --help).
# Run:  bash launch/local.sh [mpi|gloo|mpirun] [hvdtrain flags...]
#       (default mpi: on one host OpenMPI's shared-memory transport allreduces several times faster
#       than Gloo's TCP; see benchmarks/README.md). Flags after the mode follow those in ARGS.
#       Relative paths in ARGS (--data-dir, --log-dir) and --model modules resolve against the
#       directory you run it from, as with python -m hvdtrain itself.
set -euo pipefail
VENV=${VENV:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv}
NP=${NP:-2}
ARGS=${ARGS:-}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}  # no TensorFlow start-up banner from every rank
PY=$VENV/bin/python
mode=${1:-mpi}
shift $(( $# > 0 ? 1 : 0 ))
case "$mode" in
  # Gloo: Horovod's own TCP rendezvous and collectives; no MPI needed.
  gloo)   exec "$VENV/bin/horovodrun" -np "$NP" --gloo "$PY" -m hvdtrain $ARGS "$@" ;;
  # horovodrun driving OpenMPI underneath.
  mpi)    exec "$VENV/bin/horovodrun" -np "$NP" --mpi "$PY" -m hvdtrain $ARGS "$@" ;;
  # Plain mpirun: each rank learns rank/size from OpenMPI. -bind-to none lets hvdtrain give each
  # rank its own slice of cores; --oversubscribe allows more ranks than cores (they share them, as
  # under horovodrun, which gives this host NP slots); root needs --allow-run-as-root.
  mpirun) exec mpirun -np "$NP" -bind-to none -map-by slot --oversubscribe --allow-run-as-root \
            -x PATH ${LD_LIBRARY_PATH:+-x LD_LIBRARY_PATH} -x TF_CPP_MIN_LOG_LEVEL "$PY" -m hvdtrain $ARGS "$@" ;;
  *) echo "$0: unknown mode '$mode': the first argument is mpi, gloo or mpirun; hvdtrain flags follow it" >&2
     exit 2 ;;
esac
