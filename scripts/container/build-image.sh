#!/usr/bin/env bash
# Builds the repository's Dockerfile, unchanged, with podman: its FROM images are the local
# stand-ins (--pull=never: no registry is asked), in Docker's format (OCI's has no
# HEALTHCHECK). The dependencies come from the package registry, as on any machine.
#   usage: scripts/container/build-image.sh [--head] [TAG]   (default localhost/mooncake-conductor:ci)
# --head builds the committed tree (git archive HEAD) instead of the work tree: what a fresh
# clone builds, whatever is being edited in the work tree meanwhile.
set -euo pipefail
# shellcheck source=scripts/container/env.sh
source "$(dirname "$0")/env.sh"
cd "$CONTAINER_DIR/../.."
context=.
if [ "${1:-}" = --head ]; then
    shift
    context="$(mktemp -d /var/tmp/mooncake-context-XXXXXX)"
    trap 'rm -rf "$context"' EXIT
    git archive --format=tar HEAD | tar -x -C "$context"
fi
tag="${1:-$PROJECT_IMAGE}"
# the tests that run the image check this label against the work tree (context_digest.py)
digest="$(python3 "$CONTAINER_DIR/context_digest.py" "$context")"
log="$(mktemp /tmp/mooncake-image-build-XXXXXX.log)"
if ! podman build --pull=never --format docker --label "mooncake.context=$digest" \
        -t "$tag" "$context" >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "podman build failed; the whole log: $log" >&2
    exit 1
fi
rm -f "$log"
# the layers the previous build of this tag left untagged
podman image prune --force >/dev/null
# (podman 4.3's --format templates cannot reach .Healthcheck: read the JSON)
if ! podman image inspect "$tag" | grep -q '"Healthcheck": {'; then
    echo "$tag has no HEALTHCHECK (built in OCI format?)" >&2
    exit 1
fi
echo "built $tag ($(podman image inspect --format '{{.Size}}' "$tag" | numfmt --to=iec)B, with its HEALTHCHECK)"
