#!/usr/bin/env bash
# Host discovery for elastic training (launch/elastic.sh): print one "hostname:slots" line per host
# that may run workers now; Horovod's driver runs this every second and adds or removes workers.
#
# Here: the lines of HOSTS_FILE (edit it while the job runs). Without one, this machine alone,
# as SLOTS (default 2) one-slot "hosts" under different names (localhost, 127.0.0.1, its IPv4
# addresses): Horovod blacklists the whole host of a worker that fails, so on one machine a
# single "localhost:2" would lose both workers when one dies.
# On a scheduler, print its current allocation instead (e.g. from `scontrol show hostnames`).
if [[ -n "${HOSTS_FILE:-}" ]]; then
  exec cat "$HOSTS_FILE"
fi
names=$({ echo localhost; echo 127.0.0.1; hostname -I 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9.]+$'; } \
  | head -n "${SLOTS:-2}")
if (( $(wc -l <<<"$names") < ${SLOTS:-2} )); then
  echo "discover_hosts.sh: this machine has only $(wc -l <<<"$names") names for ${SLOTS:-2} slots" >&2
fi
sed 's/$/:1/' <<<"$names"
