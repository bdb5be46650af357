#!/usr/bin/env bash
# A one-node Slurm cluster on this host, for the needs_slurm tests (.ci/run stage 2):
#
#   scripts/slurm_localhost.sh start    # write the config, start munged, slurmctld, slurmd,
#                                       # wait (bounded) until sinfo shows the node idle
#   scripts/slurm_localhost.sh stop     # stop the three daemons this script started
#   scripts/slurm_localhost.sh env      # the SLURM_CONF line the clients need (eval it)
#
# Needs root and Debian's slurm-wlm + munge (apt-get install slurm-wlm munge). Everything
# lives under $RINGCOMM_SLURM_DIR (default ${TMPDIR:-/tmp}/ringcomm-slurm): its own munge
# key and socket (the host's munge, if any, is left alone), slurm.conf, state, logs, pid
# files. The node is "localhost" (so SLURM_JOB_NODELIST resolves to 127.0.0.1) and claims
# at least 4 CPUs (SlurmdParameters=config_overrides) so the documented `srun -n 4` runs as
# written on a 2-core machine. No accounting, no cgroups (proctrack/linuxproc, task/none).
# Ports: $RINGCOMM_SLURM_PORT (slurmctld, default 6817) and the next one (slurmd).
set -euo pipefail

DIR="${RINGCOMM_SLURM_DIR:-${TMPDIR:-/tmp}/ringcomm-slurm}"
CTLD_PORT="${RINGCOMM_SLURM_PORT:-6817}"
SLURMD_PORT=$((CTLD_PORT + 1))
CONF="$DIR/slurm.conf"
WAIT_S="${RINGCOMM_SLURM_WAIT_S:-60}"

log() { echo "slurm_localhost: $*" >&2; }

need() {
    local missing=()
    for bin in munged slurmctld slurmd sinfo srun sbatch scontrol; do
        command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$bin")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        log "missing ${missing[*]} (apt-get install slurm-wlm munge)"
        exit 3
    fi
    if [ "$(id -u)" != 0 ]; then
        log "needs root (slurmd runs jobs as any user)"
        exit 3
    fi
}

write_config() {
    local cpus
    cpus=$(nproc)
    [ "$cpus" -ge 4 ] || cpus=4
    mkdir -p "$DIR/state" "$DIR/spool"
    chmod 700 "$DIR"
    cat >"$CONF" <<EOF
# Written by scripts/slurm_localhost.sh: a one-node test cluster.
ClusterName=ringcomm-ci
SlurmctldHost=$(hostname -s)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=30
NodeName=localhost NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    if [ ! -s "$DIR/munge.key" ]; then
        dd if=/dev/urandom of="$DIR/munge.key" bs=1 count=1024 status=none
        chmod 400 "$DIR/munge.key"
    fi
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    need
    stop >/dev/null 2>&1 || true  # a previous run's leftovers
    write_config
    # munged refuses to run as root without --force; its own key, socket, pid and log here.
    /usr/sbin/munged --force --key-file="$DIR/munge.key" --socket="$DIR/munge.socket" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munge.seed"
    SLURM_CONF="$CONF" /usr/sbin/slurmctld -c -f "$CONF"
    SLURM_CONF="$CONF" /usr/sbin/slurmd -N localhost -f "$CONF"
    local deadline=$((SECONDS + WAIT_S)) state=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        state=$(SLURM_CONF="$CONF" sinfo -h -n localhost -o %T 2>/dev/null || true)
        case "$state" in
        idle | mixed | allocated) break ;;
        esac
        sleep 0.5
    done
    case "$state" in
    idle | mixed | allocated)
        log "up in $DIR (node localhost $state); clients need SLURM_CONF=$CONF"
        ;;
    *)
        log "node localhost not idle after ${WAIT_S} s (state '${state}'); logs:"
        tail -n 20 "$DIR"/slurmctld.log "$DIR"/slurmd.log "$DIR"/munged.log >&2 2>/dev/null || true
        stop
        exit 1
        ;;
    esac
}

stop_one() {  # stop_one NAME PIDFILE: TERM, then KILL after 10 s
    local pidfile=$2 pid
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return 0; }
        sleep 0.1
    done
    log "$1 (pid $pid) ignored SIGTERM: killed"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

stop() {
    stop_one slurmd "$DIR/slurmd.pid"
    stop_one slurmctld "$DIR/slurmctld.pid"
    stop_one munged "$DIR/munged.pid"
    log "stopped"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
env) echo "export SLURM_CONF=$CONF" ;;
*)
    echo "usage: $0 start|stop|env" >&2
    exit 2
    ;;
esac
