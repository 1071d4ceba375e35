#!/usr/bin/env bash
# Cluster with OpenMPI: one rank per slot of a hostfile, started over ssh by mpirun.
#
# Edit (or set in the environment):
#   HOSTFILE  lines "host slots=N" (N = GPUs per host; see hostfile.example)
#   NP        total ranks (default: the sum of the slots)
#   IFACE     network interface(s) the ranks talk over, e.g. "eth0" or "ib0" (comma-separated);
#             becomes btl_tcp_if_include / oob_tcp_if_include. Unset: OpenMPI picks.
#   FABRIC    "tcp" (default) or "ib" (InfiniBand through UCX; needs OpenMPI built with UCX)
#   SSH_ARGS  extra ssh options for reaching the hosts, e.g. "-i ~/.ssh/cluster_key"
#   ARGS      hvdtrain flags (see: python -m hvdtrain --help)
#   VENV      the virtual environment, at the same path on every host (default: .venv here)
# Run:  HOSTFILE=hosts.txt bash launch/mpirun_hostfile.sh
# Ranks start in the repository's directory, on every host alike: relative paths in ARGS resolve
# against it, not against the directory you run this from.
#
# -bind-to none -map-by slot: hvdtrain pins each rank to its GPU (local rank) and to its own share
# of the host's cores itself; -x exports the environment each rank needs to every host.
set -euo pipefail
: "${HOSTFILE:?set HOSTFILE to a hostfile (see launch/hostfile.example)}"
[[ -f "$HOSTFILE" ]] || { echo "$0: no hostfile $HOSTFILE (from $PWD)" >&2; exit 2; }
HOSTFILE=$(realpath "$HOSTFILE")  # before the cd below: relative to where you run this
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-$PWD/.venv}
NP=${NP:-$(awk '{for (i = 1; i <= NF; i++) if ($i ~ /^slots=/) {split($i, s, "="); n += s[2]}} END {print n}' "$HOSTFILE")}
opts=(-np "$NP" --hostfile "$HOSTFILE" -bind-to none -map-by slot --allow-run-as-root)
for var in PATH LD_LIBRARY_PATH PYTHONPATH TF_CPP_MIN_LOG_LEVEL HOROVOD_CYCLE_TIME HOROVOD_FUSION_THRESHOLD \
           HOROVOD_HIERARCHICAL_ALLREDUCE NCCL_DEBUG CUDA_VISIBLE_DEVICES; do
  [[ -n "${!var:-}" ]] && opts+=(-x "$var")
done
if [[ -n "${SSH_ARGS:-}" ]]; then
  opts+=(--mca plm_rsh_agent ssh --mca plm_rsh_args "$SSH_ARGS")
fi
case "${FABRIC:-tcp}" in
  tcp) opts+=(--mca pml ob1 --mca btl tcp,self,vader)
       if [[ -n "${IFACE:-}" ]]; then
         opts+=(--mca btl_tcp_if_include "$IFACE" --mca oob_tcp_if_include "$IFACE" -x NCCL_SOCKET_IFNAME="$IFACE")
       fi ;;
  ib)  opts+=(--mca pml ucx -x UCX_NET_DEVICES)
       if [[ -n "${IFACE:-}" ]]; then opts+=(--mca oob_tcp_if_include "$IFACE"); fi ;;
  *)   echo "FABRIC must be tcp or ib, got $FABRIC" >&2; exit 2 ;;
esac
exec mpirun "${opts[@]}" "$VENV/bin/python" -m hvdtrain ${ARGS:-}
