#!/bin/bash
# A single-node Slurm on this machine for tests/test_slurm_job.py: `start` (installs Debian's slurm-wlm and munge
# when missing; needs root and apt), `stop`. The node has this machine's CPUs; nothing is left running after stop.
set -euo pipefail
STATE=${SLURM_TEST_STATE:-/tmp/mgrpo-slurm}
case "${1:-}" in
start)
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    [ "$(id -u)" = 0 ] || { echo "error: Slurm is not installed and installing it needs root" >&2; exit 2; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
  fi
  mkdir -p "$STATE"/{spool,ctld,log} /run/munge /etc/slurm
  chown munge:munge /run/munge
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  pgrep -x munged >/dev/null || runuser -u munge -- munged
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  cat > /etc/slurm/slurm.conf <<EOF
ClusterName=mgrpo-test
SlurmctldHost=$host
AuthType=auth/munge
SlurmUser=root
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdSpoolDir=$STATE/spool
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  slurmctld -c 2>/dev/null || slurmctld
  slurmd
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE "^(idle|mixed|allocated)"; then echo "slurm up: $host, $cpus CPUs"; exit 0; fi
    sleep 1
  done
  echo "error: the Slurm node did not come up; see $STATE/log" >&2
  exit 1
  ;;
stop)
  scancel --user "$(id -un)" 2>/dev/null || true
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  ;;
*)
  echo "usage: $0 start|stop" >&2
  exit 2
  ;;
esac
