#!/usr/bin/env bash
# rgw-up.sh DIR PORT [ACCESS_KEY SECRET_KEY]
#
# Starts a throw-away single-node Ceph (Pacific 16.2.x, Debian 12 packages) cluster
# entirely inside DIR: 1 mon + 1 OSD + radosgw (beast on 127.0.0.1:PORT), ~4 s.
# No mgr (radosgw does not need one), no cephx, nothing in /etc/ceph or /var/lib/ceph.
# Every command gets `-c DIR/ceph.conf`, so several clusters (or reruns) can coexist.
# On success prints S3_ENDPOINT=... S3_ACCESS_KEY=... etc. on stdout (eval-able);
# progress/errors go to stderr. Stop with rgw-down.sh DIR; restart only radosgw with
# rgw-restart.sh DIR.  Needs: ceph-mon ceph-osd radosgw (install.sh), curl, python3.
#   RGW_OBJECTSTORE=memstore (default): data in the OSD's RAM; fastest (~4 s). Survives a
#       clean OSD restart, NOT a kill -9 of the OSD (cluster then hangs: recreate it).
#   RGW_OBJECTSTORE=bluestore: sparse 10 GiB file DIR/osd/0/block; ~7 s, crash-safe,
#       RSS independent of the amount of data stored.
set -euo pipefail

DIR=${1:?usage: rgw-up.sh DIR PORT [ACCESS_KEY SECRET_KEY]}
PORT=${2:?usage: rgw-up.sh DIR PORT [ACCESS_KEY SECRET_KEY]}
AK=${3:-${RGW_ACCESS_KEY:-testaccesskey}}
SK=${4:-${RGW_SECRET_KEY:-testsecretkey}}
TIMEOUT=${RGW_UP_TIMEOUT:-120}   # seconds to wait for each phase
STORE=${RGW_OBJECTSTORE:-memstore}
case $STORE in memstore | bluestore) ;; *) echo "rgw-up: RGW_OBJECTSTORE must be memstore|bluestore" >&2; exit 2 ;; esac

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)          # absolute: paths in ceph.conf must not depend on the cwd
CONF=$DIR/ceph.conf
[ -e "$CONF" ] && { echo "rgw-up: $CONF exists; use a fresh DIR (or rgw-down.sh + rm -rf)" >&2; exit 1; }
mkdir -p "$DIR"/{mon/a,osd/0,rgw,run,log,crash,tmp}

log() { echo "rgw-up [$(date +%T)] $*" >&2; }
die() {
  echo "rgw-up: ERROR: $*" >&2; echo "--- tail of logs in $DIR/log:" >&2
  tail -n 20 "$DIR"/log/*.log >&2 2>/dev/null || true
  for f in "$DIR"/run/*.pid; do [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null; done
  exit 1; }

# PORT must be free: otherwise the readiness probe could be answered by someone else.
python3 -c 'import socket,sys; socket.socket().bind(("127.0.0.1",int(sys.argv[1])))' "$PORT" 2>/dev/null \
  || die "127.0.0.1:$PORT is already in use"
# Two free loopback ports for the mon (msgr v2 + legacy v1), picked at random below the
# kernel's ephemeral range (32768+) so an outgoing connection can't grab them before the mon
# binds. OSD/radosgw pick their own messenger ports in 6800-7300, skipping bound ones.
read -r MON2 MON1 < <(python3 -c '
import random, socket
got = []
while len(got) < 2:
    p = random.randrange(20000, 32000)
    try: socket.socket().bind(("127.0.0.1", p)); got.append(p)
    except OSError: pass
print(*got)')
FSID=$(cat /proc/sys/kernel/random/uuid)

cat > "$CONF" <<EOF
[global]
fsid = $FSID
mon host = [v2:127.0.0.1:$MON2,v1:127.0.0.1:$MON1]
mon initial members = a
# bind every daemon to loopback only
public addr = 127.0.0.1
public network = 127.0.0.0/8
cluster network = 127.0.0.0/8
# no cephx: no keyrings to create/distribute; fine for a loopback-only test cluster
auth cluster required = none
auth service required = none
auth client required = none
# radosgw overrides its built-in default to ms_mon_client_mode=secure, which needs cephx:
# without this it retries 'get_initial_auth_request returned -13' for 5 minutes
ms mon client mode = crc
mon warn on insecure global id reclaim allowed = false
# fail in 30 s rather than the default 300 s when a daemon/tool cannot reach the mon
client mount timeout = 30
rgw init timeout = 60
# keep every path inside DIR (defaults point at /var/lib/ceph, /var/run/ceph, /var/log/ceph)
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/cluster.log
crash dir = $DIR/crash
keyring = $DIR/keyring
mon data = $DIR/mon/\$id
osd data = $DIR/osd/\$id
rgw data = $DIR/rgw
# single replica: pool size 1 is refused unless explicitly allowed, and warns unless silenced
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
# radosgw creates ~7 pools; default 32 PGs each exceeds mon_max_pg_per_osd (250) on one OSD
# without a mgr autoscaler, and fewer PGs peer faster
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
# CRUSH: replicate across OSDs, not hosts (only one host anyway)
osd crush chooseleaf type = 0
# don't go read-only/warn because the scratch disk is more than 70% full
mon data avail warn = 2
mon data avail crit = 1
# no ceph-mgr is run (radosgw does not need it); don't raise MGR_DOWN after the 120 s grace
mon mgr mkfs grace = 31536000
# commit map changes every 0.1 s instead of 1 s: rgw's pool creation (a dozen osdmap
# epochs) goes from ~9 s to ~1 s
paxos propose interval = 0.1

[osd]
osd objectstore = $STORE
# memstore: objects live in the OSD's RAM (saved to osd data only on clean shutdown); no
# mkfs of a device. device bytes is only the advertised capacity (writes stop at the 95 %
# full ratio); RSS grows with the data actually stored.
memstore device bytes = 4294967296
# ceph-osd exits on SIGTERM without unmounting by default ("fast shutdown"), which for
# memstore means it never saves: a restarted OSD comes back empty and all I/O hangs
osd fast shutdown = $([ "$STORE" = memstore ] && echo false || echo true)
# bluestore: mkfs creates DIR/osd/0/block as a sparse file of this size (default 100 GiB)
bluestore block size = 10737418240
# skip the fsck of the brand-new store at mkfs (~1 s)
bluestore fsck on mkfs = false
# bluestore caches up to osd_memory_target (default 4 GiB); 1 GiB is plenty here
osd memory target = 1073741824
# fewer op shards/threads: less RSS, plenty for a test suite on 2 cores
osd op num shards = 2
osd op num threads per shard = 2

[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$PORT
# no background bucket-index resharding in a test cluster
rgw dynamic resharding = false
# deleted/overwritten object data is garbage-collected after 2 h by default; with memstore
# that data stays in the OSD's RAM, so collect it after ~1 min instead (an object being
# read while it is overwritten/deleted may fail if the read lasts longer than that)
rgw gc obj min wait = 60
rgw gc processor period = 60
EOF

T0=$(date +%s.%N)
el() { python3 -c "import sys;print(f'{float(sys.argv[2])-float(sys.argv[1]):.1f}s')" "$T0" "$(date +%s.%N)"; }
C=(-c "$CONF")
# start a daemon in the foreground (-f: log to file, no fork) in its own session, so that
# we know its pid at once and the caller's Ctrl-C / process group doesn't reach it
start() { local name=$1; shift
  setsid "$@" -f </dev/null >>"$DIR/log/$name.out" 2>&1 &
  echo $! >"$DIR/run/$name.pid"; }
alive() { kill -0 "$(cat "$DIR/run/$1.pid")" 2>/dev/null || die "$1 exited (see $DIR/log/$1.out)"; }
ceph_() { timeout 30 ceph "${C[@]}" --connect-timeout 10 "$@"; }

# --- mon -----------------------------------------------------------------
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON2,v1:127.0.0.1:$MON1]" "$DIR/tmp/monmap" >/dev/null
ceph-mon "${C[@]}" -i a --mkfs --monmap "$DIR/tmp/monmap" >/dev/null 2>"$DIR/log/mon.a.mkfs.err" || die "mon mkfs failed"
start mon.a ceph-mon "${C[@]}" -i a
sleep 0.1; alive mon.a
ceph_ mon stat >/dev/null 2>&1 || die "mon not answering"
log "mon up ($(el))"

# --- osd -----------------------------------------------------------------
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
OSD_ID=$(ceph_ osd new "$OSD_UUID") || die "osd new failed"
[ "$OSD_ID" = 0 ] || die "unexpected osd id $OSD_ID"
ceph-osd "${C[@]}" -i 0 --mkfs --osd-uuid "$OSD_UUID" >/dev/null 2>"$DIR/log/osd.0.mkfs.err" || die "osd mkfs failed"
start osd.0 ceph-osd "${C[@]}" -i 0
for ((i = 0; i < TIMEOUT * 5; i++)); do
  alive osd.0
  ceph_ osd dump 2>/dev/null | grep -q '^osd.0 up' && break
  sleep 0.2
done
((i < TIMEOUT * 5)) || die "osd.0 did not come up"
log "osd ($STORE) up ($(el))"

# --- S3 user (creates the default realm/zone + rgw pools before radosgw starts) ----
radosgw-admin "${C[@]}" user create --uid=test --display-name=test \
  --access-key="$AK" --secret="$SK" >"$DIR/log/user-create.json" 2>"$DIR/log/user-create.err" \
  || die "radosgw-admin user create failed"
log "user created ($(el))"

# --- radosgw -------------------------------------------------------------
start client.rgw radosgw "${C[@]}" -n client.rgw
for ((i = 0; i < TIMEOUT * 5; i++)); do
  alive client.rgw
  # anonymous ListBuckets answers 200 once beast is listening and rgw is initialised
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/" || true)" = 200 ] && break
  sleep 0.2
done
((i < TIMEOUT * 5)) || die "radosgw not answering on 127.0.0.1:$PORT"
log "S3 endpoint up ($(el))"

cat <<EOF
S3_ENDPOINT=http://127.0.0.1:$PORT
S3_ACCESS_KEY=$AK
S3_SECRET_KEY=$SK
S3_REGION=us-east-1
CEPH_CONF=$CONF
EOF
