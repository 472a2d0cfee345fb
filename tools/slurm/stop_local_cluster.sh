#!/usr/bin/env bash
# Stop the local Slurm cluster started by setup_local_cluster.sh: cancel every job, wait for the
# queue to drain, then stop slurmd, slurmctld, slurmdbd, MariaDB and munged by their pid files in
# /run/megapkl-slurm (never by process name). Safe to call when nothing runs (e.g. from a CI trap).
# Keeps the state (/var/spool/megapkl-slurm, the accounting database), so job ids keep increasing;
# MEGAPKL_SLURM_WIPE=1 also deletes both (they go together: ids live in both).
set -uo pipefail

RUN_DIR=/run/megapkl-slurm
SPOOL=/var/spool/megapkl-slurm
log() { echo "[slurm-stop] $*"; }

[ "$(id -u)" = 0 ] || { echo "[slurm-stop] ERROR: must run as root" >&2; exit 1; }
[ -d "$RUN_DIR" ] || { log "nothing to stop ($RUN_DIR does not exist)"; exit 0; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Jobs first, while slurmctld and slurmd can still kill their processes.
if alive "$RUN_DIR/slurmctld.pid" && command -v squeue >/dev/null; then
  ids=$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${ids// /}" ]; then
    log "cancelling jobs: $ids"
    # shellcheck disable=SC2086
    timeout 10 scancel $ids 2>/dev/null || true
    for _ in $(seq 1 60); do
      [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
fi

stop() {  # stop NAME EXPECTED_COMM: TERM, wait up to 20 s, then KILL
  local name=$1 comm=$2 file="$RUN_DIR/$1.pid" pid
  alive "$file" || { rm -f "$file"; return 0; }
  pid=$(cat "$file")
  if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != "$comm" ]; then
    log "pid $pid in $file is not $comm any more; leaving it alone"
    rm -f "$file"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then
    log "$name (pid $pid) ignored SIGTERM for 20 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$file"
  log "stopped $name (pid $pid)"
}

# localhost and the namespace nodes (slurmd.pid: written by an older setup); not slurmdbd.pid
for f in "$RUN_DIR"/slurmd-*.pid "$RUN_DIR/slurmd.pid"; do
  [ -e "$f" ] && stop "$(basename "$f" .pid)" slurmd
done
stop slurmctld slurmctld
stop slurmdbd slurmdbd
stop mariadbd mariadbd
stop munged munged

# The namespace nodes' network: namespaces, bridge, their /etc/hosts lines.
for ns in $(ip netns list 2>/dev/null | grep -o '^mpn[0-9]*'); do
  ip link del "veth-$ns" 2>/dev/null
  ip netns del "$ns" && log "removed network namespace $ns"
done
ip link show mpslurm0 >/dev/null 2>&1 && ip link del mpslurm0 && log "removed bridge mpslurm0"
if grep -q "# megapkl-slurm-netns" /etc/hosts; then
  # /etc/hosts may be a bind mount: rewrite it in place rather than replacing the file.
  grep -v "# megapkl-slurm-netns" /etc/hosts >/tmp/megapkl-hosts.$$ && cat /tmp/megapkl-hosts.$$ >/etc/hosts
  rm -f /tmp/megapkl-hosts.$$
fi

if [ "${MEGAPKL_SLURM_WIPE:-0}" = 1 ]; then
  rm -rf "$SPOOL"
  if command -v mariadbd >/dev/null && [ -d /var/lib/mysql/slurm_acct_db ]; then
    # The database is only reachable while MariaDB runs; drop its files directly (it is stopped).
    rm -rf /var/lib/mysql/slurm_acct_db
  fi
  log "wiped Slurm state and the accounting database"
fi
exit 0
