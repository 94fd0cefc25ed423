#!/usr/bin/env bash
# Installs podman from Debian's packages when missing (runc, not crun: see containers.conf),
# and checks that it runs with this directory's containers.conf. Idempotent; needs root.
#   usage: scripts/container/setup-podman.sh
set -euo pipefail
# shellcheck source=scripts/container/env.sh
source "$(dirname "$0")/env.sh"
packages=(podman runc conmon netavark aardvark-dns iptables catatonit debootstrap)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" \
        || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi
podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}} {{.Host.CgroupsVersion}}' \
    | { read -r runtime manager version
        echo "podman $(podman version --format '{{.Client.Version}}'): runtime $runtime," \
             "cgroups $version via $manager"
        [ "$runtime" = runc ] || { echo "podman ignored $CONTAINERS_CONF" >&2; exit 1; }; }
