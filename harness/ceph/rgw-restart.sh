#!/usr/bin/env bash
# rgw-restart.sh DIR : (re)start only the radosgw of the cluster made by rgw-up.sh DIR
# (kills a running one first: SIGTERM, then SIGKILL after 10 s) and waits until S3 answers.
set -euo pipefail
DIR=$(cd "${1:?usage: rgw-restart.sh DIR}" && pwd)
CONF=$DIR/ceph.conf
PORT=$(sed -n 's/^rgw frontends = .*endpoint=127\.0\.0\.1:\([0-9]*\).*/\1/p' "$CONF")
PIDF=$DIR/run/client.rgw.pid
ours() { [ -r "/proc/$1/cmdline" ] && tr "\0" " " <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$CONF"; } 2>/dev/null
if [ -f "$PIDF" ] && p=$(cat "$PIDF") && ours "$p"; then
  kill -TERM "$p"
  for ((i = 0; i < 100; i++)); do ours "$p" || break; sleep 0.1; done
  ours "$p" && kill -KILL "$p"
  while ours "$p"; do sleep 0.05; done
fi
setsid radosgw -c "$CONF" -n client.rgw -f </dev/null >>"$DIR/log/client.rgw.out" 2>&1 &
echo $! >"$PIDF"
for ((i = 0; i < 600; i++)); do
  kill -0 "$(cat "$PIDF")" 2>/dev/null || { echo "rgw-restart: radosgw exited, see $DIR/log/client.rgw.log" >&2; exit 1; }
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/" || true)" = 200 ] && exit 0
  sleep 0.2
done
echo "rgw-restart: radosgw not answering on 127.0.0.1:$PORT" >&2; exit 1
