#!/usr/bin/env bash
# A real multi-node Slurm cluster on this one machine, for tests and trying things out:
# Debian's Slurm with several slurmd daemons (nodes n1..nN), munge, and slurmdbd + MariaDB so that
# sacct works. Needs root and apt (Debian/Ubuntu). Idempotent: `up` on a running cluster checks it,
# `down` stops exactly the daemons it started (by PID file).
#
#   sbatch/local_cluster.sh up|down|status        (make slurm-up / make slurm-down)
#
# Settings (environment): SLURM_LOCAL_NODES (3: a 2-node job plus a spare for node-failure tests), SLURM_LOCAL_CPUS (CPUs per node: nproc),
# SLURM_LOCAL_DIR (/var/lib/hpctrain-slurm).
set -euo pipefail

NODES=${SLURM_LOCAL_NODES:-3}
CPUS=${SLURM_LOCAL_CPUS:-$(nproc)}
DIR=${SLURM_LOCAL_DIR:-/var/lib/hpctrain-slurm}
CONF=/etc/slurm
CLUSTER=hpctrain
MUNGE_PID=/run/munge/munged.pid                # munged writes it itself
MARIADB_PID=/run/mysqld/hpctrain-mariadb.pid  # mariadbd runs as mysql: it cannot write into $DIR/run
names() { seq -f "n%g" 1 "$NODES"; }
say() { echo "slurm-local: $*"; }
die() { echo "slurm-local: error: $*" >&2; exit 1; }
# Numbers only: they go into $(( )), which evaluates any text (a[$(cmd)] would run cmd, as root).
[[ $NODES =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_NODES=$NODES: not a positive integer"
[[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_CPUS=$CPUS: not a positive integer"

alive() {  # alive PIDFILE: the process in it runs (a zombie does not count)
  [ -s "$1" ] || return 1
  local pid; pid=$(cat "$1")
  [ -d "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local t=$1 what=$2; shift 2
  for _ in $(seq $((t * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  die "$what did not come up within ${t}s (logs in $DIR/log)"
}

install_packages() {
  local pkgs="slurmctld slurmd slurm-client munge slurmdbd mariadb-server"
  if ! dpkg -s $pkgs >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "installing Slurm needs root (apt-get install $pkgs)"
    command -v apt-get >/dev/null || die "no apt-get: install Slurm 22+ with slurmdbd yourself"
    say "installing $pkgs"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # No systemd here: postinst's service starts are denied (harmless); we start daemons ourselves.
    apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
  fi
}

write_config() {
  mkdir -p "$CONF" "$DIR"/{state,log,run,mysql} /run/mysqld /run/munge
  for n in $(names); do mkdir -p "$DIR/spool/$n"; done
  chown mysql:mysql "$DIR/mysql" /run/mysqld
  local last=$((17000 + NODES))
  [ -f "$CONF/slurm.conf" ] && cp "$CONF/slurm.conf" "$DIR/run/slurm.conf.before"
  cat > "$CONF/slurm.conf" <<EOF
# Written by hpctrain sbatch/local_cluster.sh: $NODES nodes on this machine.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
MinJobAge=600
KillWait=5
# A node whose slurmd stops answering is DOWN at the second failed ping, each failing after
# MessageTimeout: ~11 s here (defaults 300 s / 10 s), then its jobs requeue; the node-failure test waits
# for this. Local RPCs answer in milliseconds, so 5 s is ample.
SlurmdTimeout=10
MessageTimeout=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
NodeName=n[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001-$last CPUs=$CPUS RealMemory=8000
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat > "$CONF/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$CONF/slurmdbd.conf"
  # Node names must resolve: torch and submitit use the first node's name as the master address.
  for n in $(names); do
    grep -qE "^127\.0\.0\.1\s.*\b$n\b" /etc/hosts || echo "127.0.0.1 $n" >> /etc/hosts
  done
}

start_munge() {
  alive "$MUNGE_PID" && return
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
                                   chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged --force
  wait_for 10 munged test -s "$MUNGE_PID"
}

start_mariadb() {
  alive "$MARIADB_PID" && return
  [ -d "$DIR/mysql/mysql" ] || mariadb-install-db --user=mysql --datadir="$DIR/mysql" >"$DIR/log/mariadb-install.log" 2>&1
  (mariadbd --user=mysql --datadir="$DIR/mysql" --pid-file="$MARIADB_PID" \
     --socket=/run/mysqld/mysqld.sock --skip-networking=0 --bind-address=127.0.0.1 \
     >"$DIR/log/mariadb.log" 2>&1 &)
  wait_for 30 MariaDB mariadb -e "select 1"
  mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
}

restart_if_reconfigured() {  # daemons started with another slurm.conf (e.g. another node count) must restart
  if [ -f "$DIR/run/slurm.conf.before" ] && ! cmp -s "$DIR/run/slurm.conf.before" "$CONF/slurm.conf" \
     && alive "$DIR/run/slurmctld.pid"; then
    say "slurm.conf changed: restarting slurmctld and slurmd"
    local f
    for f in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid"; do stop_pidfile "$f"; done
  fi
  rm -f "$DIR/run/slurm.conf.before"
}

start_slurm() {
  if ! alive "$DIR/run/slurmdbd.pid"; then
    slurmdbd
    wait_for 30 slurmdbd sacctmgr -n list cluster
  fi
  sacctmgr -n list cluster format=cluster | grep -qw "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
  alive "$DIR/run/slurmctld.pid" || slurmctld
  wait_for 30 slurmctld scontrol ping
  for n in $(names); do
    alive "$DIR/run/slurmd-$n.pid" || slurmd -N "$n"
  done
  local want; want=$(names | paste -sd' ')
  for _ in $(seq 150); do
    idle=$(sinfo -h -N -t idle,mix,alloc -o '%N' | sort -u | paste -sd' ')
    [ "$idle" = "$want" ] && break
    # A node that registered while down (e.g. after slurm-down/up) is resumed explicitly.
    scontrol update nodename="n[1-$NODES]" state=resume >/dev/null 2>&1 || true
    sleep 0.2
  done
  [ "$idle" = "$want" ] || die "nodes not idle (sinfo: $(sinfo -h -N -o '%N %t' | paste -sd' ')); logs in $DIR/log"
}

up() {
  install_packages
  write_config
  start_munge
  start_mariadb
  restart_if_reconfigured
  start_slurm
  say "up: $NODES nodes ($(sinfo -h -N -o '%N:%t' | sort -u | paste -sd' ')), $CPUS CPUs each, state in $DIR"
}

stop_pidfile() {  # stop_pidfile FILE: stop the daemon in FILE (a stopped one too), wait, then insist
  alive "$1" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true; kill -CONT "$pid" 2>/dev/null || true
  rm -f "$1"  # daemons may remove their own PID file before they are gone: track the PID instead
  for _ in $(seq 50); do [ -d "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null || return 0
                          sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

down() {
  local f
  for f in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid" "$DIR/run/slurmdbd.pid" "$MARIADB_PID" "$MUNGE_PID"; do
    stop_pidfile "$f"
  done
  say "down"
}

status() {
  alive "$DIR/run/slurmctld.pid" || { say "not running"; return 1; }
  sinfo -N
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
