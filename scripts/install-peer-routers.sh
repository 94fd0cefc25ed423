#!/usr/bin/env bash
# The Rust routers users pick instead of ours (vllm-router, sglang-router: PyPI wheels with
# binaries), in a venv of their own: they bring their own FastAPI/uvicorn pins. The router
# comparison bench and its smoke test find them through MOONCAKE_PEER_BIN_DIR=<venv>/bin.
set -euo pipefail
VENV="${1:-$HOME/.cache/mooncake/peer-routers}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "vllm-router==0.1.17" "sglang-router==0.3.2"
echo "$VENV/bin"
