"""The fleet file: one JSON document that names every engine once.

Each engine's ``name`` is the only identity it has: the conductor registration's
``instance_id``, the router upstream's ``instance_id``, the simulator's metrics label and the
log file name all come from it, so the three can never disagree (they used to, when an
operator wrote the conductor config, the engine flags and the router config by hand).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.config import PolicyName

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"  # safe in file names, labels and URLs
MASTER_NAME, STORE_NAME = "mooncake-master", "mooncake-store"  # the store's two processes
RESERVED_NAMES = ("conductor", "router", MASTER_NAME, STORE_NAME)
DEFAULT_VLLM_PYTHON = "~/.cache/mooncake/vllm-cpu/bin/python"
DEFAULT_SGLANG_PYTHON = "~/.cache/mooncake/sglang-cpu/bin/python"
REAL_KINDS = ("vllm", "sglang")  # engines that load the model and run it
DEFAULT_TINY_MODEL_DIR = "~/.cache/mooncake/tiny-model"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # a misspelt key is an error


class ModelSection(_Section):
    name: str = Field(default="tiny-llama", min_length=1)
    # real engines load this directory; absent: the tiny model, written on first use
    path: Path | None = None
    # what simulated engines tokenize with: "model" is that directory's HF tokenizer and
    # chat template (the ids real vLLM computes), "stand-in" the simulator's own
    sim_tokenizer: Literal["model", "stand-in"] = "stand-in"


class ServiceSection(_Section):
    port: int | None = Field(default=None, ge=1, le=65535)  # absent: a free port
    args: list[str] = Field(default_factory=list)  # extra command-line flags


class RouterSection(ServiceSection):
    policy: PolicyName = "ttft"


class StoreSection(_Section):
    """A Mooncake store every engine saves KV blocks to and loads them from: the master
    and one store process lending it ``segment_mb`` of memory (engines only borrow)."""

    segment_mb: int = Field(default=512, gt=0)
    local_buffer_mb: int = Field(default=128, gt=0)  # each engine's transfer buffer
    master_port: int | None = Field(default=None, ge=1, le=65535)  # RPC: the store's name
    metadata_port: int | None = Field(default=None, ge=1, le=65535)
    admin_port: int | None = Field(default=None, ge=1, le=65535)  # /health, /metrics, keys
    store_port: int | None = Field(default=None, ge=1, le=65535)
    master_args: list[str] = Field(default_factory=list)  # e.g. -default_kv_lease_ttl=5000


class EngineSpec(_Section):
    name: str = Field(pattern=NAME_PATTERN)
    kind: Literal["vllm", "sglang", "sim"]
    port: int | None = Field(default=None, ge=1, le=65535)
    replay_port: int | None = Field(default=None, ge=1, le=65535)
    args: list[str] = Field(default_factory=list)
    # extra environment; null removes a variable the fleet would set (e.g. PYTHONHASHSEED)
    env: dict[str, str | None] = Field(default_factory=dict)


class FleetSpec(_Section):
    model: ModelSection = ModelSection()
    block_size: int = Field(default=32, gt=0)
    host: str = "127.0.0.1"  # where every HTTP service listens
    conductor: ServiceSection = ServiceSection()
    router: RouterSection = RouterSection()
    engines: list[EngineSpec] = Field(min_length=1)
    kv_store: StoreSection | None = None
    vllm_python: str = Field(default_factory=lambda: os.environ.get("VLLM_PYTHON", ""))
    vllm_kv_cache_gib: float = Field(default=1.0, gt=0)
    sglang_python: str = Field(default_factory=lambda: os.environ.get("SGLANG_PYTHON", ""))
    sglang_max_total_tokens: int = Field(default=8192, gt=0)  # each SGLang engine's KV pool
    startup_timeout_s: float = Field(default=240.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> FleetSpec:
        names = [engine.name for engine in self.engines]
        if len(names) != len(set(names)):
            raise ValueError("engine names must be unique")
        if taken := sorted(set(RESERVED_NAMES) & set(names)):
            raise ValueError(f"{', '.join(taken)}: names of the fleet's own services")
        if self.has_vllm and self.block_size % 32:
            raise ValueError(
                f"vLLM on CPU needs a block_size multiple of 32, not {self.block_size}"
            )
        if self.kv_store is not None and self.has_kind("sglang"):
            raise ValueError("kv_store: SGLang engines do not save to a Mooncake store here")
        return self

    def has_kind(self, kind: str) -> bool:
        return any(engine.kind == kind for engine in self.engines)

    @property
    def has_vllm(self) -> bool:
        return self.has_kind("vllm")

    @property
    def needs_model(self) -> bool:
        """Whether any engine reads the model directory (real vLLM or SGLang, or a simulator
        tokenizing with it); the router then tokenizes with it too."""
        real = any(self.has_kind(kind) for kind in REAL_KINDS)
        return real or self.model.sim_tokenizer == "model"

    def vllm_interpreter(self) -> Path:
        return Path(self.vllm_python or DEFAULT_VLLM_PYTHON).expanduser()

    def sglang_interpreter(self) -> Path:
        return Path(self.sglang_python or DEFAULT_SGLANG_PYTHON).expanduser()


def load(path: Path) -> FleetSpec:
    """Reads and validates a fleet file; raises OSError or ValueError with the reason."""
    return FleetSpec.model_validate(json.loads(path.read_text(encoding="utf-8")))
