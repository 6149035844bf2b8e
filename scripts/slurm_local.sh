#!/usr/bin/env bash
# A real one-node Slurm on this machine: slurmctld + slurmd on loopback, all state in one directory.
#
#   scripts/slurm_local.sh install        Debian's slurmctld, slurmd and clients (22.05 on bookworm)
#   scripts/slurm_local.sh start DIR      write DIR/slurm.conf, start both daemons, wait until the node is idle
#   scripts/slurm_local.sh stop DIR       stop the daemons DIR's pid files name, wait until they are gone
#
# After `start`, point the clients at it: export SLURM_CONF=DIR/slurm.conf (sbatch passes it on to the
# job, so srun inside the job finds it too). One node named after this host, 2 CPUs, ports picked free,
# auth/none (no munge needed on one host; a real cluster uses auth/munge, docs/slurm.md), requeue on.
# The tests (tests/integration/test_slurm.py) start and stop it in a fixture; nothing is left running.
set -euo pipefail

PY=${PYTHON:-python3}
START_DEADLINE_S=${SLURM_LOCAL_START_DEADLINE_S:-30}

die() { echo "slurm_local: $*" >&2; exit 1; }

have_slurm() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; }

install() {
  have_slurm && return 0
  local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client >/dev/null
}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

pid_of() { if [ -s "$1" ]; then cat "$1"; fi; }

start() {
  local dir=$1
  have_slurm || die "slurmctld/slurmd/sbatch not found: run scripts/slurm_local.sh install (or scripts/setup.sh test)"
  [ "$(id -u)" = 0 ] || die "slurmd must run as root to start jobs as their user (this is root-only, like CI here)"
  mkdir -p "$dir"/{state,spool,log}
  dir=$(cd "$dir" && pwd)
  local node ctld_port slurmd_port
  node=$(hostname -s)
  ctld_port=$(free_port); slurmd_port=$(free_port)
  while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done
  cat >"$dir/slurm.conf" <<EOF
ClusterName=parwatch-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
# Test pending jobs every second (default 60): a requeued job starts as soon as it may.
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
# SIGTERM to SIGKILL when a job ends or is requeued (default 30 s); a requeued job waits for it.
KillWait=3
# A requeued job may start again cred_expire + 1 s after the requeue (default 120; 5 is the least).
AuthInfo=cred_expire=5
MinJobAge=600
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=30 State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -c -f "$dir/slurm.conf" || die "slurmctld did not start: $(tail -5 "$dir/log/slurmctld.log" 2>/dev/null)"
  slurmd -f "$dir/slurm.conf" -N "$node" || die "slurmd did not start: $(tail -5 "$dir/log/slurmd.log" 2>/dev/null)"
  local deadline=$((SECONDS + START_DEADLINE_S)) state=""
  while [ $SECONDS -lt $deadline ]; do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
    case "$state" in
      idle) echo "export SLURM_CONF=$dir/slurm.conf"; return 0 ;;
      down*|drain*) scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
  done
  stop "$dir" >/dev/null 2>&1 || true
  die "node $node not idle within ${START_DEADLINE_S}s (state: ${state:-none}); logs in $dir/log"
}

stop() {
  local dir=$1 pids=() pid
  for f in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
    pid=$(pid_of "$f")
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" && pids+=("$pid")
    fi
  done
  local deadline=$((SECONDS + 15))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  return 0
}

case "${1:-}" in
  install) install ;;
  start) [ -n "${2:-}" ] || die "usage: $0 start DIR"; start "$2" ;;
  stop) [ -n "${2:-}" ] || die "usage: $0 stop DIR"; stop "$2" ;;
  *) die "usage: $0 install | start DIR | stop DIR" ;;
esac
