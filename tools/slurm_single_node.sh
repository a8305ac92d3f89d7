#!/bin/bash
# A single-node SLURM on this machine from Debian's packages, for the test that submits docs/guides/convert.md's
# array and merge scripts to a real SLURM (tests/convert/test_array.py; issue 41). `make test` runs it as best effort.
#
# Idempotent: when `sinfo` already answers with a partition up and a node that takes jobs (and, on the node this
# script configured, slurmctld and slurmd are running), it exits 0 at once. Otherwise, as root with apt-get, it
# installs slurmctld, slurmd, slurm-client and munge (--no-install-recommends), creates a munge key if missing and
# starts munged, writes /etc/slurm/slurm.conf for one node named `hostname -s` (partition `debug`, no accounting; an
# existing slurm.conf not written by this script is kept), starts slurmctld and slurmd (no systemd: the binaries
# themselves, which daemonise) and waits until the partition is up and the node idle. Each step prints its seconds.
#
# Exit codes:
#   0  SLURM is up (it was, or this script brought it up), or it was not attempted: not root, or no apt-get
#      ("SLURM is not set up: ..."); callers treat SLURM as best effort, the test skips with its own reason.
#   1  it was attempted and failed: the install, munged, or a daemon that did not come up in time (one line
#      "SLURM is not set up: ..." on stderr; logs in /var/log/slurm/).
#
# Environment: SLURM_INSTALL_TIMEOUT (seconds for apt-get install, 240), SLURM_UP_TIMEOUT (seconds to wait for the
# node, 60). A job's processes inherit slurmd's nice value: start this with `nice -n 19` to run them at 19.
set -uo pipefail

INSTALL_TIMEOUT=${SLURM_INSTALL_TIMEOUT:-240}
UP_TIMEOUT=${SLURM_UP_TIMEOUT:-60}
CONF=/etc/slurm/slurm.conf
MARK="# written by lifeseq-shards tools/slurm_single_node.sh"
LOGDIR=/var/log/slurm
APT_LOG=/tmp/slurm-apt.log

step_start=$EPOCHREALTIME
total_start=$EPOCHREALTIME
elapsed() {  # elapsed START: seconds since START (an $EPOCHREALTIME), to a tenth
    local d=$((${EPOCHREALTIME/[.,]/} - ${1/[.,]/}))
    printf '%d.%d' $((d / 1000000)) $((d / 100000 % 10))
}
done_step() {  # done_step WHAT: prints WHAT and the seconds since the last step
    echo "slurm_single_node: $1 ($(elapsed "$step_start") s)"
    step_start=$EPOCHREALTIME
}
give_up() {  # give_up CODE REASON
    echo "SLURM is not set up: $2" >&2
    exit "$1"
}

partition_up() {  # sinfo answers with a partition up (sinfo takes seconds to give up on a missing controller)
    command -v sinfo > /dev/null && timeout 10 sinfo -h -o %a 2> /dev/null | grep -qx up
}
running() {  # running NAME: a live process of that name (not a zombie left by daemonising)
    # shellcheck disable=SC2009  # pgrep -x counts zombies too
    ps -C "$1" -o stat= 2> /dev/null | grep -qv '^Z'
}
node_idle() {  # the node answers and takes jobs (idle; or running some, when only slurmd was restarted)
    timeout 10 scontrol show node "$NODE" 2> /dev/null | grep -Eq 'State=(IDLE|MIXED|ALLOCATED) '
}

usable() {  # a partition up with a node that answers and takes jobs; this script's own node: its daemons running
    command -v sinfo > /dev/null || return 1
    timeout 10 sinfo -h -o '%a %t' 2> /dev/null | grep -Eq '^up (idle|mix|alloc|comp)$' || return 1
    ! grep -qsF "$MARK" "$CONF" || { running slurmctld && running slurmd; }
}

if usable; then
    echo "slurm_single_node: SLURM is up already ($(elapsed "$total_start") s)"
    exit 0
fi
done_step "no usable partition yet (sinfo)"
if [ "$(id -u)" != 0 ]; then
    echo "SLURM is not set up: not root"
    exit 0
fi
if ! command -v apt-get > /dev/null; then
    echo "SLURM is not set up: no apt-get (not a Debian-like system)"
    exit 0
fi

# -- the packages -------------------------------------------------------------------------------------------------
PACKAGES=(slurmctld slurmd slurm-client munge)
installed() {
    local p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2> /dev/null | grep -q 'install ok installed' || return 1
    done
}
if installed; then
    done_step "packages installed already"
else
    export DEBIAN_FRONTEND=noninteractive
    apt_install() {
        timeout "$INSTALL_TIMEOUT" apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >> "$APT_LOG" 2>&1
    }
    if ! apt_install; then  # stale package lists: refresh them once
        timeout "$INSTALL_TIMEOUT" apt-get update -q >> "$APT_LOG" 2>&1 || true
        apt_install || give_up 1 "apt-get install ${PACKAGES[*]} failed (see $APT_LOG)"
    fi
    done_step "installed ${PACKAGES[*]}"
fi

# -- munge --------------------------------------------------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    if command -v mungekey > /dev/null; then
        mungekey --create --keyfile=/etc/munge/munge.key || give_up 1 "mungekey failed"
    else
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2> /dev/null || give_up 1 "no munge key"
    fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
fi
if ! running munged; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged || give_up 1 "munged did not start (see /var/log/munge/munged.log)"
fi
munge -n 2> /dev/null | unmunge > /dev/null 2>&1 || give_up 1 "munge does not round-trip a credential"
done_step "munged up"

# -- slurm.conf ---------------------------------------------------------------------------------------------------
NODE=$(hostname -s)
CPUS=$(nproc --all)
MEM_MB=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)  # a bit under MemTotal
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOGDIR"
if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    done_step "kept $CONF (not written by this script)"
else
    cat > "$CONF.new" << EOF
$MARK
ClusterName=single
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
ReturnToService=2
SchedulerType=sched/backfill
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
MinJobAge=300
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    if cmp -s "$CONF.new" "$CONF"; then
        rm -f "$CONF.new"
        done_step "$CONF unchanged (node $NODE: $CPUS CPUs, $MEM_MB MB)"
    else
        mv "$CONF.new" "$CONF"
        if running slurmctld; then timeout 30 scontrol reconfigure || true; fi
        done_step "wrote $CONF (node $NODE: $CPUS CPUs, $MEM_MB MB)"
    fi
fi

# -- the daemons --------------------------------------------------------------------------------------------------
if ! running slurmctld; then
    slurmctld || give_up 1 "slurmctld did not start (see $LOGDIR/slurmctld.log)"
fi
if ! running slurmd; then
    slurmd || give_up 1 "slurmd did not start (see $LOGDIR/slurmd.log)"
fi
done_step "slurmctld and slurmd running"

deadline=$((SECONDS + UP_TIMEOUT))
until partition_up && node_idle; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        state=$(timeout 10 scontrol show node "$NODE" 2> /dev/null | grep -o 'State=[^ ]*\|Reason=.*' | tr '\n' ' ')
        give_up 1 "node $NODE not idle within ${UP_TIMEOUT} s (${state:-no answer}; see $LOGDIR/)"
    fi
    sleep 1
done
done_step "partition up, node $NODE idle"
echo "slurm_single_node: SLURM is up ($(elapsed "$total_start") s in all)"
