#!/usr/bin/env bash
# Elastic training: workers may die, be preempted, or join while the job runs (Horovod Elastic).
#
# Horovod's elastic driver runs the host-discovery script (default launch/discover_hosts.sh) every
# second; it prints one "host:slots" line per host that may run workers now. When a worker dies,
# Horovod blacklists its host (and ends the other workers there); the workers on the other hosts
# roll back to their last in-memory commit (--commit-every steps) and continue with the learning
# rate and data shards of the new world size. Hosts that appear in the list get workers, up to
# MAX_NP. (On one machine the default discovery lists it under several names, one slot each.)
#
# Edit (or set in the environment):
#   DISCOVER  the host-discovery script (default: launch/discover_hosts.sh, which reads HOSTS_FILE)
#   NP, MIN_NP, MAX_NP   workers to start with, fewest to keep going, most to use
#   IFACE     network interface the workers talk over. Default: lo for the default discovery
#             without HOSTS_FILE (this machine only), else the interface of the default route.
#             (Horovod's elastic driver needs it to start on fewer than two hosts.)
#   ARGS      hvdtrain flags (see: python -m hvdtrain --help); flags given to this script follow
#             them; LOG_DIR the run directory
#   VENV      the virtual environment, at the same path on every host (default: .venv here)
# Run:  HOSTS_FILE=/shared/hosts.txt NP=4 MIN_NP=2 MAX_NP=8 bash launch/elastic.sh [hvdtrain flags...]
# Horovod's driver waits (up to HOROVOD_ELASTIC_TIMEOUT, 600 s) for NP slots before it starts.
# Workers start in the repository's directory, on every host alike: relative paths in ARGS and
# LOG_DIR resolve against it, not against the directory you run this from.
set -euo pipefail
# Paths given relative to where you run this, before the cd below.
for var in HOSTS_FILE DISCOVER; do
  if [[ -n "${!var:-}" ]]; then
    path=$(realpath -e -- "${!var}" 2>/dev/null) || { echo "$0: $var: no such file: ${!var} (from $PWD)" >&2; exit 2; }
    export "$var=$path"
  fi
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-$PWD/.venv}
DISCOVER=${DISCOVER:-$PWD/launch/discover_hosts.sh}
NP=${NP:-2}
MAX_NP=${MAX_NP:-$NP}
ARGS=${ARGS:-}
if [[ "$DISCOVER" == "$PWD/launch/discover_hosts.sh" && -z "${HOSTS_FILE:-}" ]]; then
  # This machine alone, under MAX_NP names (see discover_hosts.sh): the workers talk over
  # loopback, and each takes its share of the cores unless ARGS says otherwise.
  export SLOTS=$MAX_NP
  names=$(bash "$DISCOVER" 2>/dev/null | wc -l)
  if (( names < NP )); then  # Horovod's driver would wait 10 minutes for slots that never appear
    echo "$0: this machine has $names names for NP=$NP one-slot workers; list hosts in HOSTS_FILE" >&2
    exit 2
  fi
  IFACE=${IFACE:-lo}
  [[ "$ARGS" == *--threads* ]] || ARGS="$ARGS --threads $(( $(nproc) / MAX_NP > 0 ? $(nproc) / MAX_NP : 1 ))"
fi
IFACE=${IFACE:-$(awk '$2 == "00000000" {print $1; exit}' /proc/net/route)}
if [[ -z "$IFACE" ]]; then
  echo "$0: no default route to take the network interface from; set IFACE (e.g. IFACE=eth0)" >&2
  exit 2
fi
# Horovod runs the discovery script through a shell: quoted, so that a path with spaces works.
exec "$VENV/bin/horovodrun" -np "$NP" --min-np "${MIN_NP:-1}" --max-np "$MAX_NP" \
  --host-discovery-script "$(printf %q "$DISCOVER")" --network-interfaces "$IFACE" \
  "$VENV/bin/python" -m hvdtrain --elastic --log-dir "${LOG_DIR:-runs/elastic}" $ARGS "$@"
