#!/usr/bin/env bash
# local_slurm.sh - stand up a real multi-node Slurm cluster on this one machine.
#
#   scripts/local_slurm.sh up [--nodes N]   install, configure, start, prove it works
#   scripts/local_slurm.sh down             stop only the daemons that `up` started
#   scripts/local_slurm.sh status           daemons (pid, alive/dead) and sinfo
#
# Runs as root on Debian 12 (Slurm 22.05). No systemd needed: every daemon is
# started here and its pid recorded under the state dir. See docs/local-cluster.md.
set -Eeuo pipefail

readonly STATE="${HPC_TRAIN_SLURM_STATE:-/var/tmp/hpc_train-slurm}"
readonly ETC=/etc/slurm
readonly CONF="$ETC/slurm.conf"
readonly DBD_CONF="$ETC/slurmdbd.conf"
readonly LOG="$STATE/log"
readonly RUN="$STATE/run"
readonly SPOOL="$STATE/spool"
readonly DB="$STATE/mariadb"
readonly MYCNF="$STATE/mariadb.cnf"
readonly MUNGE_DIR="$STATE/munge"
readonly PIDS="$STATE/pids"
readonly MUNGE_KEY=/etc/munge/munge.key
readonly HOSTS=/etc/hosts
readonly HOSTS_BEGIN="# BEGIN hpc_train local slurm (scripts/local_slurm.sh)"
readonly HOSTS_END="# END hpc_train local slurm"
readonly CONF_MARK="# Written by hpc_train scripts/local_slurm.sh"

readonly CLUSTER=hpctrain
readonly ACCOUNT=hpctrain
readonly SLURM_USER=slurm
readonly CTLD_PORT=6817
readonly DBD_PORT=6819
readonly DB_PORT=3316
readonly NODE_PORT_BASE=6830
readonly NODE_CPUS=4
readonly NODE_MEM=4000
readonly MAX_NODES=80  # the scale lane (scripts/scale_lane.sh) runs 65; Slurm's own FAQ example runs 100
readonly DEFAULT_NODES=3
readonly PKGS=(slurm-wlm slurmctld slurmd slurm-client munge mariadb-server slurmdbd)

T0=$EPOCHREALTIME
declare -A REC_PID=()
declare -A REC_OWN=()

say() { printf 'local_slurm: %s\n' "$*"; }
warn() { printf 'local_slurm: %s\n' "$*" >&2; }

elapsed() {
    local now=$EPOCHREALTIME
    awk -v a="$T0" -v b="$now" 'BEGIN { printf "%.1f", b - a }'
}

on_err() {
    warn "error: line $1: '$2' exited $3"
    exit 1
}
trap 'on_err "$LINENO" "$BASH_COMMAND" "$?"' ERR

usage() {
    cat <<EOF
usage: $0 up [--nodes N] | down | status
  up       install what is missing, write configs, start munged, mariadbd,
           slurmdbd, slurmctld and N slurmd (nodes n1..nN, default $DEFAULT_NODES,
           max $MAX_NODES), then prove the cluster runs a job. Idempotent.
  down     stop the daemons that 'up' started (by recorded pid).
  status   print each daemon with pid and alive/dead, plus sinfo.
state dir: $STATE (env HPC_TRAIN_SLURM_STATE)
EOF
}

# ---------------------------------------------------------------- processes

log_of() {
    case $1 in
        munged) echo "$MUNGE_DIR/munged.log" ;;
        mariadbd) echo "$LOG/mariadb.log" ;;
        slurmdbd) echo "$LOG/slurmdbd.log" ;;
        slurmctld) echo "$LOG/slurmctld.log" ;;
        slurmd-*) echo "$LOG/slurmd.${1#slurmd-}.log" ;;
        *) echo /dev/null ;;
    esac
}

comm_of() {
    case $1 in
        slurmd-*) echo slurmd ;;
        *) echo "$1" ;;
    esac
}

# fail NAME MESSAGE: say which daemon failed, show the tail of its log, exit 1.
fail() {
    local name=$1 log
    shift
    log=$(log_of "$name")
    warn "FAILED: $name: $*"
    if [[ -s $log ]]; then
        warn "---- last 25 lines of $log ----"
        tail -n 25 "$log" >&2 || true
        warn "----"
    fi
    exit 1
}

# pid_alive NAME PID: the process exists, is not a zombie and is that daemon.
pid_alive() {
    local name=$1 pid=$2 comm stat cmd
    [[ $pid =~ ^[0-9]+$ ]] && ((pid > 1)) || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == "$(comm_of "$name")" ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    case ${stat%% *} in Z | X | x) return 1 ;; esac
    if [[ $name == slurmd-* ]]; then
        cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
        [[ " $cmd" == *" -N ${name#slurmd-} "* ]] || return 1
    fi
    return 0
}

rec_alive() {
    local name=$1
    [[ -n ${REC_PID[$name]:-} ]] && pid_alive "$name" "${REC_PID[$name]}"
}

record_names() {
    local n
    for n in munged mariadbd slurmdbd slurmctld; do echo "$n"; done
    for ((n = 1; n <= MAX_NODES; n++)); do echo "slurmd-n$n"; done
}

load_record() {
    local name pid own
    REC_PID=()
    REC_OWN=()
    [[ -f $PIDS ]] || return 0
    while read -r name pid own; do
        [[ -n $name && $name != \#* ]] || continue
        REC_PID[$name]=$pid
        REC_OWN[$name]=${own:-up}
    done <"$PIDS"
}

pidfile_of() {
    case $1 in
        munged) echo "$MUNGE_DIR/munged.pid" ;;
        mariadbd) echo "$DB/run/mariadbd.pid" ;;
        slurmdbd | slurmctld) echo "$RUN/$1.pid" ;;
        slurmd-*) echo "$RUN/slurmd.${1#slurmd-}.pid" ;;
        *) echo /dev/null ;;
    esac
}

# A daemon missing from the record (say it was deleted) whose pid file in the
# state dir names a live process of that daemon was started by an earlier 'up':
# take it back into the record rather than start a second one.
adopt_from_pidfiles() {
    local name file pid changed=0
    while read -r name; do
        rec_alive "$name" && continue
        file=$(pidfile_of "$name")
        [[ -s $file ]] || continue
        read -r pid <"$file" || continue
        if pid_alive "$name" "${pid:-0}"; then
            REC_PID[$name]=$pid
            REC_OWN[$name]=up
            changed=1
        fi
    done < <(record_names)
    if ((changed)); then save_record; fi
}

save_record() {
    local name tmp="$PIDS.tmp"
    {
        echo "# name pid owner (up = started by local_slurm.sh up; ext = found running, never stopped)"
        while read -r name; do
            [[ -n ${REC_PID[$name]:-} ]] || continue
            echo "$name ${REC_PID[$name]} ${REC_OWN[$name]:-up}"
        done < <(record_names)
    } >"$tmp"
    mv -f "$tmp" "$PIDS"
}

# wait_gone NAME PID SECONDS: 0 once the process is gone (a zombie counts as gone).
wait_gone() {
    local name=$1 pid=$2 i
    for ((i = 0; i < $3 * 10; i++)); do
        pid_alive "$name" "$pid" || return 0
        sleep 0.1
    done
    return 1
}

# stop_daemon NAME: TERM the recorded pid if it is ours, KILL after a grace period.
stop_daemon() {
    local name=$1 pid=${REC_PID[$1]:-} grace=20
    [[ -n $pid ]] || return 0
    if [[ ${REC_OWN[$name]:-up} == up ]] && pid_alive "$name" "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        if ! wait_gone "$name" "$pid" "$grace"; then
            warn "$name (pid $pid) ignored SIGTERM for ${grace}s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            wait_gone "$name" "$pid" 10 || warn "$name (pid $pid) is still there"
        fi
    fi
    unset "REC_PID[$name]" "REC_OWN[$name]"
    save_record
}

# any_alive NAME: some process is that daemon (a look-up only; nothing is signalled).
any_alive() {
    local d
    for d in /proc/[0-9]*; do
        pid_alive "$1" "${d#/proc/}" && return 0
    done
    return 1
}

# wait_pidfile NAME PIDFILE SECONDS: print the pid once the daemon wrote a live one.
# Gives up early when, 2 s after the start, no such process exists at all.
wait_pidfile() {
    local name=$1 file=$2 i pid
    for ((i = 0; i < $3 * 10; i++)); do
        if [[ -s $file ]]; then
            read -r pid <"$file" || true
            if pid_alive "$name" "${pid:-0}"; then
                echo "$pid"
                return 0
            fi
        fi
        if ((i >= 20 && i % 10 == 0)) && ! any_alive "$name"; then return 1; fi
        sleep 0.1
    done
    return 1
}

# ---------------------------------------------------------------- install

pkg_missing() {
    local p out missing=()
    for p in "${PKGS[@]}"; do
        out=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) || out=
        [[ $out == "install ok installed" ]] || missing+=("$p")
    done
    echo "${missing[*]}"
}

install_packages() {
    local missing p cand need_update=0
    missing=$(pkg_missing)
    [[ -n $missing ]] || return 0
    say "installing: $missing"
    for p in $missing; do
        cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ { print $2 }')
        if [[ -z $cand || $cand == "(none)" ]]; then need_update=1; fi
    done
    if ((need_update)); then
        say "apt-get update"
        apt-get update -q </dev/null >"$LOG/apt.log" 2>&1 || fail apt "apt-get update failed (see $LOG/apt.log)"
    fi
    # shellcheck disable=SC2086  # word splitting of the package list is wanted
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        $missing </dev/null >>"$LOG/apt.log" 2>&1; then
        tail -n 25 "$LOG/apt.log" >&2
        warn "FAILED: apt-get install $missing"
        exit 1
    fi
    missing=$(pkg_missing)
    [[ -z $missing ]] || { warn "FAILED: still not installed: $missing"; exit 1; }
    # On a host with systemd, apt may have enabled Debian's own units; they would
    # fight over /etc/slurm with this script. Disable them (no effect without systemd).
    if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
        systemctl disable --now slurmctld slurmd slurmdbd </dev/null >/dev/null 2>&1 || true
    fi
}

# ---------------------------------------------------------------- files

# write_file PATH MODE OWNER CONTENT: write only if different; sets CHANGED=1 if so.
CHANGED=0
write_file() {
    local path=$1 mode=$2 owner=$3 content=$4 tmp
    if [[ -f $path ]] && [[ "$(cat "$path")" == "$content" ]]; then
        chmod "$mode" "$path"
        chown "$owner" "$path"
        return 0
    fi
    if [[ -f $path ]] && ! grep -qF "$CONF_MARK" "$path" && [[ ! -e $path.hpc_train-orig ]]; then
        cp -p "$path" "$path.hpc_train-orig"
        say "saved the existing $path as $path.hpc_train-orig"
    fi
    tmp="$path.tmp.$$"
    printf '%s\n' "$content" >"$tmp"
    chmod "$mode" "$tmp"
    chown "$owner" "$tmp"
    mv -f "$tmp" "$path"
    CHANGED=1
}

# Pre-create a log file owned by the user the daemon writes it as.
touch_log() {
    [[ -e $1 ]] || : >"$1"
    chown "$2" "$1"
    chmod 0640 "$1"
}

make_dirs() {
    local n
    mkdir -p "$STATE" "$LOG" "$RUN" "$SPOOL/ctld" "$DB/run" "$MUNGE_DIR" "$ETC"
    chmod 0755 "$STATE" "$LOG"
    chown root:root "$STATE"
    # Slurm daemons chdir to their log dir and want to write there.
    chown "$SLURM_USER:$SLURM_USER" "$LOG"
    chown "$SLURM_USER:$SLURM_USER" "$RUN" "$SPOOL/ctld"
    chmod 0755 "$RUN"
    chmod 0700 "$SPOOL/ctld"
    # munged refuses a log file in a directory not owned by root or munge.
    chown munge:munge "$MUNGE_DIR"
    chmod 0755 "$MUNGE_DIR"
    chown mysql:mysql "$DB" "$DB/run"
    chmod 0750 "$DB"
    for ((n = 1; n <= MAX_NODES; n++)); do mkdir -p "$SPOOL/slurmd.n$n"; done
    touch_log "$MUNGE_DIR/munged.log" munge:munge
    touch_log "$LOG/mariadb.log" mysql:mysql
    touch_log "$LOG/slurmdbd.log" "$SLURM_USER:$SLURM_USER"
    touch_log "$LOG/slurmctld.log" "$SLURM_USER:$SLURM_USER"
    mkdir -p /run/munge
    chown munge:munge /run/munge
    chmod 0755 /run/munge
}

hosts_block() {
    local n
    echo "$HOSTS_BEGIN"
    for ((n = 1; n <= MAX_NODES; n++)); do printf '127.0.1.%d\tn%d\n' "$n" "$n"; done
    echo "$HOSTS_END"
}

# Map nK -> 127.0.1.K in /etc/hosts in a marked block; rewrite in place (it may
# be a bind mount, so no rename) and only when it differs.
update_hosts() {
    local want cur new
    want=$(hosts_block)
    cur=$(cat "$HOSTS")
    new=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '
        $0 == b { skip = 1; next }
        $0 == e { skip = 0; next }
        !skip { print }' "$HOSTS")
    new=$(printf '%s\n%s' "$new" "$want")
    [[ $cur == "$new" ]] && return 0
    printf '%s\n' "$new" >"$HOSTS"
    say "mapped n1..n$MAX_NODES to 127.0.1.1..$MAX_NODES in $HOSTS"
}

slurm_conf() {
    local nodes=$1 n
    cat <<EOF
$CONF_MARK for a local test cluster.
# State, logs and pid files: $STATE. Do not edit: 'up' rewrites it.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=$SLURM_USER
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/slurmd.%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
SlurmctldParameters=preempt_send_user_signal
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=10
JobRequeue=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((NODE_MEM / NODE_CPUS))
SchedulerParameters=bf_interval=5,sched_interval=5
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
EOF
    for ((n = 1; n <= nodes; n++)); do
        echo "NodeName=n$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((NODE_PORT_BASE + n)) CPUs=$NODE_CPUS RealMemory=$NODE_MEM State=UNKNOWN"
    done
    # batch and urgent keep two nodes, so that an urgent 2-node job must preempt a batch one; the third node
    # joins them only in "spares", where a 2-node job with job.spare_nodes = 1 gets a hot spare.
    local shared=$((nodes < 2 ? nodes : 2))
    echo "PartitionName=batch Nodes=n[1-$shared] Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=30 MaxTime=INFINITE State=UP"
    echo "PartitionName=urgent Nodes=n[1-$shared] PriorityTier=10 MaxTime=INFINITE State=UP"
    if ((nodes > 2)); then
        echo "PartitionName=spares Nodes=n[1-$nodes] PriorityTier=1 MaxTime=INFINITE State=UP"
    fi
}

db_password() {
    local f="$STATE/.dbpass"
    if [[ ! -s $f ]]; then
        (umask 077 && od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >"$f")
    fi
    cat "$f"
}

slurmdbd_conf() {
    cat <<EOF
$CONF_MARK for a local test cluster.
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=$SLURM_USER
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$1
StorageLoc=slurm_acct_db
EOF
}

mariadb_conf() {
    cat <<EOF
$CONF_MARK: MariaDB for slurmdbd only.
[mysqld]
user=mysql
datadir=$DB/data
socket=$DB/run/mysqld.sock
pid-file=$DB/run/mariadbd.pid
log-error=$LOG/mariadb.log
port=$DB_PORT
bind-address=127.0.0.1
skip-name-resolve
skip-log-bin
innodb_buffer_pool_size=128M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
EOF
}

write_configs() {
    local nodes=$1
    write_file "$CONF" 0644 root:root "$(slurm_conf "$nodes")"
    CONF_CHANGED=$CHANGED
    CHANGED=0
    write_file "$DBD_CONF" 0600 "$SLURM_USER:$SLURM_USER" "$(slurmdbd_conf "$(db_password)")"
    DBD_CHANGED=$CHANGED
    CHANGED=0
    write_file "$MYCNF" 0644 root:root "$(mariadb_conf)"
    DB_CHANGED=$CHANGED
    CHANGED=0
}

# ---------------------------------------------------------------- daemons

munge_works() {
    local cred
    cred=$(timeout 5 munge -n </dev/null 2>/dev/null) || return 1
    printf '%s' "$cred" | timeout 5 unmunge >/dev/null 2>&1
}

start_munged() {
    local pid
    if [[ ! -s $MUNGE_KEY ]]; then
        say "creating $MUNGE_KEY"
        mkdir -p "${MUNGE_KEY%/*}"
        (umask 077 && dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none)
    fi
    chown munge:munge "$MUNGE_KEY"
    chmod 0600 "$MUNGE_KEY"
    rec_alive munged && return 0
    if munge_works; then
        # Someone else's munged serves the default socket: use it, never stop it.
        pid=$(cat /run/munge/munged.pid 2>/dev/null) || pid=0
        REC_PID[munged]=${pid:-0}
        REC_OWN[munged]=ext
        save_record
        say "munged: using the one already running (not started here)"
        return 0
    fi
    say "starting munged"
    rm -f "$MUNGE_DIR/munged.pid"
    runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_DIR/munged.pid" \
        --log-file="$MUNGE_DIR/munged.log" </dev/null >>"$MUNGE_DIR/munged.log" 2>&1 9>&- ||
        fail munged "did not start"
    pid=$(wait_pidfile munged "$MUNGE_DIR/munged.pid" 10) || fail munged "no live pid in $MUNGE_DIR/munged.pid"
    REC_PID[munged]=$pid
    REC_OWN[munged]=up
    save_record
    munge_works || fail munged "munge -n | unmunge does not work"
}

mysql_root() {
    mariadb --no-defaults --socket="$DB/run/mysqld.sock" -uroot "$@" </dev/null
}

start_mariadbd() {
    local pid i pw started=0
    if ! rec_alive mariadbd; then
        if [[ ! -d $DB/data/mysql ]]; then
            say "initialising the MariaDB datadir $DB/data"
            mkdir -p "$DB/data"
            chown mysql:mysql "$DB/data"
            mariadb-install-db --defaults-file="$MYCNF" --user=mysql \
                --auth-root-authentication-method=socket --skip-test-db \
                </dev/null >>"$LOG/mariadb.log" 2>&1 || fail mariadbd "mariadb-install-db failed"
        fi
        say "starting mariadbd"
        setsid /usr/sbin/mariadbd --defaults-file="$MYCNF" </dev/null >>"$LOG/mariadb.log" 2>&1 9>&- &
        pid=$!
        REC_PID[mariadbd]=$pid
        REC_OWN[mariadbd]=up
        save_record
        started=1
    fi
    for ((i = 0; i < 300; i++)); do
        mariadb-admin --no-defaults --socket="$DB/run/mysqld.sock" -uroot ping >/dev/null 2>&1 && break
        rec_alive mariadbd || fail mariadbd "exited while starting"
        sleep 0.1
    done
    ((i < 300)) || fail mariadbd "not answering on $DB/run/mysqld.sock after 30 s"
    if ((started)) || [[ ! -e $DB/.provisioned ]]; then
        pw=$(db_password)
        mysql_root -e "
            CREATE DATABASE IF NOT EXISTS slurm_acct_db;
            CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pw';
            CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
            ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pw';
            ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
            FLUSH PRIVILEGES;" >>"$LOG/mariadb.log" 2>&1 || fail mariadbd "creating slurm_acct_db and its user failed"
        : >"$DB/.provisioned"
    fi
}

# start_slurm_daemon NAME PIDFILE CMD...: start a self-daemonising Slurm daemon.
start_slurm_daemon() {
    local name=$1 pidfile=$2 pid
    shift 2
    say "starting $name"
    rm -f "$pidfile"
    "$@" </dev/null >>"$(log_of "$name")" 2>&1 9>&- || fail "$name" "'$*' exited $?"
    pid=$(wait_pidfile "$name" "$pidfile" 20) || fail "$name" "no live pid in $pidfile"
    REC_PID[$name]=$pid
    REC_OWN[$name]=up
    save_record
}

sacctmgr_q() { timeout 20 sacctmgr -i -n -P "$@" </dev/null; }

start_slurmdbd() {
    local i
    if ((DBD_CHANGED)) && rec_alive slurmdbd; then stop_daemon slurmdbd; fi
    rec_alive slurmdbd || start_slurm_daemon slurmdbd "$RUN/slurmdbd.pid" /usr/sbin/slurmdbd
    for ((i = 0; i < 150; i++)); do
        sacctmgr_q list cluster format=cluster >/dev/null 2>&1 && return 0
        rec_alive slurmdbd || fail slurmdbd "exited while starting"
        sleep 0.2
    done
    fail slurmdbd "sacctmgr cannot reach slurmdbd on port $DBD_PORT after 30 s"
}

register_accounting() {
    local out
    out=$(sacctmgr_q list cluster format=cluster) || fail slurmdbd "sacctmgr list cluster failed"
    if ! grep -qx "$CLUSTER" <<<"$out"; then
        sacctmgr_q add cluster "$CLUSTER" >/dev/null || fail slurmdbd "sacctmgr add cluster $CLUSTER failed"
    fi
    out=$(sacctmgr_q list account format=account) || fail slurmdbd "sacctmgr list account failed"
    if ! grep -qx "$ACCOUNT" <<<"$out"; then
        sacctmgr_q add account "$ACCOUNT" Cluster="$CLUSTER" \
            Description="hpc_train local cluster" Organization=hpc_train >/dev/null ||
            fail slurmdbd "sacctmgr add account $ACCOUNT failed"
    fi
    # Adding the cluster puts root in Slurm's own 'root' account; give it ours as default.
    out=$(sacctmgr_q list user root format=defaultaccount) || fail slurmdbd "sacctmgr list user failed"
    if [[ $out != "$ACCOUNT" ]]; then
        sacctmgr_q add user root Account="$ACCOUNT" Cluster="$CLUSTER" >/dev/null 2>&1 || true
        sacctmgr_q modify user root set DefaultAccount="$ACCOUNT" >/dev/null ||
            fail slurmdbd "sacctmgr: making $ACCOUNT the default account of root failed"
    fi
}

ctld_up() { timeout 15 scontrol ping 2>/dev/null | grep -q 'is UP'; }

start_slurmctld() {
    local i
    if ((CONF_CHANGED)) && rec_alive slurmctld; then
        say "slurm.conf changed: restarting slurmctld"
        stop_daemon slurmctld
    fi
    rec_alive slurmctld || start_slurm_daemon slurmctld "$RUN/slurmctld.pid" /usr/sbin/slurmctld
    for ((i = 0; i < 150; i++)); do
        ctld_up && return 0
        rec_alive slurmctld || fail slurmctld "exited while starting"
        sleep 0.2
    done
    fail slurmctld "scontrol ping does not say UP after 30 s"
}

start_slurmds() {
    local nodes=$1 n name
    for ((n = 1; n <= MAX_NODES; n++)); do
        name=slurmd-n$n
        if ((n > nodes)); then
            if [[ -n ${REC_PID[$name]:-} ]]; then
                say "stopping $name (not in the node set any more)"
                stop_daemon "$name"
            fi
            continue
        fi
        if ((CONF_CHANGED)) && rec_alive "$name"; then stop_daemon "$name"; fi
        rec_alive "$name" || start_slurm_daemon "$name" "$RUN/slurmd.n$n.pid" /usr/sbin/slurmd -N "n$n"
    done
}

expected_nodes() {
    local n
    for ((n = 1; n <= $1; n++)); do echo "n$n"; done
}

# Wait until sinfo lists exactly n1..nN, each responding (idle, mix, alloc, comp).
wait_nodes() {
    local nodes=$1 i out want states bad n
    want=$(expected_nodes "$nodes")
    for ((i = 0; i < 300; i++)); do
        out=$(timeout 15 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u -V) || out=
        if [[ $(awk '{ print $1 }' <<<"$out") == "$want" ]]; then
            states=$(awk '{ print $2 }' <<<"$out" | sort -u)
            bad=$(grep -Ev '^(idle|mix|alloc|comp)$' <<<"$states" || true)
            [[ -n $bad ]] || return 0
        fi
        sleep 0.2
    done
    warn "nodes not ready after 60 s; sinfo says:"
    timeout 15 sinfo -N -l >&2 || true
    for ((n = 1; n <= nodes; n++)); do
        if ! grep -Eq "^n$n (idle|mix|alloc|comp)$" <<<"$out"; then fail "slurmd-n$n" "node n$n is not ready"; fi
    done
    fail slurmctld "node set is not the expected n1..n$nodes"
}

all_idle() {
    local out
    out=$(timeout 15 sinfo -h -N -o '%t' 2>/dev/null | sort -u) || return 1
    [[ $out == idle ]]
}

# Run one task per node through srun and find the job in sacct.
prove_cluster() {
    local nodes=$1 out jobid got want i state err="$STATE/.check.err"
    if ! all_idle; then
        say "some nodes are busy with jobs: skipping the srun/sacct check"
        CHECK="skipped (nodes busy)"
        return 0
    fi
    # --immediate: a job submitted by someone else meanwhile may take the nodes first.
    # shellcheck disable=SC2016  # expanded by the job's shell, not here
    local partition=batch
    if ((nodes > 2)); then partition=spares; fi  # batch holds n1-n2 only (slurm_conf)
    if ! out=$(timeout 60 srun --immediate=30 -p "$partition" -N "$nodes" --ntasks-per-node=1 -t 1 \
        -J hpc_train-check sh -c 'echo "$SLURM_JOB_ID $SLURMD_NODENAME"' </dev/null 2>"$err"); then
        if [[ -n $(timeout 15 squeue -h -o %i 2>/dev/null) ]]; then
            say "other jobs took the nodes first: skipping the srun/sacct check"
            CHECK="skipped (nodes busy)"
            return 0
        fi
        cat "$err" >&2
        fail slurmctld "srun -N $nodes failed"
    fi
    out=$(grep -E '^[0-9]+ n[0-9]+$' <<<"$out" || true)
    jobid=$(awk 'NR == 1 { print $1 }' <<<"$out")
    got=$(awk '{ print $2 }' <<<"$out" | sort -V | tr '\n' ' ')
    want=$(expected_nodes "$nodes" | tr '\n' ' ')
    [[ $got == "$want" ]] || fail slurmctld "srun ran on '$got', expected '$want'"
    for ((i = 0; i < 100; i++)); do
        state=$(timeout 15 sacct -n -X -P -j "$jobid" -o State 2>/dev/null | head -n 1) || state=
        [[ $state == COMPLETED ]] && break
        sleep 0.2
    done
    [[ $state == COMPLETED ]] || fail slurmdbd "sacct does not show job $jobid as COMPLETED (got '$state')"
    CHECK="srun job $jobid ran on ${got% }; sacct: COMPLETED"
}

# ---------------------------------------------------------------- commands

lock_state() {
    mkdir -p "$STATE"
    exec 9>"$STATE/.lock"
    flock -w 600 9 || { warn "another local_slurm.sh holds $STATE/.lock"; exit 1; }
}

cmd_up() {
    local nodes=$DEFAULT_NODES
    while (($#)); do
        case $1 in
            --nodes) nodes=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
            --nodes=*) nodes=${1#--nodes=}; shift ;;
            -h | --help) usage; exit 0 ;;
            *) warn "unknown option: $1"; usage >&2; exit 2 ;;
        esac
    done
    if ! [[ $nodes =~ ^[1-9][0-9]*$ ]] || ((nodes > MAX_NODES)); then
        warn "--nodes must be 1..$MAX_NODES, got '$nodes'"
        exit 2
    fi
    [[ $EUID -eq 0 ]] || { warn "up must run as root"; exit 1; }

    lock_state
    mkdir -p "$LOG"
    install_packages
    load_record
    adopt_from_pidfiles
    make_dirs
    update_hosts
    write_configs "$nodes"
    if ((DB_CHANGED)) && rec_alive mariadbd; then stop_daemon mariadbd; fi
    start_munged
    start_mariadbd
    start_slurmdbd
    register_accounting
    start_slurmctld
    start_slurmds "$nodes"
    wait_nodes "$nodes"
    CHECK=
    prove_cluster "$nodes"
    say "cluster $CLUSTER is up in $(elapsed) s: nodes n1..n$nodes (${NODE_CPUS} CPUs, ${NODE_MEM} MB each), partitions batch (default) and urgent"
    say "check: $CHECK"
    say "state, logs, pids: $STATE (config: $CONF)"
    timeout 15 sinfo || true
}

cmd_down() {
    local name names=() n i
    [[ $EUID -eq 0 ]] || { warn "down must run as root"; exit 1; }
    [[ -d $STATE ]] || { say "nothing to stop ($STATE does not exist)"; return 0; }
    lock_state
    load_record
    adopt_from_pidfiles
    if ((${#REC_PID[@]} == 0)); then
        say "nothing to stop (no pid record in $PIDS)"
        rm -f "$PIDS"
        return 0
    fi
    # Cancel jobs first, so that no slurmstepd or job process outlives the cluster.
    if rec_alive slurmctld && ctld_up; then
        n=$(timeout 15 squeue -h -o %i 2>/dev/null | wc -l) || n=0
        if ((n > 0)); then
            say "cancelling $n job(s)"
            timeout 15 scancel --full -u root >/dev/null 2>&1 || true
            timeout 15 squeue -h -o %i 2>/dev/null | xargs -r timeout 15 scancel --full >/dev/null 2>&1 || true
            for ((i = 0; i < 150; i++)); do
                [[ -z $(timeout 15 squeue -h -o %i 2>/dev/null) ]] && break
                sleep 0.2
            done
        fi
    fi
    for ((n = MAX_NODES; n >= 1; n--)); do names+=("slurmd-n$n"); done
    names+=(slurmctld slurmdbd mariadbd munged)
    # Slurm daemons first (they need munge), then the database, then munged.
    for name in "${names[@]}"; do
        if [[ -n ${REC_PID[$name]:-} ]]; then
            if [[ ${REC_OWN[$name]} == up ]] && pid_alive "$name" "${REC_PID[$name]}"; then
                say "stopping $name (pid ${REC_PID[$name]})"
            fi
            stop_daemon "$name"
        fi
    done
    rm -f "$PIDS"
    say "down in $(elapsed) s"
}

cmd_status() {
    local name rc=0 any=0 st nodes=0 n
    load_record
    # Expected: the four services plus one slurmd per NodeName in slurm.conf.
    if [[ -f $CONF ]] && grep -qF "$CONF_MARK" "$CONF"; then
        nodes=$(grep -c '^NodeName=' "$CONF" || true)
    fi
    while read -r name; do
        if [[ -z ${REC_PID[$name]:-} ]]; then
            n=${name#slurmd-n}
            if [[ $name != slurmd-* ]] || ((n <= nodes)); then
                printf '%-12s pid %-8s %s\n' "$name" - "not running"
                rc=1
            fi
            continue
        fi
        any=1
        if rec_alive "$name"; then
            st=alive
        elif [[ ${REC_OWN[$name]} == ext && $name == munged ]] && munge_works; then
            st=alive
        else
            st=dead
            rc=1
        fi
        if [[ ${REC_OWN[$name]} == ext ]]; then st="$st (not started by up)"; fi
        printf '%-12s pid %-8s %s\n' "$name" "${REC_PID[$name]}" "$st"
    done < <(record_names)
    if ((!any)); then
        echo "no daemons recorded in $PIDS (run: $0 up)"
        return 1
    fi
    echo
    timeout 15 sinfo 2>&1 || rc=1
    return "$rc"
}

main() {
    local cmd=${1:-}
    (($#)) && shift
    case $cmd in
        up) cmd_up "$@" ;;
        down) cmd_down ;;
        status)
            local rc=0
            cmd_status || rc=$?
            exit "$rc"
            ;;
        -h | --help | help) usage ;;
        *) usage >&2; exit 2 ;;
    esac
}

main "$@"
