#!/usr/bin/env bash
# Installs real SGLang (PyPI sglang) for CPUs into its own virtual environment, where its pins
# (transformers, tokenizers, ...) cannot clash with ours. Idempotent: a venv that already holds
# the pinned versions is kept; the sgl_kernel stand-in is reinstalled when its version changes.
#   usage: scripts/install-sglang-cpu.sh [VENV_DIR]   (default ~/.cache/mooncake/sglang-cpu)
# Prints SGLANG_PYTHON=<venv>/bin/python last. Start a server with SGLANG_USE_CPU_ENGINE=1 and
# `--device cpu --attention-backend torch_native --disable-cuda-graph`.
# Stop it with SIGTERM to its main process alone (to the whole group it takes a crash path);
# it still leaves /dev/shm/sglang_loads_*.shm behind, and it makes ~/.cache/sglang unless
# SGLANG_CACHE_DIR names another place.
#
# PyPI's sglang wheel is one for GPUs and CPUs alike, and it requires a GPU build: flashinfer,
# flash-attn, sglang-kernel (CUDA builds only, no sdist), deep-ep/deep-gemm, tilelang,
# cuda-python, and torch==2.14.1, which from PyPI is a CUDA build of several GB. So sglang goes
# in with --no-deps; its other requirements are read from its wheel's metadata, less the CUDA-only
# ones (SKIP), and installed under a constraint that holds torch at the CPU build 2.13.0 (pip on
# Python 3.11 takes it from this machine's disk). The one CUDA-only package that the CPU path
# imports, sgl_kernel, is replaced by a stand-in, scripts/sgl_kernel_cpu (see its README).
set -euo pipefail
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
# torchvision stays: the server imports torchvision.transforms on every start (sglang.srt.configs
# -> internvl_utils). 0.28.0 is the release built for torch 2.13.0. PyPI's build is CUDA-linked,
# so its compiled ops never load here, which torchvision tolerates except for two fake-kernel
# registrations (torchvision::nms, ::qnms) that then fail the import ("operator torchvision::nms
# does not exist"). Below, those two get the guard that torchvision's other registrations have.
TORCHVISION_VERSION=0.28.0
# sglang's requirements that the CPU path does without: CUDA builds, or packages that need CUDA
# to run; torchaudio and torchcodec are CUDA builds for another torch and serve audio/video only.
SKIP="cuda-python flash-attn-4 flashinfer-python humming-kernels nvidia-cutlass-dsl
nvidia-mathdx nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla
sglang-kernel tilelang torch-memory-saver torch torchaudio torchcodec"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$HOME/.cache/mooncake/sglang-cpu}"
python="$venv/bin/python"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

installed() { # the version of distribution $1 in the venv, or nothing
  [ -x "$python" ] && "$python" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p' || true
}

if [ "$(installed sglang)" = "$SGLANG_VERSION" ] && [ "$(installed torch)" = "$TORCH_VERSION+cpu" ] &&
  [ "$(installed torchvision)" = "$TORCHVISION_VERSION" ]; then
  echo "sglang $SGLANG_VERSION already in $venv"
else
  python3.11 -m venv "$venv"
  "$python" -m pip install --quiet --upgrade pip
  "$python" -m pip download --quiet --no-deps --dest "$work" "sglang==$SGLANG_VERSION"
  # sglang's requirements for this platform, from its wheel's metadata, less SKIP and extras.
  SKIP="$SKIP" "$python" - "$work"/sglang-*.whl >"$work/requirements.txt" <<'PY'
import os, sys, zipfile
from email.parser import HeaderParser
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

skip = {canonicalize_name(name) for name in os.environ["SKIP"].split()}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = HeaderParser().parsestr(wheel.read(name).decode())
for line in metadata.get_all("Requires-Dist"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's, or another platform's
    if canonicalize_name(req.name) not in skip:
        req.extras = set()  # e.g. no [cu13]
        print(req)
print("jsonschema")  # the server imports it; the wheel does not ask for it
PY
  printf '%s\n' "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" >"$work/constraints.txt"
  # The requirements first, then sglang without its own, so pip does not list the skipped ones.
  "$python" -m pip install --quiet "torch==$TORCH_VERSION" -r "$work/requirements.txt" \
    -c "$work/constraints.txt"
  "$python" -m pip install --quiet --no-deps "$work"/sglang-*.whl
fi

# Guard torchvision's two unguarded fake-kernel registrations (see TORCHVISION_VERSION).
"$python" - <<'PY'
import importlib.util, pathlib, re
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0], "_meta_registrations.py")
text = path.read_text()
guarded = re.sub(
    r'^@torch\.library\.register_fake\(("torchvision::q?nms")\)$',
    r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))",
    text,
    flags=re.M,
)
if guarded != text:
    path.write_text(guarded)
PY

# The sgl_kernel stand-in, reinstalled whenever the version in its pyproject.toml changes.
standin="$here/sgl_kernel_cpu"
standin_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$standin/pyproject.toml")
if [ "$(installed sgl-kernel-cpu-standin)" != "$standin_version" ]; then
  cp -r "$standin" "$work/standin"  # pip builds in the tree it is given: not in ours
  "$python" -m pip install --quiet --no-deps --force-reinstall "$work/standin"
fi

# The server's import path for a text model on the CPU: the CLI, the HTTP server, the scheduler
# and model runner (which import the stand-in's names), and the Llama model. SGLang makes its
# cache directory (~/.cache/sglang unless SGLANG_CACHE_DIR says otherwise) on import.
SGLANG_USE_CPU_ENGINE=1 SGLANG_CACHE_DIR="$work/cache" "$python" -W ignore - <<'PY'
import torch, torchvision, sgl_kernel, sglang
import sglang.launch_server, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
import sglang.srt.model_executor.model_runner, sglang.srt.models.llama
assert torch.__version__.endswith("+cpu"), torch.__version__
print("sglang", sglang.__version__, "torch", torch.__version__, "sgl_kernel stand-in", sgl_kernel.__version__)
PY
echo "SGLANG_PYTHON=$python"
