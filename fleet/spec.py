"""The fleet file: one JSON document that names every engine once.

Each engine's ``name`` is the only identity it has: the conductor registration's
``instance_id``, the router upstream's ``instance_id``, the simulator's metrics label and the
log file name all come from it, so the three can never disagree (they used to, when an
operator wrote the conductor config, the engine flags and the router config by hand).

A fleet serves one model (``model``) or several (``models``: each with its engines, LoRA
adapters and the router's settings for it); an engine serves the model it names (``model``,
by default the first). ``keys`` is the router's client keys file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from conductor.config import one_line
from publishers.engine.models import MAX_LORA_RANKS  # what vLLM's --max-lora-rank takes
from router.config import PolicyName, RoutingSection
from router.keys import parse_keys_file

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"  # safe in file names, labels and URLs
MASTER_NAME, STORE_NAME = "mooncake-master", "mooncake-store"  # the store's two processes
RESERVED_NAMES = ("conductor", "router", MASTER_NAME, STORE_NAME)
DEFAULT_VLLM_PYTHON = "~/.cache/mooncake/vllm-cpu/bin/python"
DEFAULT_SGLANG_PYTHON = "~/.cache/mooncake/sglang-cpu/bin/python"
REAL_KINDS = ("vllm", "sglang")  # engines that load the model and run it
LORA_KINDS = ("vllm", "sim")  # engines the fleet gives LoRA adapters to
DEFAULT_TINY_MODEL_DIR = "~/.cache/mooncake/tiny-model"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # a misspelt key is an error


class ModelSection(_Section):
    """The one-model form, ``model``; the entries of ``models`` can say more."""

    name: str = Field(default="tiny-llama", min_length=1)
    # real engines load this directory; absent: the tiny model, written on first use
    path: Path | None = None
    # what simulated engines tokenize with: "model" is that directory's HF tokenizer and
    # chat template (the ids real vLLM computes), "stand-in" the simulator's own
    sim_tokenizer: Literal["model", "stand-in"] = "stand-in"


def _lora_rank(rank: int) -> int:
    if rank not in MAX_LORA_RANKS:
        raise ValueError(f"must be one of {', '.join(map(str, MAX_LORA_RANKS))}")
    return rank


class FleetModel(ModelSection):
    """One model of ``models``: its LoRA adapters, and the router's settings for it."""

    block_size: int | None = Field(default=None, gt=0)  # absent: the fleet's
    # adapter name → its directory: relative to the model's directory (the tiny model's
    # adapter is "lora/tiny-sql") or absolute; a simulator only names it, reading nothing
    adapters: dict[Annotated[str, Field(pattern=NAME_PATTERN)], str] = Field(default_factory=dict)
    max_lora_rank: Annotated[int, AfterValidator(_lora_rank)] = 16  # vLLM's default
    default: bool = False  # the router's model for a request that names none
    max_concurrent_requests: int | None = Field(default=None, ge=0)  # absent: the router's
    max_queued_requests: int | None = Field(default=None, ge=0)
    # the router's routing keys for this model, over the fleet's (router.policy)
    routing: RoutingSection = RoutingSection()


class ServiceSection(_Section):
    port: int | None = Field(default=None, ge=1, le=65535)  # absent: a free port (the first's)
    args: list[str] = Field(default_factory=list)  # extra command-line flags
    # how many run side by side: conductors take each other's snapshots at start (peers),
    # routers share the conductors and what they route (each on a port of its own)
    replicas: int = Field(default=1, ge=1, le=16)


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
    model: str | None = None  # the name of the model it serves; absent: the first
    port: int | None = Field(default=None, ge=1, le=65535)
    replay_port: int | None = Field(default=None, ge=1, le=65535)
    args: list[str] = Field(default_factory=list)
    # extra environment; null removes a variable the fleet would set (e.g. PYTHONHASHSEED)
    env: dict[str, str | None] = Field(default_factory=dict)


class FleetSpec(_Section):
    model: ModelSection = ModelSection()
    models: list[FleetModel] = Field(default_factory=list)
    block_size: int = Field(default=32, gt=0)
    host: str = "127.0.0.1"  # where every HTTP service listens
    conductor: ServiceSection = ServiceSection()
    router: RouterSection = RouterSection()
    engines: list[EngineSpec] = Field(min_length=1)
    # the router's client keys file (docs/keys.md): relative to the fleet file, or absolute
    keys: Path | None = None
    kv_store: StoreSection | None = None
    vllm_python: str = Field(default_factory=lambda: os.environ.get("VLLM_PYTHON", ""))
    vllm_kv_cache_gib: float = Field(default=1.0, gt=0)
    sglang_python: str = Field(default_factory=lambda: os.environ.get("SGLANG_PYTHON", ""))
    sglang_max_total_tokens: int = Field(default=8192, gt=0)  # each SGLang engine's KV pool
    startup_timeout_s: float = Field(default=240.0, gt=0)

    @field_validator("keys")
    @classmethod
    def _usable_keys_file(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        """The file as an absolute path, checked now: a fleet whose router would refuse
        its keys file stops before it starts anything."""
        if path is None:
            return None
        base = (info.context or {}).get("fleet_dir", Path())
        path = (base / path.expanduser()).absolute()
        try:
            parse_keys_file(path.read_bytes())
        except OSError as error:
            raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
        except ValueError as error:
            raise ValueError(f"{path}: {one_line(error)}") from None
        return path

    @model_validator(mode="after")
    def _consistent(self) -> FleetSpec:
        names = [engine.name for engine in self.engines]
        if len(names) != len(set(names)):
            raise ValueError("engine names must be unique")
        replicas = [
            f"{service}-{n}"
            for service, section in (("conductor", self.conductor), ("router", self.router))
            for n in range(1, section.replicas)
        ]
        if taken := sorted({*RESERVED_NAMES, *replicas} & set(names)):
            raise ValueError(f"{', '.join(taken)}: names of the fleet's own services")
        if self.models and "model" in self.model_fields_set:
            raise ValueError("give `model` (one model) or `models`, not both")
        self._check_models()
        for index, engine in enumerate(self.engines):
            self._check_engine(index, engine)
        if self.kv_store is not None and self.has_kind("sglang"):
            raise ValueError("kv_store: SGLang engines do not save to a Mooncake store here")
        return self

    def _check_models(self) -> None:
        """Names a request tells apart (models and adapters), one default, an engine each."""
        names = [m.name for m in self.served_models]
        names += [adapter for m in self.served_models for adapter in m.adapters]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"models: model and adapter names must be unique: {repeated[0]}")
        if sum(model.default for model in self.models) > 1:
            raise ValueError("models: at most one model can be the default")
        for index, model in enumerate(self.models):
            if not self.engines_of(model):
                raise ValueError(
                    f"models.{index}: no engine serves `{model.name}` (an engine says so "
                    f'with "model": "{model.name}")'
                )

    def _check_engine(self, index: int, engine: EngineSpec) -> None:
        known = [model.name for model in self.served_models]
        if engine.model is not None and engine.model not in known:
            raise ValueError(
                f"engines.{index}.model: no model `{engine.model}` in the fleet "
                f"(it serves {', '.join(known)})"
            )
        model = self.model_of(engine)
        block_size = self.block_size_of(model)
        if engine.kind == "vllm" and block_size % 32:
            raise ValueError(
                f"engines.{index}: vLLM on CPU needs a block_size multiple of 32, not {block_size}"
            )
        if model.adapters and engine.kind not in LORA_KINDS:
            raise ValueError(
                f"engines.{index}: {engine.kind} engine `{engine.name}` cannot serve the LoRA "
                f"adapters of `{model.name}`: the fleet runs LoRA on vllm and sim engines only"
            )

    @property
    def served_models(self) -> list[FleetModel]:
        """``models``, or the one model of ``model``."""
        return self.models or [FleetModel.model_validate(self.model.model_dump())]

    def model_of(self, engine: EngineSpec) -> FleetModel:
        """The model the engine serves: the one it names, else the first."""
        named = [model for model in self.served_models if model.name == engine.model]
        return (named or self.served_models)[0]

    def engines_of(self, model: FleetModel) -> list[EngineSpec]:
        return [engine for engine in self.engines if self.model_of(engine).name == model.name]

    def block_size_of(self, model: FleetModel) -> int:
        return model.block_size or self.block_size

    def reads_directory(self, model: FleetModel) -> bool:
        """Whether the model's engines read its directory (real engines load it, simulators
        may tokenize with it); the router then tokenizes with it too."""
        real = any(engine.kind in REAL_KINDS for engine in self.engines_of(model))
        return real or model.sim_tokenizer == "model"

    @property
    def needs_tiny_model(self) -> bool:
        """Whether a model without a ``path`` has its directory read: the tiny model's."""
        return any(m.path is None and self.reads_directory(m) for m in self.served_models)

    def model_paths(self) -> list[Path]:
        """The directories of the models with a ``path`` whose directory is read."""
        return [
            m.path.expanduser()
            for m in self.served_models
            if m.path is not None and self.reads_directory(m)
        ]

    def has_kind(self, kind: str) -> bool:
        return any(engine.kind == kind for engine in self.engines)

    def vllm_interpreter(self) -> Path:
        return Path(self.vllm_python or DEFAULT_VLLM_PYTHON).expanduser()

    def sglang_interpreter(self) -> Path:
        return Path(self.sglang_python or DEFAULT_SGLANG_PYTHON).expanduser()


def load(path: Path) -> FleetSpec:
    """Reads and validates a fleet file; raises OSError or ValueError with the reason."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return FleetSpec.model_validate(data, context={"fleet_dir": path.parent})
