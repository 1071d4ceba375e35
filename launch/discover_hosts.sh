#!/usr/bin/env bash
# Host discovery for elastic training (launch/elastic.sh): print one "hostname:slots" line per host
# that may run workers now; Horovod's driver runs this every second and adds or removes workers.
#
# Here: the lines of HOSTS_FILE (edit it while the job runs), or "localhost:SLOTS" without one.
# On a scheduler, print its current allocation instead (e.g. from `scontrol show hostnames`).
if [[ -n "${HOSTS_FILE:-}" ]]; then
  exec cat "$HOSTS_FILE"
fi
echo "localhost:${SLOTS:-2}"
