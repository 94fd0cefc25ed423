#!/usr/bin/env bash
# Makes the stand-ins for the Dockerfile's FROM images, python:3.11 and python:3.11-slim
# (stand-ins.Containerfile), from the base image, tagged with the names the FROM lines use so
# that `podman build --pull=never` finds them locally. Skipped when both exist and were made
# from this recipe and this base (the cache).
#   usage: scripts/container/stand-ins.sh
set -euo pipefail
# shellcheck source=scripts/container/env.sh
source "$(dirname "$0")/env.sh"
base_id="$(podman image inspect --format '{{.Id}}' "$BASE_IMAGE")"
recipe="$(cat "$0" "$CONTAINER_DIR/stand-ins.Containerfile" | sha256sum | cut -c1-16)-${base_id:0:12}"
label() { podman image inspect --format '{{index .Labels "mooncake.recipe"}}' "$1" 2>/dev/null; }
if [ "$(label "$BUILD_FROM")" = "$recipe" ] && [ "$(label "$RUNTIME_FROM")" = "$recipe" ]; then
    echo "$RUNTIME_FROM and $BUILD_FROM stand-ins are up to date"
    exit 0
fi
for target in slim full; do
    tag="$RUNTIME_FROM"
    [ "$target" = full ] && tag="$BUILD_FROM"
    podman build --quiet --pull=never --format docker --target "$target" \
        --build-arg "BASE=$BASE_IMAGE" --label "mooncake.recipe=$recipe" \
        -f "$CONTAINER_DIR/stand-ins.Containerfile" -t "$tag" "$CONTAINER_DIR" >/dev/null
    echo "made $tag ($(podman run --rm --pull=never "$tag" python --version))"
done
