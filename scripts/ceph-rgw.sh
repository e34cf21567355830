#!/usr/bin/env bash
# Single-node Ceph (one mon, one memstore OSD, RADOS Gateway) on 127.0.0.1 for
# shardckpt's S3 integration tests. Data lives in memory and vanishes on stop.
#
#   scripts/ceph-rgw.sh install   apt-get the Debian packages unless present
#   scripts/ceph-rgw.sh start     start (or reuse) a cluster; print its env on stdout
#   scripts/ceph-rgw.sh status    exit 0 and print the env if the cluster answers
#   scripts/ceph-rgw.sh stop      kill the daemons by pid file, remove the state dir
#
# `eval "$(scripts/ceph-rgw.sh start)"` exports CEPH_RGW_ENDPOINT and friends.
# Every subcommand is idempotent; stop is safe when nothing runs. Progress and
# errors go to stderr, so stdout stays machine-readable.
#
# Environment:
#   CEPH_RGW_DIR        state dir (default ${TMPDIR:-/tmp}/shardckpt-ceph-rgw);
#                       only removed if it holds this script's marker file
#   CEPH_RGW_PORT       S3 port (default 7480)
#   CEPH_MON_PORT       monitor port (default 6789)
#   CEPH_OSD_PORTS      OSD port range "min-max" (default 6800-7300)
#   CEPH_RGW_TIMEOUT    seconds allowed for start (default 120)
#   CEPH_RGW_WATCH_PID  if set, a watchdog stops the cluster once this pid exits
#   CEPH_RGW_MAX_LIFE   watchdog's hard limit in seconds (default 14400)
set -euo pipefail
unset PYTHONPATH PYTHONHOME  # the ceph CLI runs on Debian's python3

DIR=${CEPH_RGW_DIR:-${TMPDIR:-/tmp}/shardckpt-ceph-rgw}
RGW_PORT=${CEPH_RGW_PORT:-7480}
MON_PORT=${CEPH_MON_PORT:-6789}
OSD_PORTS=${CEPH_OSD_PORTS:-6800-7300}
TIMEOUT=${CEPH_RGW_TIMEOUT:-120}
MAX_LIFE=${CEPH_RGW_MAX_LIFE:-14400}
ACCESS_KEY=testkey
SECRET_KEY=testsecret
MARKER=.shardckpt-ceph-rgw
DAEMONS=(client.rgw.a osd.0 mon.a)  # stop order: gateway first, monitor last
SELF=$(readlink -f "${BASH_SOURCE[0]}")
START_S=$SECONDS

log() { echo "ceph-rgw: $*" >&2; }
die() { log "error: $*"; exit 1; }

# True if something accepts TCP connections on 127.0.0.1:$1.
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Poll `$@` every $1 seconds until it succeeds or the start deadline passes.
wait_for() {
  local what=$1 step=$2; shift 2
  local tries=$(( TIMEOUT * 10 ))  # hard cap on iterations besides the deadline
  while (( tries-- > 0 )); do
    "$@" >/dev/null 2>&1 && return 0
    (( SECONDS - START_S < TIMEOUT )) || break
    sleep "$step"
  done
  die "timed out after $(( SECONDS - START_S ))s waiting for $what (logs: $DIR/log)"
}

# Pid from run/$1.pid if that process is alive (not a zombie) and is what the
# name says (ceph-mon, ceph-osd, radosgw, or our bash watchdog): never kill a
# process that merely reused the pid.
live_pid() {
  local name=$1 f="$DIR/run/$1.pid" p comm state want
  case $name in
    mon.*) want=ceph-mon ;; osd.*) want=ceph-osd ;; client.rgw.*) want=radosgw ;; *) want=bash ;;
  esac
  [[ -f $f ]] || return 1
  p=$(<"$f"); [[ $p =~ ^[0-9]+$ ]] || return 1
  comm=$(cat "/proc/$p/comm" 2>/dev/null) || return 1
  state=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null) || return 1
  [[ $state != Z && $comm == "$want" ]] || return 1
  echo "$p"
}

# SIGKILL, not SIGTERM: each daemon spends ~2 s shutting down gracefully, and the
# memstore data is thrown away anyway.
kill_pidfile() {
  local name=$1 p i
  p=$(live_pid "$name") || return 0
  [[ $p == "$$" ]] && return 0  # the watchdog stopping the cluster spares itself
  kill -9 "$p" 2>/dev/null || true
  for i in $(seq 1 50); do live_pid "$name" >/dev/null || break; sleep 0.1; done
  log "stopped $name (pid $p)"
}

env_lines() {
  cat <<EOF
export CEPH_RGW_ENDPOINT=http://127.0.0.1:$RGW_PORT
export CEPH_RGW_ACCESS_KEY=$ACCESS_KEY
export CEPH_RGW_SECRET_KEY=$SECRET_KEY
export CEPH_RGW_DIR=$DIR
EOF
}

# True if an HTTP server answers on the RGW port (plain bash: no curl needed).
s3_answers() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$RGW_PORT" &&
      printf 'GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3 &&
      read -r -t 2 line <&3 && [[ $line == HTTP/1.* ]]
  ) 2>/dev/null
}

running() {
  local n
  for n in "${DAEMONS[@]}"; do live_pid "$n" >/dev/null || return 1; done
  [[ -f $DIR/env ]] && grep -q "127.0.0.1:$RGW_PORT\$" "$DIR/env" && s3_answers
}

# Run "$@" up to 5 times. A fresh Pacific monitor now and then rejects a client's
# first command with 'wrong fsid' (seen in mon.a.log as "fsid 00000000-... != ...").
retry() {
  local i
  for i in 1 2 3 4 5; do
    "$@" && return 0
    (( SECONDS - START_S < TIMEOUT )) || break
    sleep 0.3
  done
  return 1
}

# Start daemon $1 (a ceph name; pid file run/$1.pid) as "${@:3}" and wait until
# `$2` succeeds. Restart it (3 tries) if it dies or is not ready within 30 s,
# for the same 'wrong fsid' race as above.
start_daemon() {
  local name=$1 ready=$2 try i; shift 2
  for try in 1 2 3; do
    "$@" >>"$DIR/log/$name.out" 2>&1 || true
    for (( i = 0; i < 150; i++ )); do
      "$ready" >/dev/null 2>&1 && return 0
      (( SECONDS - START_S < TIMEOUT )) || die "timed out starting $name (logs: $DIR/log)"
      live_pid "$name" >/dev/null || (( i < 10 )) || break  # died
      sleep 0.2
    done
    log "$name did not come up (try $try); restarting it"
    kill_pidfile "$name"
  done
  die "$name did not start (logs: $DIR/log)"
}

osd_up() { timeout 5 ceph -c "$DIR/ceph.conf" osd stat | grep -q '1 up'; }

create_user() {
  timeout 30 radosgw-admin -c "$DIR/ceph.conf" user info --uid=shardckpt >/dev/null 2>&1 ||
    timeout 30 radosgw-admin -c "$DIR/ceph.conf" user create --uid=shardckpt --display-name=shardckpt \
      --access-key="$ACCESS_KEY" --secret="$SECRET_KEY" >/dev/null
}

cmd_install() {
  local missing=0 b
  for b in radosgw ceph-mon ceph-osd; do command -v "$b" >/dev/null || missing=1; done
  if (( missing == 0 )); then log "ceph already installed"; return 0; fi
  local sudo=()
  (( EUID == 0 )) || sudo=(sudo)
  "${sudo[@]}" apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y radosgw ceph-mon ceph-osd
}

cmd_stop() {
  local n
  if [[ -d $DIR && ! -f $DIR/$MARKER ]] && [[ -n $(ls -A "$DIR") ]]; then
    die "$DIR exists but was not made by this script; not touching it"
  fi
  kill_pidfile watchdog
  for n in "${DAEMONS[@]}"; do kill_pidfile "$n"; done
  rm -rf "$DIR"
}

cmd_status() { running && env_lines; }

start_watchdog() {
  [[ -n ${CEPH_RGW_WATCH_PID:-} ]] || return 0
  kill -0 "$CEPH_RGW_WATCH_PID" 2>/dev/null || die "CEPH_RGW_WATCH_PID=$CEPH_RGW_WATCH_PID is not alive"
  setsid bash "$SELF" _watch "$CEPH_RGW_WATCH_PID" </dev/null >>"$DIR/log/watchdog.log" 2>&1 &
  echo $! >"$DIR/run/watchdog.pid"
}

# Runs detached: stop the cluster once the owner exits, or after MAX_LIFE seconds.
cmd_watch() {
  local owner=$1 i
  for (( i = 0; i < MAX_LIFE; i++ )); do kill -0 "$owner" 2>/dev/null || break; sleep 1; done
  log "owner $owner gone or max life reached; stopping"
  cmd_stop
}

on_start_exit() {
  local rc=$?
  (( rc != 0 )) || return 0
  log "start failed (exit $rc); last log lines:"
  tail -n 5 "$DIR"/log/* >&2 2>/dev/null || true
  cmd_stop || true
}

cmd_start() {
  command -v radosgw >/dev/null && command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null \
    || die "ceph binaries not found; run: $0 install"
  if running; then log "already running"; env_lines; return 0; fi
  cmd_stop  # clear a half-started or stale cluster
  local p
  for p in "$RGW_PORT" "$MON_PORT"; do port_busy "$p" && die "port $p on 127.0.0.1 is in use"; done
  [[ $OSD_PORTS =~ ^([0-9]+)-([0-9]+)$ ]] || die "CEPH_OSD_PORTS must look like 6800-7300"

  mkdir -p "$DIR"/{mon,osd0,rgw,log,run}
  touch "$DIR/$MARKER"
  trap 'on_start_exit' EXIT  # any failure below (set -e, die, timeout) cleans up
  local fsid C osd_id
  fsid=$(cat /proc/sys/kernel/random/uuid)
  # cephx off, memstore OSD, size-1 pools, msgr v1 only: the smallest cluster RGW accepts.
  cat >"$DIR/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = v1:127.0.0.1:$MON_PORT
mon initial members = a
public addr = 127.0.0.1
ms bind msgr2 = false
ms bind port min = ${BASH_REMATCH[1]}
ms bind port max = ${BASH_REMATCH[2]}
auth cluster required = none
auth service required = none
auth client required = none
osd objectstore = memstore
memstore device bytes = 4294967296
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
# Commit map changes at once, not every second: RGW's pool setup needs ~12 epochs.
paxos propose interval = 0.05
paxos min wait = 0.01
run dir = $DIR/run
log file = $DIR/log/\$name.log
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.pid
keyring = $DIR/keyring
[mon.a]
mon data = $DIR/mon
[osd.0]
# We add osd.0 to the CRUSH map ourselves. The OSD's own update at boot can race
# its first monmap and fail with 'wrong fsid'.
osd crush update on start = false
osd class update on start = false
osd data = $DIR/osd0
osd journal size = 16
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw data = $DIR/rgw
rgw dns name = 127.0.0.1
EOF
  C=(-c "$DIR/ceph.conf")
  ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool "$DIR/keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
  monmaptool --create --addv a "[v1:127.0.0.1:$MON_PORT]" --fsid "$fsid" "$DIR/monmap" >/dev/null
  ceph-mon "${C[@]}" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring" >"$DIR/log/mon.a.out" 2>&1
  ceph-mon "${C[@]}" -i a >>"$DIR/log/mon.a.out" 2>&1
  wait_for "monitor" 0.2 timeout 5 ceph "${C[@]}" --connect-timeout 3 mon stat
  local osd_uuid; osd_uuid=$(cat /proc/sys/kernel/random/uuid)
  osd_id=$(retry timeout 20 ceph "${C[@]}" osd create "$osd_uuid")  # same uuid: same id
  [[ $osd_id == 0 ]] || die "expected osd id 0, got '$osd_id'"
  ceph-osd "${C[@]}" -i 0 --mkfs --osd-uuid "$osd_uuid" >"$DIR/log/osd.0.out" 2>&1
  retry timeout 20 ceph "${C[@]}" osd crush add osd.0 1 root=default host=localhost >/dev/null 2>&1
  start_daemon osd.0 osd_up ceph-osd "${C[@]}" -i 0
  start_daemon client.rgw.a s3_answers radosgw "${C[@]}" -n client.rgw.a
  retry create_user
  trap - EXIT
  env_lines >"$DIR/env"
  start_watchdog
  log "up on http://127.0.0.1:$RGW_PORT in $(( SECONDS - START_S ))s (state: $DIR)"
  env_lines
}

case ${1:-} in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  _watch) cmd_watch "$2" ;;
  *) echo "usage: $0 install|start|status|stop" >&2; exit 2 ;;
esac
