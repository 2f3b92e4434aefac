#!/usr/bin/env bash
# rgw-down.sh DIR : stop every daemon of the cluster started by rgw-up.sh DIR.
# Uses the pid files in DIR/run; a pid is only signalled if its command line names
# DIR/ceph.conf (guards against pid reuse). One daemon at a time, radosgw -> osd -> mon:
# SIGTERM, then SIGKILL after 10 s. (Signalling all at once makes radosgw's shutdown wait
# ~5 s for the already-dead osd/mon.) Leaves DIR itself in place (rm -rf it yourself).
set -uo pipefail
DIR=${1:?usage: rgw-down.sh DIR}
DIR=$(cd "$DIR" 2>/dev/null && pwd) || { echo "rgw-down: no such dir $1" >&2; exit 0; }
CONF=$DIR/ceph.conf

# true while pid $1 is a live (non-zombie) process started with -c DIR/ceph.conf
ours() { [ -r "/proc/$1/cmdline" ] && tr "\0" " " <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$CONF"; } 2>/dev/null

for f in "$DIR"/run/client.*.pid "$DIR"/run/osd.*.pid "$DIR"/run/mon.*.pid; do
  [ -f "$f" ] || continue
  p=$(cat "$f")
  if [[ "$p" =~ ^[0-9]+$ ]] && ours "$p"; then
    kill -TERM "$p" 2>/dev/null
    for ((i = 0; i < 200; i++)); do ours "$p" || break; sleep 0.05; done
    if ours "$p"; then
      echo "rgw-down: $(basename "$f" .pid) ignored SIGTERM for 10 s, SIGKILL" >&2
      kill -KILL "$p" 2>/dev/null
      while ours "$p"; do sleep 0.05; done
    fi
  fi
  rm -f "$f"
done
exit 0
