"""The models a router serves, and which one a request's ``model`` names.

Each served model is a base model with its own engines (an engine serves one base model,
and maybe LoRA adapters of it), block size, tokenizer and routing settings. A request names
the base model, one of its adapters (configured, or listed by an engine's ``/v1/models``
with the base as its ``parent``), or nothing (the default model, as vLLM serves a request
without ``model``). An adapter's prompts are looked up in the adapter's own index context
(the conductor's ``lora_name``): vLLM hashes the adapter into every block, so a base
model's prefix is never an adapter's, nor one adapter's another's; and only engines that
serve the adapter are candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import LimitsSection, ModelSection, UpstreamSection
from .decision import Decider
from .errors import ApiError
from .index_client import IndexContext
from .metrics import RouterMetrics
from .pool import CostLearner, InstancePool
from .prompt_ids import PromptTokenizer
from .rotation import Rotation
from .sessions import UpstreamSessions


def _any_name(name: str) -> bool:
    return True


class ServedModel:
    """One base model: its settings, tokenizer, cost model and decisions."""

    def __init__(
        self,
        section: ModelSection,
        limits: LimitsSection,
        timeouts: UpstreamSection,
        metrics: RouterMetrics,
        pool: InstancePool,
        sessions: UpstreamSessions,
        rotation: Rotation,
    ) -> None:
        self.section = section
        self.name = section.modelname
        self.params = section.routing_params()
        # its prompts count where they were sent while in flight (routing.in_flight_prefixes)
        self.in_flight_prefixes = section.routing.in_flight_prefixes
        self.learner = CostLearner(self.params.cost) if section.routing.learn_cost_model else None
        self.decider = Decider(self.params, self.learner, pool, metrics, base=self.name)
        # raises TokenizerUnavailable (a ValueError) for a directory it cannot read
        self.tokenizer = PromptTokenizer(
            section, limits, timeouts, metrics, pool, sessions, rotation
        )
        self._contexts: dict[str, IndexContext] = {}

    def context(self, lora_name: str) -> IndexContext:
        """The index context of the model's prompts for adapter ``lora_name``."""
        context = self._contexts.get(lora_name)
        if context is None:
            section = self.section
            context = self._contexts[lora_name] = IndexContext(
                section.tenant_id or "default", self.name, lora_name, section.block_size
            )
        return context


@dataclass(frozen=True, slots=True)
class Target:
    """What a request asks for: a served model, the name it gave (the model's, an
    adapter's or an alias the engines list) and the adapter that name means ("": none)."""

    served: ServedModel
    name: str
    lora_name: str

    @property
    def context(self) -> IndexContext:
        return self.served.context(self.lora_name)


class Catalog:
    """The served models by name, and the adapters they serve."""

    def __init__(self, models: list[ServedModel], pool: InstancePool) -> None:
        self.models = {model.name: model for model in models}
        self.default = next((m for m in models if m.section.default), models[0])
        self._adapters = {name: model for model in models for name in model.section.adapters}
        self._pool = pool

    def resolve(self, requested: Any, may_use: Callable[[str], bool] = _any_name) -> Target:
        """The model and adapter a request's ``model`` names, among those ``may_use`` allows
        (a key's models); vLLM's 404 for a name no engine serves, as soon as every engine
        that could serve it has said what it serves (an unknown list never rejects)."""
        target = self._find(requested, may_use)
        if (
            target is None
            or not may_use(target.name)
            or self._pool.serves_nowhere(target.name, target.served.name)
        ):
            names = ", ".join(
                name
                for name in self.models
                if may_use(name) and not self._pool.serves_nowhere(name, name)
            )
            message = f"The model `{requested}` does not exist. Valid aliases: {names}."
            raise ApiError(404, message, "NotFoundError", "model")
        return target

    def _find(self, requested: Any, may_use: Callable[[str], bool]) -> Target | None:
        if requested is None:  # the default model, or the first the key may use
            served = (
                self.default
                if may_use(self.default.name)
                else next((m for m in self.models.values() if may_use(m.name)), None)
            )
            return None if served is None else Target(served, served.name, served.section.lora_name)
        if (model := self.models.get(requested)) is not None:
            return Target(model, requested, model.section.lora_name)
        if (adapted := self._adapters.get(requested)) is not None:
            return Target(adapted, requested, requested)
        listed = self._pool.base_of(requested)
        if listed is not None and (base := self.models.get(listed[0])) is not None:
            adapter = listed[1]
            return Target(base, requested, requested if adapter else base.section.lora_name)
        if len(self.models) == 1:  # a name its engines may list once they answer
            return Target(self.default, requested, self.default.section.lora_name)
        return None

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: every model and adapter an engine in rotation lists; the
        configured ones whose engines have not said yet."""
        cards = self._pool.served_models()
        listed = {card["id"] for card in cards}
        for model in self.models.values():
            if model.name not in listed and self._pool.lists_unknown(model.name):
                cards.append(_card(model.name, None))
            for adapter in model.section.adapters:
                if adapter not in listed and self._pool.lists_unknown(model.name):
                    cards.append(_card(adapter, model.name))
        return cards


def _card(name: str, parent: str | None) -> dict[str, Any]:
    """A model card as vLLM writes one, for a model no engine has described yet."""
    return {"id": name, "object": "model", "owned_by": "conductor-router", "parent": parent}
