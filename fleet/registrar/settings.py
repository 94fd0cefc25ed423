"""The registrar's settings: every one a flag and an environment variable
(``REGISTRAR_`` and the flag's name in capitals, ``-`` as ``_``), since a pod spec sets
env vars more easily than arguments. A flag wins over its env var, the env var over the
default. A bad value stops start-up with exit code 2 and one line naming the flag or the
env var it came from."""

from __future__ import annotations

import argparse
import os
import socket
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from conductor.config import one_line
from conductor.runtime import LOG_LEVELS, add_version_flag, log_level

from .streams import KVEventsConfig, StreamError, parse_kv_events_config

ENV_PREFIX = "REGISTRAR_"
DEFAULT_HEALTH_PORT = 13380


def _http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")) or len(value.split("://", 1)[1]) == 0:
        raise ValueError(f"must be an http(s)://host:port URL, got {value!r}")
    return value.rstrip("/")


HttpUrl = Annotated[str, AfterValidator(_http_url)]


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    conductor: list[HttpUrl] = Field(min_length=1)
    engine_url: HttpUrl = "http://127.0.0.1:8000"
    kv_events_config: KVEventsConfig | None = None
    endpoint: str | None = None
    replay_endpoint: str | None = None
    instance_id: str = Field(default_factory=socket.gethostname, min_length=1)
    tenant_id: str = Field(default="default", min_length=1)
    model_name: str | None = Field(default=None, min_length=1)
    block_size: int | None = Field(default=None, ge=1)
    type: Literal["vLLM", "SGLang"] = "vLLM"
    dp_size: int | None = Field(default=None, ge=1, le=1024)
    dp_start_rank: int = Field(default=0, ge=0)
    advertise_host: str | None = Field(default=None, min_length=1)
    kv_store: str = ""
    auth_token: str = ""
    interval_s: float = Field(default=10.0, gt=0, le=3600)
    engine_timeout_s: float = Field(default=900.0, gt=0)
    request_timeout_s: float = Field(default=5.0, gt=0, le=300)
    unregister_timeout_s: float = Field(default=5.0, gt=0, le=300)
    health_host: str = "127.0.0.1"
    health_port: int = Field(default=DEFAULT_HEALTH_PORT, ge=0, le=65535)
    log_level: str = "INFO"

    @field_validator("conductor", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        """Repeated flags and comma lists alike: ``a,b`` ``c`` is three conductors."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            urls = [part.strip().rstrip("/") for item in value for part in str(item).split(",")]
            return list(dict.fromkeys(url for url in urls if url))
        return value

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return parse_kv_events_config(value)
            except StreamError as error:
                raise ValueError(str(error)) from None
        return value

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> Any:
        canonical = {"vllm": "vLLM", "sglang": "SGLang"}
        return canonical.get(value.lower(), value) if isinstance(value, str) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, value: Any) -> Any:
        try:
            return log_level(value) if isinstance(value, str) else value
        except argparse.ArgumentTypeError as error:
            raise ValueError(str(error)) from None

    @model_validator(mode="after")
    def _replay_with_endpoint(self) -> Settings:
        if self.replay_endpoint is not None and not self.explicit_events:
            raise ValueError("a replay endpoint needs --endpoint or --kv-events-config")
        return self

    @property
    def explicit_events(self) -> bool:
        """The event endpoints come from flags, not from the engine's answers."""
        return self.kv_events_config is not None or self.endpoint is not None


# flag -> (metavar, help); the field is the flag without dashes, '-' as '_'
FLAGS: dict[str, tuple[str, str]] = {
    "--conductor": (
        "URL",
        "a conductor to register with, http://host:port; repeat it or give a comma list (required)",
    ),
    "--engine-url": ("URL", "the engine's HTTP address (default http://127.0.0.1:8000)"),
    "--kv-events-config": (
        "JSON",
        "the engine's own --kv-events-config JSON: its endpoint and replay_endpoint "
        "(default: the engine's GET /kv_event_sources)",
    ),
    "--endpoint": ("ZMQ", "the event PUB endpoint of DP rank 0 (overrides the JSON's)"),
    "--replay-endpoint": ("ZMQ", "the replay endpoint of DP rank 0 (overrides the JSON's)"),
    "--instance-id": ("ID", "the instance id to register (default: the hostname, a pod's name)"),
    "--tenant-id": ("ID", "the tenant to register under (default 'default')"),
    "--model-name": ("NAME", "the model to register (default: the base model of /v1/models)"),
    "--block-size": (
        "N",
        "the engine's block size (default: block_size of vllm:cache_config_info on /metrics)",
    ),
    "--type": ("TYPE", "the event layout: vLLM (default) or SGLang"),
    "--dp-size": (
        "N",
        "DP ranks the engine runs (default: as /kv_event_sources or /metrics lists, else 1)",
    ),
    "--dp-start-rank": ("R", "the first of those ranks (vLLM's --data-parallel-start-rank)"),
    "--advertise-host": (
        "HOST",
        "the address conductors reach the engine's event ports at, replacing a wildcard "
        "(*, 0.0.0.0) in its endpoints: the pod IP (default: the hostname's address)",
    ),
    "--kv-store": ("HOST:PORT", "the Mooncake store master the engine saves blocks to"),
    "--auth-token": ("TOKEN", "the conductors' bearer token (better: its env var)"),
    "--interval-s": ("S", "seconds between two registrations (re-registering is idempotent)"),
    "--engine-timeout-s": ("S", "how long to wait for the engine's /health (default 900)"),
    "--request-timeout-s": ("S", "each HTTP call's timeout (default 5)"),
    "--unregister-timeout-s": ("S", "how long unregistering at SIGTERM may take (default 5)"),
    "--health-host": ("HOST", "the address of the registrar's own /health (default 127.0.0.1)"),
    "--health-port": ("PORT", f"its port; 0: no /health (default {DEFAULT_HEALTH_PORT})"),
    "--log-level": ("LEVEL", f"one of {', '.join(LOG_LEVELS)} (default INFO)"),
}


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()


def field_name(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-register",
        description="Registers an engine's KV-event streams with conductors while the "
        "engine runs: waits for its health, learns what it serves, keeps the registration "
        "alive through conductor restarts and withdraws it at SIGTERM (docs/registrar.md). "
        "Every option is also an env var, REGISTRAR_<OPTION>, e.g. REGISTRAR_CONDUCTOR.",
    )
    for flag, (metavar, text) in FLAGS.items():
        action = "append" if flag == "--conductor" else "store"
        parser.add_argument(
            flag, metavar=metavar, action=action, help=f"{text} [env {env_name(flag)}]"
        )
    add_version_flag(parser)
    return parser


def parse_settings(
    argv: list[str] | None = None, environ: dict[str, str] | None = None
) -> Settings:
    """Flags over env vars over defaults; a bad value ends the process with exit code 2 and
    the flag's or env var's name."""
    parser = build_parser()
    args = parser.parse_args(argv)
    environ = dict(os.environ if environ is None else environ)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for flag in FLAGS:
        name = field_name(flag)
        given = getattr(args, name)
        if given is not None:
            values[name], sources[name] = given, flag
        elif environ.get(env_name(flag), "") != "":
            values[name], sources[name] = environ[env_name(flag)], env_name(flag)
    if "conductor" not in values:
        parser.error(f"no conductor: give --conductor URL or {env_name('--conductor')}")
    try:
        return Settings.model_validate(values)
    except ValidationError as error:
        problems = []
        for detail in error.errors():
            name = str(detail["loc"][0]) if detail["loc"] else ""
            message = detail["msg"].removeprefix("Value error, ")
            problems.append(f"{sources.get(name, name)}: {message}")
        parser.error("; ".join(problems))


def summary(settings: Settings) -> str:
    """The settings as a log line, the token hidden."""
    shown = settings.model_dump(exclude={"auth_token", "kv_events_config"})
    shown["auth_token"] = "set" if settings.auth_token else "none"
    if settings.kv_events_config is not None:
        shown["kv_events_config"] = settings.kv_events_config.model_dump(exclude_none=True)
    return " ".join(f"{key}={value}" for key, value in shown.items())


__all__ = ["Settings", "build_parser", "parse_settings", "summary", "one_line"]
