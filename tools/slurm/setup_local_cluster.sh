#!/usr/bin/env bash
# Start a real single-node Slurm cluster on localhost for the launcher tests (tests/launch/).
#
#   sudo bash tools/slurm/setup_local_cluster.sh     # installs, configures, starts, waits until ready
#   sudo bash tools/slurm/stop_local_cluster.sh      # cancels jobs, stops every daemon started here
#
# What runs: munged, MariaDB (unix socket only, --skip-networking), slurmdbd (accounting: submitit
# polls sacct), slurmctld, one slurmd for the node `localhost` and, for two-node jobs, one slurmd
# in each of two network namespaces (nodes mpn1, mpn2). No cgroups, no systemd. The comments at
# each setting below say why it is set (measured on Debian 12 CI machines).
#
# Idempotent: a second call leaves running daemons alone (and restarts the Slurm daemons only when
# the generated configuration changed). It refuses to overwrite an /etc/slurm/slurm.conf it did not
# write unless MEGAPKL_SLURM_FORCE=1. Needs root (package install, /etc/slurm, daemons as root).
#
# Environment knobs: MEGAPKL_SLURM_CPUS (default: nproc), MEGAPKL_SLURM_MEM_MB (default: 85% of RAM),
# MEGAPKL_SLURM_PARTITION (default: cpu), MEGAPKL_SLURM_TIMEOUT_S (readiness wait, default 120).
set -euo pipefail

MARKER="# Written by megapkl tools/slurm/setup_local_cluster.sh"
PARTITION="${MEGAPKL_SLURM_PARTITION:-cpu}"
CLUSTER="megapkl-local"
RUN_DIR=/run/megapkl-slurm           # pid files of everything started here
LOG_DIR=/var/log/megapkl-slurm
SPOOL=/var/spool/megapkl-slurm       # slurmctld state, slurmd spool
DB_SOCKET=/run/mysqld/mysqld.sock    # the compiled-in default of libmariadb (slurmdbd uses it)
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=megapkl-local-slurm          # the database only listens on a root-owned unix socket
TIMEOUT_S="${MEGAPKL_SLURM_TIMEOUT_S:-120}"

log() { echo "[slurm-setup] $*"; }
die() { echo "[slurm-setup] ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (installs packages, writes /etc/slurm, starts daemons)"

# ---- packages
need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
command -v slurmdbd >/dev/null || need+=(slurmdbd)
command -v mariadbd >/dev/null || need+=(mariadb-server)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]} (about 90 s)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Post-install scripts print "policy-rc.d denied execution of start": harmless, we start daemons.
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

mkdir -p "$RUN_DIR" "$LOG_DIR" "$SPOOL/ctld" "$SPOOL/d-localhost" /etc/slurm /run/munge /run/mysqld
for i in $(seq 1 "${MEGAPKL_SLURM_NS_NODES:-2}"); do mkdir -p "$SPOOL/d-mpn$i"; done
chown munge:munge /run/munge
chown mysql:mysql /run/mysqld

alive() {  # alive PIDFILE: the pid in PIDFILE is a live process
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

wait_for() {  # wait_for WHAT SECONDS CMD...: poll CMD every 0.5 s
  local what=$1 secs=$2; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      die "timed out after ${secs}s waiting for $what (logs: $LOG_DIR)"
    fi
    sleep 0.5
  done
}

# ---- munge (the package created /etc/munge/munge.key)
if ! alive "$RUN_DIR/munged.pid" && ! (munge -n | unmunge) >/dev/null 2>&1; then
  [ -s /etc/munge/munge.key ] || { /usr/sbin/mungekey --create >/dev/null 2>&1 || \
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; \
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  touch "$LOG_DIR/munged.log" && chown munge:munge "$LOG_DIR/munged.log"
  # munged writes its pid file itself; it must be in a directory the munge user can write.
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged --force --pid-file=/run/munge/munged.pid \
    --log-file="$LOG_DIR/munged.log"
  wait_for "munged pid file" 10 test -s /run/munge/munged.pid
  cp /run/munge/munged.pid "$RUN_DIR/munged.pid"
  log "munged started (pid $(cat "$RUN_DIR/munged.pid"))"
fi
wait_for munge 20 bash -c 'munge -n | unmunge'

# ---- MariaDB: unix socket only
if ! alive "$RUN_DIR/mariadbd.pid" && ! mariadb-admin --socket="$DB_SOCKET" ping >/dev/null 2>&1; then
  if [ ! -d /var/lib/mysql/mysql ]; then
    log "initializing the MariaDB data directory"
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql --skip-test-db >/dev/null
  fi
  # mariadbd runs as mysql: its pid and log files live where that user can write.
  touch "$LOG_DIR/mariadb.log" && chown mysql:mysql "$LOG_DIR/mariadb.log"
  rm -f /run/mysqld/mysqld.pid
  setsid /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql --skip-networking \
    --socket="$DB_SOCKET" --pid-file=/run/mysqld/mysqld.pid \
    --log-error="$LOG_DIR/mariadb.log" </dev/null >/dev/null 2>&1 &
  wait_for "MariaDB" 60 mariadb-admin --socket="$DB_SOCKET" ping
  cp /run/mysqld/mysqld.pid "$RUN_DIR/mariadbd.pid"
  log "MariaDB started (pid $(cat "$RUN_DIR/mariadbd.pid"))"
fi
wait_for "MariaDB" 60 mariadb-admin --socket="$DB_SOCKET" ping
mariadb --socket="$DB_SOCKET" -u root <<SQL
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
SQL

# ---- two more nodes, each in its own network and UTS namespace on a private bridge
# MEGAPKL_SLURM_NS_NODES (default 2, 0 = none): nodes mpn1..mpnN with addresses $NET.11.. on the
# bridge $BRIDGE ($NET.1 on this machine). Traffic between them stays on the bridge: no route
# leaves it, and the range is used for nothing else. /etc/hosts gets their names (marked lines,
# removed by the stop script) so a job's first node name resolves to its address for gloo.
NS_NODES="${MEGAPKL_SLURM_NS_NODES:-2}"
NET=10.231.7
BRIDGE=mpslurm0
HOSTS_MARK="# megapkl-slurm-netns"
setup_netns_nodes() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  # (no grep -q on a pipe: with pipefail its early exit would count as "absent")
  [[ "$(ip addr show dev "$BRIDGE")" == *"inet $NET.1/"* ]] || ip addr add "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i ns
  for i in $(seq 1 "$NS_NODES"); do
    ns=mpn$i
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip link show "veth-$ns" >/dev/null 2>&1; then
      ip link add "veth-$ns" type veth peer name eth0 netns "$ns"
      ip link set "veth-$ns" master "$BRIDGE" up
      ip -n "$ns" addr add "$NET.1$i/24" dev eth0
      ip -n "$ns" link set lo up
      ip -n "$ns" link set eth0 up
    fi
    grep -q "^$NET.1$i $ns " /etc/hosts || echo "$NET.1$i $ns $HOSTS_MARK" >>/etc/hosts
  done
}
if [ "$NS_NODES" -gt 0 ]; then
  setup_netns_nodes
  log "network namespaces: $(ip netns list | grep -o '^mpn[0-9]*' | tr '\n' ' ')on bridge $BRIDGE ($NET.0/24)"
fi

# ---- configuration
CPUS="${MEGAPKL_SLURM_CPUS:-$(nproc)}"
MEM_MB="${MEGAPKL_SLURM_MEM_MB:-$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.85}' /proc/meminfo)}"
if [ -e /etc/slurm/slurm.conf ] && ! head -1 /etc/slurm/slurm.conf | grep -qF "$MARKER"; then
  [ "${MEGAPKL_SLURM_FORCE:-0}" = 1 ] || \
    die "/etc/slurm/slurm.conf exists and was not written by this script; set MEGAPKL_SLURM_FORCE=1 to replace it"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
NS_NODE_LINES=""
for i in $(seq 1 "$NS_NODES"); do
  NS_NODE_LINES+="NodeName=mpn$i NodeAddr=$NET.1$i CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM_MB State=UNKNOWN
"
done
cat >"$tmp/slurm.conf" <<EOF
$MARKER; regenerated on every run.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
# The default 120 s credential lifetime also delays every requeued job by 2 minutes.
AuthInfo=cred_expire=10
MailProg=/bin/true
MpiDefault=none
# No cgroups on CI machines: Linux process tracking, no task binding (torch threads come from
# SLURM_CPUS_PER_TASK instead).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
ReturnToService=2
# The main scheduler's periodic pass (default every 60 s) is what starts a requeued job once it is
# eligible again: run it every 2 s so preemption -> requeue -> resume takes seconds, not a minute.
SchedulerParameters=sched_interval=2,bf_interval=5
KillWait=10
MinJobAge=600
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d-%n
SlurmctldPort=6817
SlurmdPort=6818
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobCompType=jobcomp/none
# The namespace nodes come first: while the node table holds a single node named 'localhost',
# slurmctld resolves every node name to it (and then calls the next node line a duplicate).
${NS_NODE_LINES}# A node named independently of the machine's hostname; slurmd is started with -N localhost.
NodeName=localhost NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
if [ "$NS_NODES" -gt 0 ]; then
  # slurmd in a namespace reaches slurmctld (and clients reach it) at the bridge address.
  echo "SlurmctldAddr=$NET.1" >>"$tmp/slurm.conf"
  echo "PartitionName=${PARTITION}2 Nodes=mpn[1-$NS_NODES] MaxTime=INFINITE State=UP" >>"$tmp/slurm.conf"
fi
cat >"$tmp/slurmdbd.conf" <<EOF
$MARKER; regenerated on every run.
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
changed=0
for f in slurm.conf slurmdbd.conf; do
  if ! cmp -s "$tmp/$f" "/etc/slurm/$f"; then
    install -m 600 "$tmp/$f" "/etc/slurm/$f"
    changed=1
  fi
done
chmod 644 /etc/slurm/slurm.conf
if [ "$changed" = 1 ]; then
  log "configuration written: /etc/slurm/slurm.conf (CPUs=$CPUS RealMemory=${MEM_MB}MB partition=$PARTITION)"
  for f in "$RUN_DIR"/slurmd-*.pid "$RUN_DIR/slurmd.pid" "$RUN_DIR/slurmctld.pid" "$RUN_DIR/slurmdbd.pid"; do
    if alive "$f"; then   # restart whatever runs with an old configuration
      log "restarting $(basename "$f" .pid) for the new configuration"
      kill "$(cat "$f")"
      for _ in $(seq 1 40); do alive "$f" || break; sleep 0.5; done
    fi
  done
fi

# ---- Slurm daemons (each daemonizes and writes its pid file)
if ! alive "$RUN_DIR/slurmdbd.pid"; then
  /usr/sbin/slurmdbd
  wait_for "slurmdbd" 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/6819"
  log "slurmdbd started (pid $(cat "$RUN_DIR/slurmdbd.pid"))"
fi
if ! alive "$RUN_DIR/slurmctld.pid"; then
  /usr/sbin/slurmctld
  wait_for "slurmctld" 60 scontrol ping
  log "slurmctld started (pid $(cat "$RUN_DIR/slurmctld.pid"))"
fi
if ! alive "$RUN_DIR/slurmd-localhost.pid"; then
  /usr/sbin/slurmd -N localhost
  wait_for "slurmd pid file" 30 alive "$RUN_DIR/slurmd-localhost.pid"
  log "slurmd started (pid $(cat "$RUN_DIR/slurmd-localhost.pid"))"
fi
for i in $(seq 1 "$NS_NODES"); do   # inside its namespaces, with its own host name
  if ! alive "$RUN_DIR/slurmd-mpn$i.pid"; then
    # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup from slurmd
    nsenter --net="/run/netns/mpn$i" unshare --uts sh -c "hostname mpn$i && exec /usr/sbin/slurmd -N mpn$i"
    wait_for "slurmd mpn$i pid file" 30 alive "$RUN_DIR/slurmd-mpn$i.pid"
    log "slurmd mpn$i started (pid $(cat "$RUN_DIR/slurmd-mpn$i.pid"), $NET.1$i in netns mpn$i)"
  fi
done

# ---- readiness: the node is schedulable and accounting answers
node_ready() {  # node_ready NAME
  local state
  state=$(sinfo -h -n "$1" -o %T 2>/dev/null | head -1)
  case "$state" in
    idle|mixed|allocated|completing) return 0 ;;
    drained*|draining|down*|fail*) scontrol update NodeName="$1" State=RESUME >/dev/null 2>&1 || true; return 1 ;;
    *) return 1 ;;
  esac
}
wait_for "node localhost to be schedulable (sinfo)" "$TIMEOUT_S" node_ready localhost
for i in $(seq 1 "$NS_NODES"); do
  wait_for "node mpn$i to be schedulable (sinfo)" "$TIMEOUT_S" node_ready "mpn$i"
done
wait_for "accounting (sacct)" "$TIMEOUT_S" sacct -n -X -S now-1hour
log "ready: $(sinfo -h -o '%P %a %D %T %C' | head -1) (partition nodes state cpus A/I/O/T)"
