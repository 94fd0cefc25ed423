"""Validated external inputs: the config file, env vars and every HTTP request body.

Field names and defaults follow the Go conductor so existing
``conductor_config.json`` files and clients keep working; where Go silently accepts
nonsense (a zero block size, an unknown type, a random port) we reject or fix it.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import os
import struct
from argparse import ArgumentTypeError
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError
from yarl import URL

from ._native import json_int32_field
from .hash_profile import HashProfile
from .hashing import pack_int32
from .index import ContextKey, StreamSource
from .runtime import log_level
from .stream_limits import StreamLimits
from .wire.events import MASK64

DEFAULT_PORT = 13333
DEFAULT_CONFIG_PATH = "~/.mooncake/conductor_config.json"
DEFAULT_STORE_CHECK_INTERVAL_S = 2.0
DEFAULT_STORE_CHECK_SILENCE_S = 10.0
DEFAULT_STORE_ADMIN_PORT = 9003  # mooncake_master's -metrics_port default
MIN_STORE_CHECK_INTERVAL_S = 0.05  # a check fetches every key of the store: not a busy loop

EngineHash = Annotated[int, Field(ge=-(2**63), le=MASK64)]
INT64_MAX = 2**63 - 1  # Go's ``int``: a bigger number breaks Go and msgpack clients later
GoInt = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]
PositiveGoInt = Annotated[int, Field(gt=0, le=INT64_MAX)]
RankGoInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def master_address(value: str) -> str:
    """A Mooncake store master's RPC address ``host:port``: how registrations name a store."""
    host, _, port = value.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError("must be the store master's address host:port (port 1..65535)")
    return value


def _check_tcp_destination(endpoint: str) -> None:
    """``tcp://host:port`` (or ``tcp://source;host:port``) names a host to connect to and a
    port 1..65535 by its value: ``:00`` is port 0, which ZMQ cannot connect to; brackets
    hold an IPv6 address only (``[127.0.0.1]`` is no address)."""
    if "*" in endpoint:
        raise ValueError("must name a host and port to connect to, not a bind address")
    host, colon, port = endpoint.removeprefix("tcp://").rpartition(";")[2].rpartition(":")
    if not host or not colon:
        raise ValueError("must be tcp://host:port")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(f'port must be a number 1..65535, got "{port}"')
    if not (host.startswith("[") or host.endswith("]")):
        return
    if not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"an IPv6 address goes in brackets on both sides, got {host}")
    try:
        ipaddress.IPv6Address(host[1:-1])
    except ValueError:
        raise ValueError(
            f"brackets hold an IPv6 address only, got {host}: write an IPv4 address or a "
            "host name without them"
        ) from None


def admin_url(value: str) -> str:
    """The base URL of a master's admin HTTP server (``-metrics_port``), without a slash."""
    url = URL(value)
    if url.scheme not in ("http", "https") or not url.host or url.query_string or url.fragment:
        raise ValueError("must be the http(s)://host:port URL of the master's admin server")
    return value.rstrip("/")


def _peer_urls(value: Any) -> Any:
    """A flag or env var lists peers comma-separated; the config file may give a list."""
    if isinstance(value, str):
        return tuple(entry.strip() for entry in value.split(",") if entry.strip())
    return tuple(value) if isinstance(value, list) else value


def _peer_url(value: str) -> str:
    url = URL(value)
    if url.scheme not in ("http", "https") or not url.host or url.query_string or url.fragment:
        raise ValueError(f"a peer is another conductor's http(s)://host:port URL, got {value!r}")
    return value.rstrip("/")


# other conductors' (or embedded-index routers') URLs: a list, or comma-separated
PeerUrls = Annotated[
    tuple[Annotated[str, AfterValidator(_peer_url)], ...], BeforeValidator(_peer_urls)
]


def _log_level(value: str) -> str:
    try:
        return log_level(value)
    except ArgumentTypeError as error:
        raise ValueError(str(error)) from None


class StrictModel(BaseModel):
    """Wrong JSON types are errors (no "16" -> 16); unknown fields are ignored like Go."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


def _default_tenant(value: str) -> str:
    return value or "default"


def _cache_group_zero(value: int | None) -> int | None:
    """The KV-cache group (vLLM's ``group_idx``) of the blocks indexed: absent, null or 0
    only, as upstream's C++ conductor; null and 0 are different registrations there."""
    if value not in (None, 0):
        raise PydanticCustomError("unsupported", "only cache group zero is supported")
    return value


class Registration(StrictModel):
    """One event stream: a ``/register`` body or a ``kvevent_instance`` entry."""

    endpoint: str = Field(min_length=1)
    replay_endpoint: str = ""
    type: Literal["vLLM", "SGLang", "Mooncake"]
    modelname: str = Field(min_length=1)
    lora_name: str = ""
    tenant_id: str = "default"
    instance_id: str = ""
    block_size: PositiveGoInt
    dp_rank: RankGoInt = 0
    additionalsalt: str = ""
    kv_store: str = ""  # our extension: the Mooncake store master (host:port) it saves to
    # upstream C++'s: optional here (Go clients send neither); part of the identity
    cache_group: Annotated[int | None, AfterValidator(_cache_group_zero)] = None
    hash_profile: HashProfile | None = None

    _normalize_tenant = field_validator("tenant_id")(_default_tenant)

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> Any:
        canonical = {"vllm": "vLLM", "sglang": "SGLang", "mooncake": "Mooncake"}
        return canonical.get(value.lower(), value) if isinstance(value, str) else value

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str) -> str:
        if value and not value.startswith(ZMQ_SCHEMES):
            raise ValueError(f"must start with one of {', '.join(ZMQ_SCHEMES)}")
        if value.startswith("tcp://"):
            _check_tcp_destination(value)
        return value

    @field_validator("kv_store")
    @classmethod
    def _store_master(cls, value: str, info: ValidationInfo) -> str:
        """Two engines share a store pool only when they name the same master address; a
        Mooncake registration is a pool itself and saves nowhere."""
        if not value:
            return value
        if info.data.get("type") == "Mooncake":
            raise ValueError("only engines (vLLM, SGLang) save to a store")
        return master_address(value)

    @property
    def key(self) -> str:
        """Go's service key ``instance|tenant|dp_rank`` (endpoint when no instance id)."""
        return f"{self.instance_id or self.endpoint}|{self.tenant_id}|{self.dp_rank}"

    def context_key(self) -> ContextKey:
        """The context its blocks are indexed under (its events may name other LoRAs)."""
        return ContextKey(self.tenant_id, self.modelname, self.lora_name, self.block_size)

    @property
    def first_sequence(self) -> int:
        """vLLM and SGLang count batches from 0, the Mooncake master from 1."""
        return 1 if self.type == "Mooncake" else 0

    def source(self) -> StreamSource:
        return StreamSource(
            key=self.key,
            instance_id=self.instance_id or self.endpoint,
            tenant_id=self.tenant_id,
            model_name=self.modelname,
            lora_name=self.lora_name,
            block_size=self.block_size,
            dp_rank=self.dp_rank,
            salt=self.additionalsalt,
            shared_pool=self.type == "Mooncake",
            kv_store=self.kv_store,
            hash_profile=self.hash_profile,
        )

    def go_view(self) -> dict[str, Any]:
        """The Go ``/services`` entry (Go's exported struct field names)."""
        return {
            "Endpoint": self.endpoint,
            "ReplayEndpoint": self.replay_endpoint,
            "Type": self.type,
            "ModelName": self.modelname,
            "LoraName": self.lora_name,
            "TenantID": self.tenant_id,
            "InstanceID": self.instance_id,
            "BlockSize": self.block_size,
            "DPRank": self.dp_rank,
            "AdditionalSalt": self.additionalsalt,
            "CacheGroup": self.cache_group,
            "HashProfile": self.hash_profile.wire_view() if self.hash_profile else None,
        }


class UnregisterRequest(StrictModel):
    instance_id: str = Field(min_length=1)
    tenant_id: str = "default"
    dp_rank: RankGoInt = 0

    _normalize_tenant = field_validator("tenant_id")(_default_tenant)

    @property
    def key(self) -> str:
        return f"{self.instance_id}|{self.tenant_id}|{self.dp_rank}"


class InstanceUpRequest(StrictModel):
    """``POST /instance_up``: count every stream (DP rank) of the instance again."""

    instance_id: str = Field(min_length=1)
    tenant_id: str = "default"

    _normalize_tenant = field_validator("tenant_id")(_default_tenant)


class InstanceDownRequest(InstanceUpRequest):
    """``POST /instance_down``: the router saw the instance die; stop counting it for
    ``ttl_s`` (it re-sends while the instance stays dead)."""

    reason: str = Field(default="", max_length=500)
    ttl_s: float = Field(default=60.0, gt=0, le=3600)


class QueryBase(StrictModel):
    model: str = Field(min_length=1)
    block_size: PositiveGoInt
    tenant_id: str = "default"
    instance_id: str | None = None
    lora_name: str = ""
    lora_id: GoInt | None = None  # accepted like Go, unused

    _normalize_tenant = field_validator("tenant_id")(_default_tenant)

    @field_validator("instance_id")
    @classmethod
    def _empty_means_all(cls, value: str | None) -> str | None:
        return value or None

    def context_key(self) -> ContextKey:
        return ContextKey(self.tenant_id, self.model, self.lora_name, self.block_size)


def _int32_token_bytes(value: Any) -> bytes:
    """Validate token ids once, keeping them packed as int32 for the hash (hot path). A
    bad element's error carries its ``index`` (the C++ dialect's error names it)."""
    if isinstance(value, bytes):  # msgpack clients of the C++ rewrite send LE int32 bytes
        if len(value) % 4:
            raise ValueError("token bytes must be little-endian int32 (length % 4 == 0)")
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("token_ids_type", "must be an array of int32 token ids")
    try:
        return pack_int32(value)
    except struct.error:
        for index, token in enumerate(value):
            if not isinstance(token, int) or not -(2**31) <= token < 2**31:
                kind = "token_range" if isinstance(token, int) else "token_type"
                raise PydanticCustomError(
                    kind,
                    "element {index} ({token}) is not an int32",
                    {"index": index, "token": f"{token!r:.20}"},
                ) from None
        raise


_json_object = msgspec.json.Decoder().decode


class QueryRequest(QueryBase):
    """``POST /query``: a prompt's tokens, held as packed int32 bytes."""

    token_ids: Annotated[bytes, BeforeValidator(_int32_token_bytes)]
    cache_salt: str | None = None

    @classmethod
    def from_plain_json(cls, body: bytes) -> QueryRequest | None:
        """``model_validate_json`` of a plain body (a flat object, its token array of int32
        unescaped), whose token array is read in place by C (a fraction of the time pydantic
        takes to build Python ints; bench.conductor_bench's JSON /query measures it) and the
        rest by pydantic, with its errors; None for
        anything unusual, which the caller parses the general way."""
        split = json_int32_field(body, "token_ids")
        if split is None:
            return None
        rest, token_ids = split
        try:  # the usual, valid body: its other fields validated as Python values (faster)
            fields = _json_object(rest)
            if isinstance(fields, dict):
                return cls.model_validate({**fields, "token_ids": token_ids})
        except (msgspec.DecodeError, ValidationError):
            pass  # pydantic's JSON validation below says what is wrong, as it always did
        return cls.model_validate_json(rest).model_copy(update={"token_ids": token_ids})


class QueryByHashRequest(QueryBase):
    """``POST /query_by_hash``: a prompt given as the engine's block hashes."""

    seq_hashes: list[EngineHash] = Field(validation_alias=AliasChoices("seq_hashes", "block_hash"))


class ConductorConfig(StrictModel):
    """``conductor_config.json``; the map key is the instance id unless one is given.

    Unknown keys, top-level or per instance, are errors naming the key (a misspelt key
    would silently be a default); the process settings found here are kept raw in
    ``settings`` and validated by ``Settings``.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    kvevent_instance: dict[str, Registration] = Field(default_factory=dict)
    # upstream's later C++ revision's test configs carry this list, but its conductor reads
    # no such key (its config.cpp reads kvevent_instance only): accepted and not read
    services: list[Any] = Field(default_factory=list)
    settings: dict[str, Any] = Field(default_factory=dict)
    # our extension: where each store master's admin server is (default: its host, 9003),
    # and how often every store a registration names is checked for evicted blocks
    kv_store_admin_urls: dict[
        Annotated[str, AfterValidator(master_address)], Annotated[str, AfterValidator(admin_url)]
    ] = Field(default_factory=dict)
    kv_store_check_interval_s: float = Field(
        default=DEFAULT_STORE_CHECK_INTERVAL_S, ge=MIN_STORE_CHECK_INTERVAL_S, le=3600
    )
    # how long a master may stay silent during a check before the store counts as down
    kv_store_check_silence_s: float = Field(default=DEFAULT_STORE_CHECK_SILENCE_S, gt=0, le=60)

    @model_validator(mode="before")
    @classmethod
    def _instance_ids_from_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        settings = {key: data[key] for key in settings_model().model_fields if key in data}
        data = {key: value for key, value in data.items() if key not in settings}
        if "settings" in data:  # the raw holder is no key of the file
            raise ValueError("unknown key 'settings'")
        data["settings"] = settings
        instances = data.get("kvevent_instance")
        if isinstance(instances, dict):
            for name, entry in instances.items():
                unknown = (
                    set(entry) - set(Registration.model_fields) if isinstance(entry, dict) else ()
                )
                if unknown:
                    raise ValueError(f"kvevent_instance.{name}: unknown key {min(unknown)!r}")
            data["kvevent_instance"] = {
                name: {"instance_id": name, **entry}
                if isinstance(entry, dict) and not entry.get("instance_id")
                else entry
                for name, entry in instances.items()
            }
        return data

    @model_validator(mode="after")
    def _one_entry_per_stream(self) -> ConductorConfig:
        """Two entries for one stream (its key or its endpoint) would conflict at start-up,
        after the first had been registered: an error naming both, before anything runs."""
        seen: dict[str, str] = {}
        for name, entry in self.kvevent_instance.items():
            for what, value in (("key", entry.key), ("endpoint", entry.endpoint)):
                other = seen.setdefault(f"{what} {value}", name)
                if other != name:
                    raise ValueError(
                        f"kvevent_instance.{name}: {what} {value} is kvevent_instance.{other}'s"
                    )
        return self

    def registrations(self) -> list[Registration]:
        return list(self.kvevent_instance.values())

    def store_admin_url(self, kv_store: str) -> str:
        """The admin server of the master at ``kv_store``: as listed, else on the master's
        host at the port ``mooncake_master`` serves it on by default."""
        listed = self.kv_store_admin_urls.get(kv_store)
        return listed or f"http://{kv_store.rpartition(':')[0]}:{DEFAULT_STORE_ADMIN_PORT}"


class ConfigError(Exception):
    """The config file exists but cannot be used: the service must not start."""


def load_config(path: str | os.PathLike[str] | None) -> ConductorConfig:
    """Read the config file; a missing file is an empty, ready configuration."""
    file = Path(os.path.expanduser(path or DEFAULT_CONFIG_PATH))
    if not file.exists():
        return ConductorConfig()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        config = ConductorConfig.model_validate(data)
        settings_model().model_validate(config.settings, strict=True)  # no "16" -> 16
        return config
    except (OSError, ValueError) as error:
        raise ConfigError(f"{file}: {one_line(error)}") from None


def one_line(error: Exception) -> str:
    """An error as one readable line; a validation error's every problem, ``field.path:
    message; field.path: message`` (a typo in a required key is two problems, the key
    missing and the misspelt one unknown: naming only the first hides the one that says
    what to fix)."""
    if isinstance(error, ValidationError):
        return "; ".join(_problem(detail) for detail in error.errors())
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _problem(detail: ErrorDetails) -> str:
    where = ".".join(str(part) for part in detail["loc"])
    message = detail["msg"].removeprefix("Value error, ")
    if detail["type"] == "extra_forbidden":
        message = "unknown key"
    return f"{where}: {message}" if where else message


class Settings(StrictModel):
    """Process settings. Each is a config-file key (the field name), an env var and a flag
    (``conductor.__main__.parse_settings``): flag > env > file > default."""

    model_config = ConfigDict(strict=False, extra="forbid", frozen=True)

    host: str = Field(
        default="0.0.0.0", min_length=1, description="address the HTTP server binds (0.0.0.0: all)"
    )
    http_server_port: int = Field(
        default=DEFAULT_PORT, ge=1, le=65535, description="port the HTTP server listens on"
    )
    rpc_server_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="upstream C++ conductor's coro_rpc port: accepted so its config files "
        "start this conductor, not served (HTTP only; 0: off)",
    )
    log_level: Annotated[str, AfterValidator(_log_level)] = Field(
        default="INFO", description="the lowest level logged: DEBUG, INFO, WARNING or ERROR"
    )
    access_log: bool = Field(default=False, description="log one line per HTTP request")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        le=2**30,
        description="largest request body on any route, in bytes (413 beyond)",
    )
    max_query_tokens: int = Field(
        default=131_072, ge=1, le=2**24, description="most token_ids in one /query (413 beyond)"
    )
    max_query_hashes: int = Field(
        default=8_192,
        ge=1,
        le=2**22,
        description="most seq_hashes in one /query_by_hash (413 beyond)",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="seconds a request head may take to arrive; then the connection is closed",
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="seconds a request body may take to arrive (408)"
    )
    keepalive_timeout_s: float = Field(
        default=75.0,
        gt=0,
        le=3600,
        description="seconds an idle keep-alive connection stays open",
    )
    query_lane: bool = Field(
        default=True,
        description="answer /query and /query_by_hash on a lean HTTP/1.1 path, the other "
        "routes through aiohttp (off: aiohttp answers every request)",
    )
    ingest_thread: bool = Field(
        default=False,
        description="apply the C lane's event batches on a thread of their own, beside the "
        "event loop (off: the loop applies them in steps between requests; on a 2-vCPU VM "
        'the steps keep the query tail lower, docs/architecture.md "Cores")',
    )
    query_thread: bool = Field(
        default=False,
        description="also answer plain /query requests on a thread of their own, without the "
        "GIL, on sockets sharing the port (SO_REUSEPORT); the others go to the loop "
        '(docs/architecture.md "Cores")',
    )
    max_connections: int = Field(
        default=512,
        ge=1,
        le=1_000_000,
        description="open HTTP connections at most; a new one beyond is closed at once",
    )
    auth_token: str = Field(
        default="", description="bearer token the mutating routes need (empty: no auth)"
    )
    auth_all: bool = Field(
        default=False, description="the bearer token is needed on every route but /health"
    )
    register_allow: list[str] | None = Field(
        default=None,
        description="endpoints /register may name: CIDRs, IPs, host names, ipc:// paths, "
        '"*" (default: loopback and the config file\'s endpoints)',
    )
    state_file: str | None = Field(
        default=None,
        description="where /register's registrations persist (empty: nowhere; default: "
        "conductor_state.<port>.json beside the config file)",
    )

    snapshot_path: str = Field(
        default="",
        description="where the index's snapshot is written, every snapshot_interval_s and at "
        "shutdown, and read at start (empty: no file; GET /snapshot serves one anyway)",
    )
    snapshot_interval_s: float = Field(
        default=60.0, gt=0, le=86_400, description="seconds between two snapshot writes"
    )
    peers: PeerUrls = Field(
        default=(),
        description="other conductors' URLs, comma-separated: at start the newest snapshot "
        "of the file's and theirs is restored",
    )
    peer_timeout_s: float = Field(
        default=10.0, gt=0, le=600, description="seconds a peer's snapshot may take to arrive"
    )
    replica_wait_s: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="seconds a router replica's /query waits at most for another replica's "
        "decision on its model to be reported (0: never)",
    )

    @field_validator("register_allow")
    @classmethod
    def _nonempty_entries(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(entry.strip() for entry in value):
            raise ValueError("entries must not be empty")
        return value


@functools.cache
def settings_model() -> type[Settings]:
    """``Settings`` plus every field of ``StreamLimits`` (each a key, an env var and a
    flag too; the dataclass checks them when built)."""
    limits: dict[str, Any] = {
        item.name: (
            type(item.default),
            Field(default=item.default, gt=0, description=item.metadata["description"]),
        )
        for item in dataclasses.fields(StreamLimits)
    }
    return create_model("ConductorSettings", __base__=Settings, **limits)
