#!/usr/bin/env bash
# The base of the stand-in images: a minimal Debian of the host's release, from the mirror
# the host's apt uses, trusting the host's CA certificates (outgoing TLS may be re-signed by
# a local CA: pip inside a build must trust it too). No registry is needed.
# Skipped when the image exists and was made by this version of this script (the cache:
# podman's storage is kept between CI runs on the same machine).
#   usage: scripts/container/base-image.sh
set -euo pipefail
# shellcheck source=scripts/container/env.sh
source "$(dirname "$0")/env.sh"
# shellcheck disable=SC1091
release="$(. /etc/os-release && echo "$VERSION_CODENAME")"
recipe="$(cat "$0" /usr/local/share/ca-certificates/* 2>/dev/null | sha256sum | cut -c1-16)-$release"
if [ "$(podman image inspect --format '{{index .Labels "mooncake.recipe"}}' "$BASE_IMAGE" \
        2>/dev/null)" = "$recipe" ]; then
    echo "$BASE_IMAGE is up to date"
    exit 0
fi

# the first "deb" mirror of the host's apt sources, either format
mirror="$(
    { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
      grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'
    } | grep -v -- '-security' | head -1 || true
)"
mirror="${mirror:-http://deb.debian.org/debian}"
rootfs="$(mktemp -d /var/tmp/mooncake-rootfs-XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap $release from $mirror"
debootstrap --variant=minbase --include=ca-certificates "$release" "$rootfs" "$mirror" \
    >"$rootfs.log" 2>&1 || { tail -30 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"

# the host's own CA certificates, added to the image's bundle (/etc/ssl/certs)
if compgen -G "/usr/local/share/ca-certificates/*" >/dev/null; then
    cp -r /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
else  # a host that only has the bundle: take it whole
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
# apt inside the image uses the same mirror as the host
echo "deb $mirror $release main" >"$rootfs/etc/apt/sources.list"
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin

tar -C "$rootfs" -c . | podman import --quiet \
    --change "LABEL mooncake.recipe=$recipe" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["bash"]' \
    - "$BASE_IMAGE" >/dev/null
echo "made $BASE_IMAGE"
