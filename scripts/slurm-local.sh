#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, with accounting: munged, MariaDB, slurmdbd, slurmctld and
# slurmd, all Debian's packages. For trying headlab's SLURM launchers without a cluster, and for the tests.
#
#   scripts/slurm-local.sh up       install what is missing (as root, with apt), start what is not running
#   scripts/slurm-local.sh status   exit 0 when the node answers sinfo (idle, mixed or allocated), else 1
#   scripts/slurm-local.sh down     stop the daemons this script started, and only those
#
# Idempotent: `up` on a running cluster returns at once. The daemons it started are recorded in
# $HEADLAB_SLURM_STATE (default /var/lib/headlab-slurm/started); `down` stops exactly those. Daemons get
# no inherited stdout/stderr, so a caller capturing this script's output is not held open. It writes
# /etc/slurm/slurm.conf and slurmdbd.conf only where none exists, or where it wrote them before.
set -euo pipefail

STATE_DIR=${HEADLAB_SLURM_STATE:-/var/lib/headlab-slurm}
STARTED=$STATE_DIR/started
CONF_DIR=/etc/slurm
MARK="# written by headlab scripts/slurm-local.sh"
HOST=$(hostname)
CLUSTER=headlab
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)

say() { echo "slurm-local: $*" >&2; }
die() { say "$*"; exit 1; }
running() { pgrep -x "$1" >/dev/null 2>&1; }
record() { mkdir -p "$STATE_DIR"; grep -qx "$1" "$STARTED" 2>/dev/null || echo "$1" >>"$STARTED"; }

node_up() {
    local state
    state=$(timeout 10 sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1) || return 1
    [[ $state == idle* || $state == mixed* || $state == allocated* ]]
}

wait_for() {  # seconds, description, command...
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq "$seconds"); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 1
    done
    die "$what did not come up within ${seconds}s (logs: /var/log/slurm, /var/log/mysql)"
}

install() {
    local missing=()
    for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    ((${#missing[@]} == 0)) && return 0
    [[ $(id -u) == 0 ]] || die "missing ${missing[*]}: run as root to install them"
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
        { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
}

ours() { [[ ! -e $1 ]] || head -1 "$1" | grep -qx "$MARK"; }

write_configs() {
    mkdir -p "$CONF_DIR" /var/log/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd
    local cpus mem
    # nproc heeds OMP_NUM_THREADS (make test sets it to 1): the node has the cores this process may run on
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    mem=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10))
    if ours "$CONF_DIR/slurm.conf"; then
        cat >"$CONF_DIR/slurm.conf" <<EOF
$MARK
ClusterName=$CLUSTER
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# a requeued job may start again after 10 s, not 120; a cancelled one is killed 10 s after SIGTERM, not 30
AuthInfo=cred_expire=10
KillWait=10
MpiDefault=none
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
NodeName=$HOST CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    fi
    if ours "$CONF_DIR/slurmdbd.conf"; then
        cat >"$CONF_DIR/slurmdbd.conf" <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
EOF
        chmod 600 "$CONF_DIR/slurmdbd.conf"
    fi
}

start_munge() {
    running munged && return 0
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1
    record munged
}

start_mariadb() {
    if ! running mariadbd && ! running mysqld; then
        mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
        (cd / && exec setsid /usr/bin/mysqld_safe) </dev/null >/dev/null 2>&1 &
        record mariadbd
    fi
    wait_for 60 MariaDB mysqladmin ping --silent
    mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
}

start_slurm() {
    if ! running slurmdbd; then
        /usr/sbin/slurmdbd </dev/null >/dev/null 2>&1
        record slurmdbd
    fi
    wait_for 60 slurmdbd sacctmgr -n list cluster
    sacctmgr -n list cluster format=cluster | grep -qw "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
    if ! running slurmctld; then
        /usr/sbin/slurmctld </dev/null >/dev/null 2>&1
        record slurmctld
    fi
    if ! running slurmd; then
        /usr/sbin/slurmd </dev/null >/dev/null 2>&1
        record slurmd
    fi
    wait_for 60 "the node $HOST" node_up_or_resume
}

node_up_or_resume() {
    node_up && return 0
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    return 1
}

up() {
    node_up && { say "up ($HOST idle)"; return 0; }
    install
    write_configs
    start_munge
    start_mariadb
    start_slurm
    say "up: $(sinfo -h -o '%P %D %T %C')"
}

down() {
    [[ -s $STARTED ]] || { say "nothing started by this script"; return 0; }
    local daemon
    for daemon in slurmd slurmctld slurmdbd mariadbd munged; do
        grep -qx "$daemon" "$STARTED" || continue
        case $daemon in
        mariadbd) mysqladmin shutdown >/dev/null 2>&1 || pkill -x mariadbd || true ;;
        *) pkill -x "$daemon" || true ;;
        esac
        for _ in $(seq 30); do running "$daemon" || break; sleep 1; done
    done
    rm -f "$STARTED"
    say "down"
}

case ${1:-} in
up) up ;;
down) down ;;
status) node_up && { sinfo -h -o '%P %D %T %C'; exit 0; } || { say "not running"; exit 1; } ;;
*) die "usage: scripts/slurm-local.sh up|down|status" ;;
esac
