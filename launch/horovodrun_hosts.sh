#!/usr/bin/env bash
# Cluster with horovodrun: ranks started over ssh by Horovod's launcher, with Gloo or MPI.
#
# Edit (or set in the environment):
#   HOSTS     "host1:slots,host2:slots" (slots = GPUs per host), or HOSTFILE with lines "host slots=N"
#             (as launch/hostfile.example; comments and blank lines allowed)
#   NP        total ranks (default: the sum of the slots)
#   IFACE     network interface(s) the ranks talk over, e.g. "eth0" (comma-separated):
#             passed as --network-interfaces (Gloo: HOROVOD_GLOO_IFACE; NCCL: NCCL_SOCKET_IFNAME)
#   SSH_KEY   ssh identity file for reaching the hosts; SSH_PORT if not 22
#   MODE      "gloo" (default) or "mpi"
#   ARGS      hvdtrain flags (see: python -m hvdtrain --help); flags given to this script follow them
#   VENV      the virtual environment, at the same path on every host (default: .venv here)
# Run:  HOSTS=node1:4,node2:4 bash launch/horovodrun_hosts.sh [hvdtrain flags...]
# Ranks start in the repository's directory, on every host alike: relative paths in ARGS resolve
# against it, not against the directory you run this from.
#
# Horovod 0.28.1 note: Gloo's process-set connections bind to the address that each host's hostname
# resolves to, whatever --network-interfaces says, so hostnames must resolve to routable addresses.
set -euo pipefail
if [[ -n "${HOSTFILE:-}" ]]; then
  [[ -f "$HOSTFILE" ]] || { echo "$0: no hostfile $HOSTFILE (from $PWD)" >&2; exit 2; }
  HOSTFILE=$(realpath "$HOSTFILE")  # before the cd below: relative to where you run this
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-$PWD/.venv}
if [[ -n "${HOSTFILE:-}" ]]; then
  # As -H: horovodrun's own --hostfile reader fails on comments and blank lines.
  HOSTS=$(awk '{sub(/\r$/, ""); sub(/#.*/, "")} NF {slots = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) slots = substr($i, 7)
               printf "%s%s:%s", sep, $1, slots; sep = ","}' "$HOSTFILE")
  [[ -n "$HOSTS" ]] || { echo "$0: no hosts in $HOSTFILE" >&2; exit 2; }
fi
: "${HOSTS:?set HOSTS=host1:slots,host2:slots or HOSTFILE}"
total=$(tr ',' '\n' <<<"$HOSTS" | awk -F: '{n += ($2 == "" ? 1 : $2)} END {print n}')
opts=(-np "${NP:-$total}" -H "$HOSTS" "--${MODE:-gloo}")
[[ -n "${IFACE:-}" ]] && opts+=(--network-interfaces "$IFACE")
[[ -n "${SSH_KEY:-}" ]] && opts+=(--ssh-identity-file "$SSH_KEY")
[[ -n "${SSH_PORT:-}" ]] && opts+=(--ssh-port "$SSH_PORT")
exec "$VENV/bin/horovodrun" "${opts[@]}" "$VENV/bin/python" -m hvdtrain ${ARGS:-} "$@"
