"""Who may change the conductor and where it may connect.

A bearer token guards the mutating routes (or every route but ``/health``); an allowlist
bounds the endpoints ``/register`` may name, so the conductor cannot be pointed at
arbitrary hosts, ports or unix sockets (``/services`` would show which ones answer).
"""

from __future__ import annotations

import hmac
import ipaddress
import posixpath
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from aiohttp import web

from .config import Registration
from .lane_http import ApiRequest

# what changes the index or the answers (/routed: a routed prompt counts as a hit for a
# while; /loads: a replica's load is in the other replicas' answers)
MUTATING_ROUTES = frozenset(
    {"/register", "/unregister", "/instance_down", "/instance_up", "/routed", "/loads"}
)
OPEN_ROUTES = frozenset({"/health"})
LOOPBACK = ("127.0.0.0/8", "::1/128", "localhost")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Unauthorized(Exception):
    """No or a wrong bearer token on a route that needs one."""


class EndpointRefused(Exception):
    """A registration names an endpoint outside the allowlist."""

    def __init__(self, field_name: str, endpoint: str, how: str) -> None:
        super().__init__(
            f"{field_name} {endpoint} is not allowed: add {how} to register_allow "
            f'(--register-allow, or "*" to allow every endpoint)'
        )
        self.field = field_name


@dataclass(frozen=True)
class BearerAuth:
    """``Authorization: Bearer <token>`` on mutating routes, or on all but ``/health``."""

    token: str
    all_routes: bool = False

    def required(self, path: str) -> bool:
        if not self.token or path in OPEN_ROUTES:
            return False
        return self.all_routes or path in MUTATING_ROUTES

    def check(self, request: ApiRequest) -> None:
        if not self.accepts(request.path, request.headers.get("Authorization")):
            raise Unauthorized

    def accepts(self, path: str, authorization: str | None) -> bool:
        """Whether a request to ``path`` with this ``Authorization`` header may pass."""
        if not self.required(path):
            return True
        scheme, _, given = (authorization or "").partition(" ")
        expected = self.token.encode()
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)


@dataclass
class EndpointAllowlist:
    """Entries: ``*``, CIDRs or IPs, host names (exact, case-insensitive, never resolved:
    a name's address can change between this check and ZMQ's connect), ``ipc://`` paths
    (a trailing ``/`` allows a directory) and ``inproc://`` names (exact)."""

    allow_all: bool = False
    networks: list[IpNetwork] = field(default_factory=list)
    hosts: set[str] = field(default_factory=set)
    paths: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> EndpointAllowlist:
        allowlist = cls()
        for raw in entries:
            entry = raw.strip()
            if entry == "*":
                allowlist.allow_all = True
            elif entry.startswith(("ipc://", "inproc://")):
                allowlist.paths.add(_normal_path(entry))
            else:
                try:
                    allowlist.networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                except ValueError:
                    allowlist.hosts.add(entry.lower())
        return allowlist

    @classmethod
    def default(cls, registrations: Iterable[Registration]) -> EndpointAllowlist:
        """Loopback plus every host (or path) the config file's own registrations name."""
        entries = list(LOOPBACK)
        for registration in registrations:
            for endpoint in (registration.endpoint, registration.replay_endpoint):
                if endpoint:
                    entries.append(_target(endpoint))
            if registration.kv_store:
                entries.append(registration.kv_store.rpartition(":")[0])
        return cls.parse(entries)

    def check(self, registration: Registration) -> None:
        """Raise ``EndpointRefused`` naming the first endpoint that is not allowed."""
        if self.allow_all:
            return
        for name in ("endpoint", "replay_endpoint"):
            endpoint = getattr(registration, name)
            if endpoint and not self._allows(_target(endpoint)):
                raise EndpointRefused(name, endpoint, _how(_target(endpoint)))
        if registration.kv_store:
            host = registration.kv_store.rpartition(":")[0]
            if not self._allows(host):
                raise EndpointRefused("kv_store", registration.kv_store, _how(host))

    def _allows(self, target: str) -> bool:
        if target.startswith(("ipc://", "inproc://")):
            return target in self.paths or any(
                entry.endswith("/") and target.startswith(entry) for entry in self.paths
            )
        try:
            address = ipaddress.ip_address(target.strip("[]"))
        except ValueError:
            return target.lower() in self.hosts
        return any(address in network for network in self.networks)


def _target(endpoint: str) -> str:
    """What an endpoint connects to: a tcp host (the destination of ``src;dst``), or the
    normalised ipc path / inproc name with its scheme."""
    if endpoint.startswith("tcp://"):
        destination = endpoint.removeprefix("tcp://").rpartition(";")[2]
        return destination.rpartition(":")[0]
    return _normal_path(endpoint)


def _normal_path(endpoint: str) -> str:
    """``ipc:///a/../b`` is ``ipc:///b``: a path cannot climb out of an allowed directory."""
    scheme, _, path = endpoint.partition("://")
    if scheme != "ipc" or not path:
        return endpoint
    normal = posixpath.normpath(path) + ("/" if path.endswith("/") else "")
    return f"{scheme}://{normal}"


def _how(target: str) -> str:
    if target.startswith(("ipc://", "inproc://")):
        return f"{target} (or its directory, ending in /)"
    return f"{target} (or a CIDR holding it)"
