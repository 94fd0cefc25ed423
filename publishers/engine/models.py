"""What the simulator serves: its base model's names and its LoRA adapters, as vLLM 0.32.

A LoRA adapter here is only an identity: vLLM's ``--lora-modules NAME=PATH`` (or its JSON
form ``{"name": ..., "path": ..., "base_model_name": ...}``) names it, and the name and the
path are what reach the prefix cache (every block of an adapter's request is hashed with
``("lora", name, path)``) and the KV events (``lora_id``, ``lora_name``, ``extra_keys``).
No weights are read and an adapter computes as fast as the base model. Adapters get
``lora_int_id`` 1, 2, ... in the order they are given, as vLLM loads them at start-up.

``ServedModels.resolve`` answers which adapter (or the base model) a request's ``model``
names and under which name the answer reports it; ``cards`` is ``/v1/models``' list.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .block_hash import LoraAdapter

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's ``MaxLoRARanks``


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """vLLM's ``LoRAParserAction`` for one value: ``name=path``, or a JSON object."""
    if "=" in text and "," not in text:
        name, path = text.split("=", 1)
        return LoraModule(name, path)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"Invalid JSON format for --lora-modules: {text}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"Invalid fields for --lora-modules: {text}")
    fields.pop("is_3d_lora_weight", None)  # a weight layout: nothing to simulate
    try:
        return LoraModule(**fields)
    except TypeError as error:
        raise ValueError(f"Invalid fields for --lora-modules: {text} - {error}") from None


@dataclass(frozen=True, slots=True)
class Served:
    """What a request's ``model`` resolved to: the name answers carry, and its adapter."""

    name: str
    lora: LoraAdapter | None


class ServedModels:
    """The base model's served names and the adapters loaded at start-up."""

    def __init__(
        self, names: Sequence[str], model_path: str, modules: Sequence[LoraModule] = ()
    ) -> None:
        if not names:
            raise ValueError("a served model needs at least one name")
        self.names = tuple(names)
        self.model_path = model_path  # a base card's ``root``: vLLM's ``--model``
        self.adapters: dict[str, LoraAdapter] = {}
        self._parents: dict[str, str] = {}
        for adapter_id, module in enumerate(modules, start=1):
            self._add(module, adapter_id)

    def _add(self, module: LoraModule, adapter_id: int) -> None:
        """vLLM's start-up checks of a static adapter (``load_lora_adapter``)."""
        if not module.name or not module.path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        if module.name in self.names:
            raise ValueError(
                f"The lora adapter '{module.name}' conflicts with a served base model."
            )
        if module.name in self.adapters:
            raise ValueError(
                f"The lora adapter '{module.name}' has already been loaded. If you want to "
                "load the adapter in place, set 'load_inplace' to True."
            )
        self.adapters[module.name] = LoraAdapter(module.name, adapter_id, module.path)
        base = module.base_model_name
        self._parents[module.name] = base if base in self.names else self.names[0]

    def resolve(self, model: str | None) -> Served | None:
        """A request's ``model``: none (or empty) is the base model, as any served name,
        which answers always call by the first; None when nothing by that name is served."""
        if not model or model in self.names:
            return Served(self.names[0], None)
        adapter = self.adapters.get(model)
        return None if adapter is None else Served(adapter.name, adapter)

    def unknown(self, model: str) -> str:
        """vLLM's 404 message, which lists the base model's names only."""
        return f"The model `{model}` does not exist. Valid aliases: {', '.join(self.names)}."

    def cards(self, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models``' cards: each base name, then each adapter (``root`` its path,
        ``parent`` its base model, no ``max_model_len``)."""
        created = int(time.time())
        base = [_card(name, created, self.model_path, None, max_model_len) for name in self.names]
        adapters = [
            _card(name, created, adapter.path, self._parents[name], None)
            for name, adapter in self.adapters.items()
        ]
        return base + adapters


def _card(
    name: str, created: int, root: str, parent: str | None, max_model_len: int | None
) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [_model_permission(created)],
    }


def _model_permission(created: int) -> dict[str, Any]:
    """vLLM's (OpenAI's legacy) permission entry: everything but fine-tuning."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
