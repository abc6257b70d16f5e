#!/usr/bin/env bash
# A throwaway Slurm cluster on this one machine, for trying `megatron-recipes slurm submit` and for the
# tests: `sudo NODES=2 PYXIS_STUB=1 bash slurm/local_cluster.sh up`, later `... down`.
#
# Debian/Ubuntu, root, no systemd needed. NODES=1 names the node after this host; NODES>1 makes fake
# nodes n1..nN (one slurmd each, all on 127.0.0.1, names added to /etc/hosts). PYXIS_STUB=1 compiles a
# SPANK plugin that accepts pyxis' --container-* options and ignores them (the command runs on the
# host: there is no enroot here), so scripts with container flags can be submitted as they are.
# State lives in $SLURM_LOCAL_DIR (default /tmp/megatron-recipes-slurm); apt output in its log/ folder.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/megatron-recipes-slurm}
NODES=${NODES:-2}
CPUS=${CPUS:-$(nproc)}
TAG="# megatron-recipes local cluster"
HOSTS=${SLURM_LOCAL_HOSTS:-/etc/hosts}  # where the fake nodes' names go (another file only for its test)
CLUSTER=megatron-recipes-local
HOST=$(hostname -s)
PACKAGES=(slurmctld slurmd slurm-client munge)
STUB_PACKAGES=(libslurm-dev gcc libc6-dev)

node_names() {
  if [ "$NODES" -eq 1 ]; then echo "$HOST"; else for i in $(seq 1 "$NODES"); do echo "n$i"; done; fi
}

# Stop the daemon whose pid is in file $1 if it is still the expected program; wait, then force.
stop_daemon() {
  local pidfile=$1 program=$2 pid
  [ -s "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$program" ]; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 40); do  # gone, or a zombie (exited, not yet reaped): stop waiting
      alive "$pid" || break
      sleep 0.25
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

# pid files of daemons this script started: in $DIR, and in the folder the current slurm.conf names
# (a cluster started with another SLURM_LOCAL_DIR must still be stopped, never silently reused)
pid_dirs() {
  echo "$DIR/run"
  if grep -q "^ClusterName=$CLUSTER$" /etc/slurm/slurm.conf 2>/dev/null; then
    dirname "$(sed -n 's/^SlurmctldPidFile=//p' /etc/slurm/slurm.conf)"
  fi
}

alive() { [ -d "/proc/$1" ] && ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null; }

down() {
  mkdir -p "$DIR/run"
  if squeue -h >/dev/null 2>&1; then
    squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
    for _ in $(seq 40); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.25; done
  fi
  local d f
  for d in $(pid_dirs | sort -u); do
    for f in "$d"/slurmd-*.pid; do [ -e "$f" ] && stop_daemon "$f" slurmd; done
    stop_daemon "$d/slurmctld.pid" slurmctld
    stop_daemon "$d/munged.pid" munged
  done
  unlist_hosts
  rm -f /etc/slurm/plugstack.conf.d/megatron-recipes-pyxis-stub.conf
}

# The fake nodes' names out of the hosts file, in place (it may be a bind mount) and without ever emptying it:
# processes resolving this machine's own name meanwhile (gloo does, for every process group a rank makes) must
# still find it. Truncating and rewriting it (`cat kept > /etc/hosts`) failed another test's rank once
# ("gloo/transport/tcp/device.cc:99 rv == 0. -2 vs 0": getaddrinfo found no name). The kept lines are written
# over the file's start (the names were appended: they are a prefix of it), then the rest is cut off.
unlist_hosts() {
  grep -q "$TAG" "$HOSTS" 2>/dev/null || return 0
  mkdir -p "$DIR"
  grep -v "$TAG" "$HOSTS" > "$DIR/hosts.tmp" || true
  dd if="$DIR/hosts.tmp" of="$HOSTS" conv=notrunc status=none
  truncate -s "$(stat -c %s "$DIR/hosts.tmp")" "$HOSTS"
}

install_packages() {
  local wanted=("${PACKAGES[@]}")
  [ -z "${PYXIS_STUB:-}" ] || wanted+=("${STUB_PACKAGES[@]}")
  dpkg -s "${wanted[@]}" >/dev/null 2>&1 && return 0
  export DEBIAN_FRONTEND=noninteractive
  local no_services=""
  # package scripts must not try to start services (no init system here)
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; no_services=1
  fi
  # another apt (CI installs chromium beside the tests) holds the lock for a while: wait for it, do not fail
  local apt=(apt-get -o DPkg::Lock::Timeout=600)
  "${apt[@]}" install -y -q --no-install-recommends "${wanted[@]}" >> "$DIR/log/apt.log" 2>&1 \
    || { "${apt[@]}" update -q >> "$DIR/log/apt.log" 2>&1 \
         && "${apt[@]}" install -y -q --no-install-recommends "${wanted[@]}" >> "$DIR/log/apt.log" 2>&1; } \
    || { [ -z "$no_services" ] || rm -f /usr/sbin/policy-rc.d; echo "local_cluster: apt-get install failed, see $DIR/log/apt.log" >&2; exit 3; }
  [ -z "$no_services" ] || rm -f /usr/sbin/policy-rc.d
}

write_config() {
  local mem port=17100 n
  mem=$(( $(awk '/^MemTotal:/{print int($2/1024)}' /proc/meminfo) * 8 / 10 / NODES ))
  mkdir -p /etc/slurm
  {
    echo "ClusterName=$CLUSTER"
    echo "SlurmctldHost=$HOST"
    echo "SlurmUser=root"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "MailProg=/bin/true"
    echo "AccountingStorageType=accounting_storage/none"
    echo "MinJobAge=600"
    # a requeued job waits until its old credential expires (default 120 s, BeginTime); starting it
    # earlier races slurmd's revoked-credential record ("Job credential revoked"). Short here.
    echo "AuthInfo=cred_expire=10"
    for n in $(node_names); do
      port=$((port + 1)); mkdir -p "$DIR/spool/$n"
      echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS RealMemory=$mem"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > /etc/slurm/slurm.conf
  rm -f /etc/slurm/gres.conf
  if [ "$NODES" -gt 1 ]; then echo "127.0.0.1 $(node_names | tr '\n' ' ')$TAG" >> "$HOSTS"; fi
}

build_pyxis_stub() {
  cat > "$DIR/pyxis_stub.c" <<'EOF'
/* Accepts pyxis' srun options and does nothing with them (no enroot on this machine). */
#include <stddef.h>
#include <slurm/spank.h>
SPANK_PLUGIN(pyxis, 1);
static int accept_option(int val, const char *optarg, int remote) { return 0; }
#define WITH_ARG(name) { name, "arg", "accepted, ignored (pyxis stub)", 1, 0, accept_option }
#define FLAG(name) { name, NULL, "accepted, ignored (pyxis stub)", 0, 0, accept_option }
static struct spank_option options[] = {
  WITH_ARG("container-image"), WITH_ARG("container-mounts"), WITH_ARG("container-workdir"),
  WITH_ARG("container-name"), WITH_ARG("container-save"), WITH_ARG("container-env"),
  FLAG("container-mount-home"), FLAG("no-container-mount-home"), FLAG("container-remap-root"),
  FLAG("no-container-remap-root"), FLAG("container-entrypoint"), FLAG("no-container-entrypoint"),
  FLAG("container-writable"), FLAG("container-readonly"), SPANK_OPTIONS_TABLE_END
};
int slurm_spank_init(spank_t sp, int ac, char **av) {
  for (struct spank_option *o = options; o->name; o++) spank_option_register(sp, o);
  return 0;
}
EOF
  gcc -shared -fPIC -o "$DIR/pyxis_stub.so" "$DIR/pyxis_stub.c"
  mkdir -p /etc/slurm/plugstack.conf.d
  [ -f /etc/slurm/plugstack.conf ] || echo "include /etc/slurm/plugstack.conf.d/*.conf" > /etc/slurm/plugstack.conf
  echo "optional $DIR/pyxis_stub.so" > /etc/slurm/plugstack.conf.d/megatron-recipes-pyxis-stub.conf
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi  # one is already running
  [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key -f; }
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  cp /run/munge/munged.pid "$DIR/run/munged.pid"
}

up() {
  down
  local other
  for other in $(pgrep -x 'slurmctld|slurmd' || true); do
    if alive "$other"; then
      echo "local_cluster: a Slurm daemon this script did not start is running (pid $other); stop it first" >&2
      exit 1
    fi
  done
  mkdir -p "$DIR/run" "$DIR/log"
  rm -rf "$DIR/state" "$DIR/spool"
  install_packages
  write_config
  [ -z "${PYXIS_STUB:-}" ] || build_pyxis_stub
  start_munge
  slurmctld
  for n in $(node_names); do slurmd -N "$n"; done
  for _ in $(seq 120); do
    [ "$(sinfo -h -o %T 2>/dev/null | sort -u)" = idle ] && break
    sleep 0.25
  done
  if [ "$(sinfo -h -o %T 2>/dev/null | sort -u)" != idle ]; then
    tail -n 20 "$DIR"/log/*.log >&2 || true
    echo "local_cluster: nodes did not become idle" >&2
    exit 1
  fi
  sinfo -N
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  unlist-hosts) unlist_hosts ;;  # what `down` does to the hosts file, alone
  *) echo "usage: $0 up|down|unlist-hosts" >&2; exit 2 ;;
esac
