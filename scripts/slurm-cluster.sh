#!/usr/bin/env bash
# A one-node Slurm on this machine, for tests/test_slurm.py: Debian's slurm-wlm and munge, a
# slurm.conf for this host, then munged, slurmctld and slurmd on localhost. Idempotent: a cluster
# already up with this configuration is left running; a changed configuration restarts it. Run as
# root. It leaves alone a slurm.conf it did not write (a machine with a Slurm of its own), and
# exits 0 there: the suite goes on, and tests/test_slurm.py uses that Slurm if it fits or skips.
set -euo pipefail
conf=/etc/slurm/slurm.conf
mark="# written by hvdtrain's scripts/slurm-cluster.sh"
if [[ -f $conf ]] && ! grep -qxF "$mark" "$conf"; then
  echo "slurm-cluster.sh: $conf exists and was not written by this script: leaving this machine's Slurm alone" >&2
  exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "slurm-cluster.sh: installing slurm-wlm and munge"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi
host=$(hostname -s)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
# RequeueExit=75: a job hvdtrain stopped on a signal after checkpointing (exit status 75) is
# requeued and resumes. KillWait=30 (Slurm's default): hvdtrain must not depend on it.
new=$(cat <<CONF
$mark
ClusterName=hvdtrain
SlurmctldHost=${host}(127.0.0.1)
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobRequeue=1
RequeueExit=75
KillWait=30
NodeName=${host} NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
)
if [[ ! -f $conf ]] || [[ "$(cat "$conf")" != "$new" ]]; then
  echo "$new" > "$conf"
  pkill -x slurmd || true; pkill -x slurmctld || true
  while pgrep -x 'slurmd|slurmctld' >/dev/null; do sleep 0.2; done
fi
chown munge:munge /run/munge
pgrep -x munged >/dev/null || runuser -u munge -- munged
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 30); do
  if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)$'; then sinfo; exit 0; fi
  sleep 1
done
echo "slurm-cluster.sh: Slurm did not come up: $(sinfo 2>&1 | tail -2)" >&2
tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2
exit 1
