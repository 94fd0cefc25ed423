#!/usr/bin/env bash
# Everything the container tests (tests/container/) need, on a machine that reaches no image
# registry, in order: podman, the Debian base image, the stand-ins for the Dockerfile's FROM
# images, then the project's image from the Dockerfile unchanged. Each step prints its time;
# the first three are skipped when already done (podman's storage is the cache between runs).
# Needs root.
#   usage: scripts/container/prepare.sh [--head]   (--head: see build-image.sh)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
step() {
    local started=$SECONDS
    echo "-- $1"
    "$here/$1" "${@:2}"
    echo "   $1: $((SECONDS - started)) s"
}
step setup-podman.sh
step base-image.sh
step stand-ins.sh
step build-image.sh "$@"
