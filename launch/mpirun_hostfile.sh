#!/usr/bin/env bash
# Cluster with OpenMPI: one rank per slot of a hostfile, started over ssh by mpirun.
#
# Edit (or set in the environment):
#   HOSTFILE  lines "host slots=N" (N = GPUs per host; see hostfile.example; # starts a comment)
#   NP        total ranks (default: the sum of the slots)
#   IFACE     network interface(s) the ranks talk over, e.g. "eth0" or "ib0" (comma-separated);
#             becomes btl_tcp_if_include / oob_tcp_if_include. Unset: OpenMPI picks.
#   FABRIC    "tcp" (default) or "ib" (InfiniBand through UCX; needs OpenMPI built with UCX)
#   SSH_ARGS  extra ssh options for reaching the hosts, e.g. "-i ~/.ssh/cluster_key"
#   ARGS      hvdtrain flags (see: python -m hvdtrain --help); flags given to this script follow them
#   VENV      the virtual environment, at the same path on every host (default: .venv here)
# Run:  HOSTFILE=hosts.txt bash launch/mpirun_hostfile.sh [hvdtrain flags...]
# Ranks start in the repository's directory, on every host alike: relative paths in ARGS resolve
# against it, not against the directory you run this from.
#
# -bind-to none -map-by slot: hvdtrain pins each rank to its GPU (local rank) and to its own share
# of the host's cores itself; -x exports the environment each rank needs to every host: the paths,
# and every HOROVOD_*, HVDTRAIN_*, NCCL_*, UCX_* and TF_CPP_* variable set here, and TensorFlow's
# TF_ENABLE_ONEDNN_OPTS and TF_USE_LEGACY_KERAS (every rank computes with the same kernels and Keras).
set -euo pipefail
: "${HOSTFILE:?set HOSTFILE to a hostfile (see launch/hostfile.example)}"
[[ -f "$HOSTFILE" ]] || { echo "$0: no hostfile $HOSTFILE (from $PWD)" >&2; exit 2; }
HOSTFILE=$(realpath "$HOSTFILE")  # before the cd below: relative to where you run this
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-$PWD/.venv}
# The slots of the hostfile's hosts, each line "host slots=N" (OpenMPI would give a host without
# slots= one slot per core, and -map-by slot would fill the first host with every rank).
total=$(awk '{sub(/\r$/, ""); sub(/#.*/, "")} NF {slots = 0; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) slots = substr($i, 7)
             if (slots < 1) {print "line " NR ": \"" $0 "\" has no slots=N" > "/dev/stderr"; bad = 1}; n += slots}
             END {print n + 0; exit bad}' "$HOSTFILE") \
  || { echo "$0: every host line of $HOSTFILE needs slots=N (see launch/hostfile.example)" >&2; exit 2; }
NP=${NP:-$total}
opts=(-np "$NP" --hostfile "$HOSTFILE" -bind-to none -map-by slot --allow-run-as-root)
# (Not the per-process variables of a launcher this may itself run under: HOROVOD_RANK, ...)
per_process='^HOROVOD_(RANK|SIZE|LOCAL_RANK|LOCAL_SIZE|CROSS_RANK|CROSS_SIZE|HOSTNAME|CONTROLLER|ELASTIC|GLOO_.*)$'
for var in PATH LD_LIBRARY_PATH PYTHONPATH CUDA_VISIBLE_DEVICES \
           $(compgen -e | grep -E '^((HOROVOD|HVDTRAIN|NCCL|UCX)_|TF_CPP_|TF_ENABLE_ONEDNN_OPTS$|TF_USE_LEGACY_KERAS$)' | grep -v -E "$per_process"); do
  [[ -n "${!var:-}" ]] && opts+=(-x "$var")
done
if [[ -n "${SSH_ARGS:-}" ]]; then
  opts+=(--mca plm_rsh_agent ssh --mca plm_rsh_args "$SSH_ARGS")
fi
case "${FABRIC:-tcp}" in
  tcp) opts+=(--mca pml ob1 --mca btl tcp,self,vader)
       if [[ -n "${IFACE:-}" ]]; then
         opts+=(--mca btl_tcp_if_include "$IFACE" --mca oob_tcp_if_include "$IFACE")
         [[ -n "${NCCL_SOCKET_IFNAME:-}" ]] || opts+=(-x NCCL_SOCKET_IFNAME="$IFACE")  # a user's own wins
       fi ;;
  ib)  opts+=(--mca pml ucx)  # UCX_NET_DEVICES, if set, is exported above
       if [[ -n "${IFACE:-}" ]]; then opts+=(--mca oob_tcp_if_include "$IFACE"); fi ;;
  *)   echo "FABRIC must be tcp or ib, got $FABRIC" >&2; exit 2 ;;
esac
exec mpirun "${opts[@]}" "$VENV/bin/python" -m hvdtrain ${ARGS:-} "$@"
