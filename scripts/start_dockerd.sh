#!/usr/bin/env bash
# Start a local Docker engine for the @pytest.mark.docker tests, if none is reachable.
#
# Works in a container without networking privileges: no bridge, no iptables. Containers then
# run with network_mode "none" (what GPU tasks use anyway). Idempotent: does nothing when
# `docker info` already answers on $DOCKER_HOST (default unix:///var/run/docker.sock).
#
#   sudo apt-get install -y docker.io busybox-static   # engine + a static busybox for test images
#   scripts/start_dockerd.sh                            # then: pytest -m docker
set -euo pipefail

STATE_DIR="${GPUSCHED_DOCKERD_DIR:-/tmp/gpusched-dockerd}"
SOCKET="${DOCKER_HOST:-unix:///var/run/docker.sock}"

if docker -H "$SOCKET" info >/dev/null 2>&1; then
  echo "docker engine already running at $SOCKET"
  exit 0
fi
if ! command -v dockerd >/dev/null 2>&1; then
  echo "dockerd not found: install it with 'apt-get install -y docker.io'" >&2
  exit 1
fi
if [ "$(id -u)" != "0" ]; then
  echo "dockerd needs root here (run this script with sudo)" >&2
  exit 1
fi

mkdir -p "$STATE_DIR"
nohup dockerd --host "$SOCKET" --bridge=none --iptables=false --ip6tables=false \
  --data-root "$STATE_DIR/data" --exec-root "$STATE_DIR/exec" --pidfile "$STATE_DIR/dockerd.pid" \
  >"$STATE_DIR/dockerd.log" 2>&1 &

for _ in $(seq 1 60); do
  if docker -H "$SOCKET" info >/dev/null 2>&1; then
    echo "docker engine started at $SOCKET (log: $STATE_DIR/dockerd.log)"
    exit 0
  fi
  sleep 0.5
done
echo "dockerd did not come up within 30 s; see $STATE_DIR/dockerd.log" >&2
tail -n 20 "$STATE_DIR/dockerd.log" >&2 || true
exit 1
