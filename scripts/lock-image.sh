#!/usr/bin/env bash
# Regenerate constraints.txt: the exact versions the Docker image installs. It installs the
# project into a throw-away venv from the current registry and records what pip resolved.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet .
{
    echo "# The exact versions the Docker image installs (pip install -c constraints.txt)."
    echo "# Regenerate with scripts/lock-image.sh; tests/test_image.py checks it covers pyproject."
    "$venv/bin/pip" freeze --exclude mooncake-conductor-py
} > constraints.txt
