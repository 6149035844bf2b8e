#!/usr/bin/env bash
# A real Slurm on this machine: slurmctld + one slurmd per node on loopback, all state in one directory.
#
#   scripts/slurm_local.sh install        Debian's slurmctld, slurmd and clients (22.05 on bookworm)
#   scripts/slurm_local.sh start DIR [N]  write DIR/slurm.conf, start slurmctld and N slurmd (default 1), wait
#                                         until every node is idle
#   scripts/slurm_local.sh stop DIR       stop the daemons DIR's pid files name, wait until they are gone
#
# After `start`, point the clients at it: export SLURM_CONF=DIR/slurm.conf (sbatch passes it on to the
# job, so srun inside the job finds it too). One node named after this host, or N nodes n0..n{N-1} (one
# slurmd each on this host, their own ports and spool dirs), 2 CPUs a node, ports picked free, auth/none
# (no munge needed on one host; a real cluster uses auth/munge, docs/slurm.md), requeue on.
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

USED_PORTS=" "
next_port() { # PORT: a port free now, and not handed out before by this script (no subshell: it keeps count)
  while :; do
    PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    [[ "$USED_PORTS" == *" $PORT "* ]] || break
  done
  USED_PORTS+="$PORT "
}

pid_of() { if [ -s "$1" ]; then cat "$1"; fi; }

start() {
  local dir=$1 nodes=${2:-1}
  have_slurm || die "slurmctld/slurmd/sbatch not found: run scripts/slurm_local.sh install (or scripts/setup.sh test)"
  [ "$(id -u)" = 0 ] || die "slurmd must run as root to start jobs as their user (this is root-only, like CI here)"
  [[ "$nodes" =~ ^[1-4]$ ]] || die "NODES must be 1..4 (got $nodes)"
  mkdir -p "$dir"/{state,spool,log}
  dir=$(cd "$dir" && pwd)
  local host ctld_port names=() lines="" i
  host=$(hostname -s)
  next_port
  ctld_port=$PORT
  if [ "$nodes" = 1 ]; then # the host itself
    names=("$host")
    next_port
    lines="NodeName=$host NodeAddr=127.0.0.1 Port=$PORT CPUs=2 State=UNKNOWN"
  else # several slurmd on this host, each a node with its own name, port and spool dir (%n)
    for ((i = 0; i < nodes; i++)); do
      names+=("n$i")
      next_port
      lines+="NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$PORT CPUs=2 State=UNKNOWN"$'\n'
    done
  fi
  local all
  all=$(IFS=,; echo "${names[*]}")
  cat >"$dir/slurm.conf" <<EOF
ClusterName=parwatch-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
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
$lines
PartitionName=local Nodes=$all Default=YES MaxTime=30 State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -c -f "$dir/slurm.conf" || die "slurmctld did not start: $(tail -5 "$dir/log/slurmctld.log" 2>/dev/null)"
  local name
  for name in "${names[@]}"; do
    slurmd -f "$dir/slurm.conf" -N "$name" ||
      die "slurmd $name did not start: $(tail -5 "$dir/log/slurmd-$name.log" 2>/dev/null)"
  done
  local deadline=$((SECONDS + START_DEADLINE_S)) states=""
  while [ $SECONDS -lt $deadline ]; do
    states=$(sinfo -h -N -o "%N %T" 2>/dev/null || true)
    if [ "$(awk '$2 == "idle"' <<<"$states" | wc -l)" = "$nodes" ]; then
      echo "export SLURM_CONF=$dir/slurm.conf"
      return 0
    fi
    awk '$2 ~ /^(down|drain)/ {print $1}' <<<"$states" | while read -r name; do
      scontrol update NodeName="$name" State=RESUME >/dev/null 2>&1 || true
    done
    sleep 0.2
  done
  stop "$dir" >/dev/null 2>&1 || true
  die "nodes not idle within ${START_DEADLINE_S}s (${states//$'\n'/; }); logs in $dir/log"
}

stop() {
  local dir=$1 pids=() pid f
  for f in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
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
  start) [ -n "${2:-}" ] || die "usage: $0 start DIR [NODES]"; start "$2" "${3:-1}" ;;
  stop) [ -n "${2:-}" ] || die "usage: $0 stop DIR"; stop "$2" ;;
  *) die "usage: $0 install | start DIR [NODES] | stop DIR" ;;
esac
