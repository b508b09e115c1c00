#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, private to one directory, for testing the sbatch templates
# (tests/integration/test_slurm.py).
#
#   slurm_cluster.sh install      # as root, on Debian/Ubuntu: slurmctld, slurmd, the clients and munge
#   slurm_cluster.sh start DIR    # a munged, slurmctld and slurmd of their own, state and logs in DIR
#   slurm_cluster.sh stop DIR     # cancels DIR's jobs and stops the three daemons started by `start DIR`
#
# Nothing outside DIR is used or changed by start/stop: munged listens on a socket in DIR with a key of
# its own, the daemons take free ports, and clients reach this cluster through SLURM_CONF=DIR/slurm.conf
# (start prints that line last). A machine's own Slurm or munge, if any, is left alone. The node is
# this host with the CPUs and memory `slurmd -C` detects, in one partition `cpu` without GPUs, so a
# template that hard-codes a GPU request is rejected here as on a CPU-only cluster. Exit status 3
# means "cannot run here" (not root, packages missing, a daemon did not come up); the reason is on
# stderr. Daemons run as root: a test cluster, never a shared one.
set -euo pipefail

die() {
  echo "slurm_cluster.sh: $2" >&2
  exit "$1"
}

install_packages() {
  [ "$(id -u)" = 0 ] || die 3 "installing needs root"
  command -v apt-get >/dev/null || die 3 "no apt-get: install Slurm (slurmctld, slurmd, client) and munge by hand"
  local pkgs=(slurmctld slurmd slurm-client munge)
  export DEBIAN_FRONTEND=noninteractive
  # The package lists of a fresh machine may be missing or stale: refresh them only if the first
  # try fails, so that an up-to-date machine does not pay for it.
  if ! apt-get install -y -q --no-install-recommends "${pkgs[@]}"; then
    if ! { apt-get update -q && apt-get install -y -q --no-install-recommends "${pkgs[@]}"; }; then
      die 3 "apt-get could not install ${pkgs[*]}"
    fi
  fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Wait until "$@" succeeds, at most $1 seconds.
wait_for() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

start() {
  local dir=$1
  [ "$(id -u)" = 0 ] || die 3 "the test cluster's daemons run as root; not root here"
  local bin
  for bin in munged slurmctld slurmd sbatch scontrol; do
    command -v "$bin" >/dev/null || PATH=$PATH:/usr/sbin:/sbin command -v "$bin" >/dev/null \
      || die 3 "$bin is not installed (run: $0 install)"
  done
  export PATH=$PATH:/usr/sbin:/sbin
  mkdir -p "$dir"/{munge,state,spool,log}
  dir=$(cd "$dir" && pwd)
  # munged insists that its key and socket directory belong to the user it runs as and are not
  # readable by others; a key of our own keeps the machine's /etc/munge out of it.
  chmod 700 "$dir/munge"
  head -c 1024 /dev/urandom >"$dir/munge/munge.key"
  chmod 600 "$dir/munge/munge.key"
  # --force: munged refuses to run as root without it.
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed" \
    || die 3 "munged did not start: $(tail -n 5 "$dir/log/munged.log" 2>/dev/null)"

  # The node's real shape (CPUs, sockets, cores, threads, memory), as slurmd itself will report it:
  # a configured node larger than the machine is drained at registration.
  local node
  node=$(slurmd -C | head -n 1)
  local name=${node#NodeName=}
  name=${name%% *}
  cat >"$dir/slurm.conf" <<EOF
ClusterName=spmdrltest
SlurmctldHost=$name(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it starts again (default 120 s).
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
# No cgroups (containers rarely allow them): processes tracked by parentage, no CPU binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Every finished job's state and exit code, one line each (there is no accounting database for sacct).
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
# Finished jobs stay visible to scontrol for 10 minutes.
MinJobAge=600
ReturnToService=2
# The backfill scheduler, which starts a requeued job once it is eligible again, every 2 s (default 30).
SchedulerParameters=bf_interval=2
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=cpu Nodes=$name Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF" || die 3 "slurmctld did not start: $(tail -n 5 "$dir/log/slurmctld.log" 2>/dev/null)"
  slurmd -f "$SLURM_CONF" || die 3 "slurmd did not start: $(tail -n 5 "$dir/log/slurmd.log" 2>/dev/null)"
  # The node is usable once slurmd has registered and the controller marks it idle.
  if ! wait_for 60 bash -c "sinfo -h -n '$name' -o %t | grep -qx idle"; then
    echo "node state: $(sinfo -h -o '%t %E' 2>&1)" >&2
    tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
    stop "$dir"
    die 3 "the node did not become idle within 60 s"
  fi
  echo "SLURM_CONF=$SLURM_CONF"
}

# The pid in a pid file, if that process still runs.
live_pid() {
  local pid
  [ -f "$1" ] && pid=$(cat "$1") && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

stop_pid_file() {
  local pid
  pid=$(live_pid "$1") || return 0
  kill "$pid" 2>/dev/null || true
  wait_for 30 bash -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
}

stop() {
  local dir
  dir=$(cd "$1" && pwd)
  export PATH=$PATH:/usr/sbin:/sbin SLURM_CONF=$dir/slurm.conf
  if [ -f "$SLURM_CONF" ] && live_pid "$dir/slurmctld.pid" >/dev/null; then
    # Jobs first: their processes belong to slurmd's step daemons, which outlive a stopped slurmd.
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086  # one argument per job id
      scancel $jobs || true
      # shellcheck disable=SC2016  # expanded by the inner bash, at each try
      wait_for 60 bash -c '[ -z "$(squeue -h -o %i)" ]' || echo "slurm_cluster.sh: jobs still listed: $(squeue -h)" >&2
    fi
  fi
  stop_pid_file "$dir/slurmd.pid"
  stop_pid_file "$dir/slurmctld.pid"
  stop_pid_file "$dir/munge/munged.pid"
}

case "${1:-}" in
  install) install_packages ;;
  start) start "${2:?usage: $0 start DIR}" ;;
  stop) stop "${2:?usage: $0 stop DIR}" ;;
  *) die 2 "usage: $0 install | start DIR | stop DIR" ;;
esac
