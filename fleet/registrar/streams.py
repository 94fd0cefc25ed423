"""What an engine serves, as ``/register`` bodies: pure functions of the registrar's settings
and the engine's answers (``/v1/models``, ``/metrics``, ``/kv_event_sources``), no I/O.

An engine publishes one event stream per data-parallel rank. vLLM derives rank ``r``'s
endpoints from the ``--kv-events-config`` ones (``offset_endpoint``: a tcp port plus ``r``,
an ``inproc`` name plus ``_dp{r}``) and binds a wildcard endpoint on every interface;
conductors in other pods reach it at the pod's address (``advertised``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, ValidationError

from conductor.config import Registration, one_line

WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")
CACHE_CONFIG_INFO = "vllm:cache_config_info"


class StreamError(ValueError):
    """The engine's streams cannot be described: what is missing or wrong, in words."""


class KVEventsConfig(BaseModel):
    """The keys of vLLM's (and SGLang's) ``--kv-events-config`` JSON the registrar reads;
    the others (``buffer_steps``, ``hwm``, SGLang's ``bind`` ...) are the engine's business."""

    model_config = ConfigDict(extra="ignore")

    enable_kv_cache_events: bool | None = None  # vLLM's; SGLang has none
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"  # vLLM's default
    replay_endpoint: str | None = None

    @property
    def enabled(self) -> bool:
        if self.publisher == "null":
            return False
        return self.enable_kv_cache_events is not False or self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    try:
        config = KVEventsConfig.model_validate_json(text)
    except ValidationError as error:
        raise StreamError(f"not a KV-events config: {one_line(error)}") from None
    if not config.enabled:
        raise StreamError("it turns KV events off: the engine publishes no stream to register")
    return config


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's ``ZmqEventPublisher.offset_endpoint_port``: rank ``r`` publishes on the tcp
    port plus ``r`` (port 0 stays ephemeral), on an ``inproc`` name plus ``_dp{r}``; vLLM
    refuses anything else past rank 0."""
    if rank == 0 or not endpoint:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise StreamError(f"{endpoint!r} has no port to offset by DP rank {rank}")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise StreamError(f"vLLM cannot offset {endpoint!r} by DP rank {rank}: only tcp and inproc")


def is_wildcard(endpoint: str) -> bool:
    """A tcp endpoint bound on every interface (``*``, ``0.0.0.0``, ``[::]``)."""
    scheme, _, address = endpoint.partition("://")
    return scheme == "tcp" and address.rpartition(":")[0].strip("[]") in WILDCARD_HOSTS


def advertised(endpoint: str, host: str) -> str:
    """A bound endpoint as another pod connects to it: a wildcard host becomes ``host``
    (the pod's IP); a named host, ``ipc://`` and ``inproc://`` stay as they are."""
    if not is_wildcard(endpoint):
        return endpoint
    port = endpoint.rpartition(":")[2]
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(frozen=True)
class StreamEndpoints:
    """One DP rank's event stream as the engine binds it."""

    rank: int
    endpoint: str
    replay_endpoint: str


def ranks_from_config(
    config: KVEventsConfig, ranks: Iterable[int], replay_override: str | None = None
) -> list[StreamEndpoints]:
    """Each rank's endpoints from the one ``--kv-events-config`` every rank was given."""
    replay = replay_override if replay_override is not None else config.replay_endpoint or ""
    return [
        StreamEndpoints(rank, offset_endpoint(config.endpoint, rank), offset_endpoint(replay, rank))
        for rank in ranks
    ]


def ranks_from_sources(answer: Any) -> list[StreamEndpoints]:
    """``GET /kv_event_sources`` (vLLM 0.32 on, the simulator): ``{rank: KVEventsConfig}``,
    each rank's endpoints already offset."""
    if not isinstance(answer, Mapping):
        raise StreamError(f"/kv_event_sources answered {type(answer).__name__}, not an object")
    streams = []
    for rank, entry in answer.items():
        try:
            config = KVEventsConfig.model_validate(entry)
            number = int(rank)
        except (ValidationError, ValueError) as error:
            raise StreamError(f"/kv_event_sources rank {rank!r}: {one_line(error)}") from None
        if config.enabled:
            streams.append(StreamEndpoints(number, config.endpoint, config.replay_endpoint or ""))
    return sorted(streams, key=lambda stream: stream.rank)


def served_model(answer: Any) -> str:
    """The base model's name in ``GET /v1/models`` (adapters name a ``parent``)."""
    data = answer.get("data") if isinstance(answer, Mapping) else None
    if not isinstance(data, list):
        raise StreamError("/v1/models answered no 'data' list")
    for entry in data:
        if isinstance(entry, Mapping) and isinstance(entry.get("id"), str):
            if not entry.get("parent"):
                return str(entry["id"])
    raise StreamError("/v1/models lists no base model")


def cache_config_labels(metrics_text: str) -> list[dict[str, str]]:
    """The label sets of ``vllm:cache_config_info`` on ``/metrics``: one per engine (DP
    rank, label ``engine``)."""
    labels = []
    for family in text_string_to_metric_families(metrics_text):
        if family.name == CACHE_CONFIG_INFO:
            labels += [dict(sample.labels) for sample in family.samples]
    return labels


def block_size_from_metrics(metrics_text: str) -> int | None:
    """``block_size`` of ``vllm:cache_config_info`` (None when absent); every rank must
    agree."""
    sizes = {labels.get("block_size", "None") for labels in cache_config_labels(metrics_text)}
    sizes.discard("None")
    if not sizes:
        return None
    if len(sizes) > 1:
        raise StreamError(f"the engine's ranks report different block sizes: {sorted(sizes)}")
    [size] = sizes
    if not size.isdigit() or int(size) < 1:
        raise StreamError(f"{CACHE_CONFIG_INFO} reports block_size={size!r}")
    return int(size)


def ranks_from_metrics(metrics_text: str) -> list[int]:
    """The DP ranks ``vllm:cache_config_info`` reports (its ``engine`` label); empty when
    it names none."""
    engines = {labels.get("engine", "") for labels in cache_config_labels(metrics_text)}
    return sorted(int(engine) for engine in engines if engine.isdigit())


@dataclass(frozen=True)
class EngineFacts:
    """What the registrar learnt about the engine (from flags or its answers)."""

    model: str
    block_size: int
    streams: list[StreamEndpoints]


def registration_bodies(
    facts: EngineFacts,
    *,
    instance_id: str,
    tenant_id: str,
    engine_type: str,
    advertise_host: str,
    kv_store: str = "",
) -> list[dict[str, Any]]:
    """One ``/register`` body per stream, validated as the conductor will (a bad endpoint
    is refused here, with the field named, not by every conductor)."""
    bodies = []
    for stream in facts.streams:
        body: dict[str, Any] = {
            "endpoint": advertised(stream.endpoint, advertise_host),
            "replay_endpoint": (
                advertised(stream.replay_endpoint, advertise_host) if stream.replay_endpoint else ""
            ),
            "type": engine_type,
            "modelname": facts.model,
            "tenant_id": tenant_id,
            "instance_id": instance_id,
            "block_size": facts.block_size,
            "dp_rank": stream.rank,
        }
        if kv_store:
            body["kv_store"] = kv_store
        try:
            Registration.model_validate(body)
        except ValidationError as error:
            raise StreamError(f"DP rank {stream.rank}: {one_line(error)}") from None
        bodies.append(body)
    return bodies


def describe_body(body: Mapping[str, Any]) -> str:
    """A registration as a log line's fields."""
    fields = ("instance_id", "tenant_id", "dp_rank", "modelname", "block_size", "endpoint")
    text = " ".join(f"{key}={body[key]}" for key in fields)
    replay = body.get("replay_endpoint")
    return f"{text} replay_endpoint={replay}" if replay else text
