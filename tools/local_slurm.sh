#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the `slurm`-marked tests and for trying
# `megatron-rl launch` without a real cluster.
#
#   tools/local_slurm.sh start    # install slurm-wlm + munge if missing, start the daemons
#   source /tmp/megatron_rl_slurm/env   # exports SLURM_CONF (also printed by start)
#   tools/local_slurm.sh status
#   tools/local_slurm.sh stop     # stop the daemons by their pid files
#
# Everything (slurm.conf, munge key and socket, controller state, spool, logs, pid files)
# lives in $MEGATRON_RL_SLURM_DIR (default /tmp/megatron_rl_slurm); nothing under /etc is
# changed and the system's own munge/slurm services are not touched. The node has
# CPUs=$(nproc) and no GPUs; one partition "local". Debian/Ubuntu only for the install
# (apt-get); needs root to install and to run slurmd as root (otherwise the daemons run as
# the current user, which is enough for sbatch/srun of that user's jobs).
set -euo pipefail

DIR=${MEGATRON_RL_SLURM_DIR:-/tmp/megatron_rl_slurm}
CONF=$DIR/slurm.conf
ENV_FILE=$DIR/env
HOST=$(hostname -s)
# Ports away from the Slurm defaults (6817/6818), so a real installation does not clash.
CTLD_PORT=${MEGATRON_RL_SLURMCTLD_PORT:-16817}
SLURMD_PORT=${MEGATRON_RL_SLURMD_PORT:-16818}

log() { echo "local_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null && command -v sbatch >/dev/null && return 0
    [ "$(id -u)" = 0 ] || die "slurm-wlm/munge are not installed and this is not root"
    command -v apt-get >/dev/null || die "slurm-wlm/munge are not installed and there is no apt-get"
    log "installing slurm-wlm and munge (apt-get)"
    apt-get update -q >"$DIR/apt.log" 2>&1 || die "apt-get update failed (see $DIR/apt.log)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurm-wlm munge >>"$DIR/apt.log" 2>&1 || die "apt-get install failed (see $DIR/apt.log)"
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_by_pidfile() {  # name pidfile
    local name=$1 file=$2 pid
    pid_alive "$file" || { rm -f "$file"; return 0; }
    pid=$(cat "$file")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name (pid $pid) did not stop on SIGTERM; sending SIGKILL"
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
    log "stopped $name (pid $pid)"
}

write_conf() {
    local user
    user=$(id -un)
    cat >"$CONF" <<EOF
# Written by tools/local_slurm.sh: a one-node cluster on $HOST.
ClusterName=megatronrl
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# No cgroups needed (containers often have none).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
# Finished jobs stay visible to scontrol/squeue for an hour (there is no accounting).
MinJobAge=3600
KillWait=30
InactiveLimit=0
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    mkdir -p "$DIR/munge"
    chmod 700 "$DIR/munge"
    if [ ! -s "$DIR/munge/munge.key" ]; then
        head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
        chmod 400 "$DIR/munge/munge.key"
    fi
    pid_alive "$DIR/munge/munged.pid" && return 0
    # --force: the socket directory's ancestors (/tmp) are world-writable with the sticky bit.
    munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" \
        || die "munged did not start (see $DIR/log/munged.log)"
    munge --socket="$DIR/munge/munge.socket" -n </dev/null | \
        unmunge --socket="$DIR/munge/munge.socket" >/dev/null \
        || die "munge round trip failed (see $DIR/log/munged.log)"
}

wait_node_idle() {
    local state
    for _ in $(seq 60); do
        state=$(SLURM_CONF=$CONF sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
        case $state in
            idle*|mix*|alloc*) return 0 ;;
            down*|drain*) SLURM_CONF=$CONF scontrol update nodename="$HOST" state=resume \
                2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    die "node $HOST did not become idle (state: ${state:-none}; see $DIR/log/)"
}

start() {
    if pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid"; then
        log "already running"
        cat "$ENV_FILE"
        return 0
    fi
    rm -f "$ENV_FILE"
    stop_daemons
    rm -rf "$DIR/state" "$DIR/spool"
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    chmod 755 "$DIR"
    install_packages
    write_conf
    start_munge
    SLURM_CONF=$CONF slurmctld -f "$CONF" -c || die "slurmctld did not start (see $DIR/log)"
    SLURM_CONF=$CONF slurmd -f "$CONF" || die "slurmd did not start (see $DIR/log)"
    wait_node_idle
    echo "export SLURM_CONF=$CONF" >"$ENV_FILE"
    log "cluster up: node $HOST, $(nproc) CPUs, partition local"
    cat "$ENV_FILE"
}

stop_daemons() {
    stop_by_pidfile slurmd "$DIR/slurmd.pid"
    stop_by_pidfile slurmctld "$DIR/slurmctld.pid"
    stop_by_pidfile munged "$DIR/munge/munged.pid"
}

stop() {
    rm -f "$ENV_FILE"
    stop_daemons
}

status() {
    local ok=0 name file
    for name in slurmctld slurmd munged; do
        file=$DIR/$name.pid
        [ "$name" = munged ] && file=$DIR/munge/munged.pid
        if pid_alive "$file"; then echo "$name: running (pid $(cat "$file"))"
        else echo "$name: stopped"; ok=1; fi
    done
    if [ "$ok" = 0 ]; then
        SLURM_CONF=$CONF sinfo
        echo "export SLURM_CONF=$CONF"
    fi
    return $ok
}

mkdir -p "$DIR"
case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
