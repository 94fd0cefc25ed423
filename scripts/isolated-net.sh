#!/usr/bin/env bash
# Runs a command in a new network namespace of its own: loopback, plus one veth pair with a
# link-local address that nothing is ever sent to. The Mooncake binaries listen on every
# interface whatever their flags say and refuse to start without a non-loopback address;
# in here "every interface" is loopback and that pair. Needs root (unshare -n).
#   usage: scripts/isolated-net.sh python -m pytest
set -euo pipefail
exec unshare -n bash -c '
  ip link set lo up
  ip link add lan0 type veth peer name lan1
  ip addr add 169.254.77.1/32 dev lan0
  ip link set lan0 up && ip link set lan1 up
  exec "$@"' isolated-net "$@"
