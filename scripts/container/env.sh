# Sourced by the scripts here and usable by hand (`source scripts/container/env.sh`): podman
# reads this directory's containers.conf, not /etc's, and the image names in one place.
CONTAINER_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CONTAINERS_CONF="$CONTAINER_DIR/containers.conf"
# the stand-ins are built from this one (scripts/container/base-image.sh)
BASE_IMAGE="${BASE_IMAGE:-localhost/mooncake-base:bookworm}"
# what the Dockerfile's FROM lines name (scripts/container/stand-ins.sh)
BUILD_FROM="docker.io/library/python:3.11"
RUNTIME_FROM="docker.io/library/python:3.11-slim"
# the project's image (scripts/container/build-image.sh; tests/container/ run it)
PROJECT_IMAGE="${PROJECT_IMAGE:-localhost/mooncake-conductor:ci}"
export BASE_IMAGE PROJECT_IMAGE
