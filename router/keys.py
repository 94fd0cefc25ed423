"""Client API keys: who a request comes from, which tenant's cache it may share, how urgent
it is and what it may hold (docs/keys.md).

The keys file (JSON) is read at start and polled every ``reload_interval_seconds``; a good
new file replaces the keys in force at once, a bad one leaves them in force and is logged
once and counted. Key material lives only in the file: in memory the router keeps each
key's SHA-256 digest, and logs, metrics, reprs and error messages name a key by its ``id``.

Without a keys file every request is the anonymous key of the shared ``default`` tenant,
as before keys existed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
from collections import Counter as Tally
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from conductor.config import one_line

from .errors import ApiError

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # the shared tenant of keys that name none, and of anonymous use
DEFAULT_PRIORITY_CLASSES = {"interactive": 0, "standard": 1, "batch": 2}
DEFAULT_PRIORITY_CLASS = "standard"
PRIORITY_HEADER = "X-Conductor-Priority"
KEY_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}$"  # safe in a log line or a label
UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


class KeysFileError(ValueError):
    """A keys file the router cannot use; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """What one key may hold; ``None`` is unlimited. A request over a limit waits, taking a
    place in the key's waiting room (``max_queued``, 0: none, refused at once), for at most
    ``max_queue_seconds`` in all; the bursts are the buckets' sizes."""

    max_concurrent: int | None = None
    requests_per_second: float | None = None
    request_burst: float = 1.0
    tokens_per_second: float | None = None
    token_burst: float = 1.0
    max_queued: int = 0
    max_queue_seconds: float = 10.0


class TenantSalt:
    """An isolated tenant's ``cache_salt``: ``HMAC-SHA256(secret, tenant "\\0" client_salt)`` in
    hex. Made once per tenant when a keys file is loaded: the HMAC keyed and fed the tenant,
    and the salt of requests that send none (most), so a request costs at most one copy of
    it. Neither the secret nor a salt shows in the repr."""

    __slots__ = ("_keyed", "_unsalted")

    def __init__(self, secret: bytes, tenant: str) -> None:
        self._keyed = hmac.new(secret, f"{tenant}\0".encode(), hashlib.sha256)
        self._unsalted = self._keyed.hexdigest()

    def of(self, client_salt: str) -> str:
        if not client_salt:
            return self._unsalted
        salted = self._keyed.copy()
        salted.update(client_salt.encode())
        return salted.hexdigest()

    def __repr__(self) -> str:
        return "TenantSalt(...)"


@dataclass(frozen=True, slots=True)
class ClientKey:
    """An authenticated client: its key's ``id`` (never the key), tenant, priority class
    (``priority``: lower is served first), model allow-list (``None``: every model) and
    limits. ``salt``: an isolated tenant's (``None``: a shared tenant)."""

    id: str
    tenant: str = DEFAULT_TENANT
    priority_class: str = DEFAULT_PRIORITY_CLASS
    priority: int = DEFAULT_PRIORITY_CLASSES[DEFAULT_PRIORITY_CLASS]
    models: frozenset[str] | None = None
    limits: KeyLimits = KeyLimits()
    salt: TenantSalt | None = field(default=None, repr=False)

    @property
    def isolated(self) -> bool:
        """Whether its requests share cached prefixes only with its tenant's."""
        return self.salt is not None

    def allows(self, model: str) -> bool:
        """Whether the key may use ``model`` (the request's ``model``: a model or an adapter)."""
        return self.models is None or model in self.models


ANONYMOUS = ClientKey(id="anonymous")


def effective_cache_salt(key: ClientKey, client_salt: str) -> str:
    """The ``cache_salt`` the request goes on with: a shared tenant's client salt as sent, an
    isolated tenant's ``HMAC-SHA256(secret, tenant "\\0" client_salt)`` in hex.

    vLLM's ``cache_salt`` is the root of its prefix-cache block hashes, so requests with
    different salts never share cached blocks; the index's chains start from the same salt,
    so the router's predicted hit for a salted prompt stays exact. Keys of a shared tenant
    share prefixes with every request sending the same salt (none, usually). An isolated
    tenant's salt is made from a secret only the keys file holds, so no client of another
    tenant can send it or guess it, and every router reading the same file derives the same
    one (its hits land on the same cached blocks wherever the request is routed).
    """
    return client_salt if key.salt is None else key.salt.of(client_salt)


def key_digest(key: str) -> str:
    """A key's SHA-256 in hex: what the router keeps and looks a presented key up by."""
    return hashlib.sha256(key.encode()).hexdigest()


# -- the file's layout ---------------------------------------------------------------------
class _Strict(BaseModel):
    """Wrong JSON types and unknown keys are errors naming the key."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class TenantEntry(_Strict):
    # isolated: its keys' requests share cached prefixes only with each other
    isolated: bool = False
    # an isolated tenant's secret; else the file's salt_secret is used
    cache_salt: SecretStr | None = None

    @model_validator(mode="after")
    def _salt_is_for_isolated(self) -> TenantEntry:
        if self.cache_salt is not None and not self.isolated:
            raise ValueError("cache_salt is for isolated tenants (`isolated: true`)")
        if self.cache_salt is not None and not self.cache_salt.get_secret_value():
            raise ValueError("cache_salt cannot be empty")
        return self


class KeyEntry(_Strict):
    id: str = Field(pattern=KEY_ID_PATTERN)
    key: SecretStr | None = None
    sha256: str | None = None
    tenant: str = DEFAULT_TENANT
    priority_class: str = DEFAULT_PRIORITY_CLASS
    models: list[str] | None = Field(default=None, min_length=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    requests_per_second: float | None = Field(default=None, gt=0)
    request_burst: float | None = Field(default=None, ge=1)
    tokens_per_second: float | None = Field(default=None, gt=0)
    token_burst: float | None = Field(default=None, ge=1)
    max_queued: int = Field(default=0, ge=0)
    max_queue_seconds: float = Field(default=10.0, ge=0)

    @field_validator("key")
    @classmethod
    def _usable_key(cls, key: SecretStr | None) -> SecretStr | None:
        value = "" if key is None else key.get_secret_value()
        if key is not None and (not value or value != "".join(value.split())):
            raise ValueError("a key must be non-empty text without spaces")
        return key

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, digest: str | None) -> str | None:
        if digest is None:
            return None
        if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
            raise ValueError("expected 64 hex digits: the SHA-256 of the key")
        return digest.lower()

    @model_validator(mode="after")
    def _one_key_and_paired_bursts(self) -> KeyEntry:
        if (self.key is None) == (self.sha256 is None):
            raise ValueError(f"key {self.id}: give exactly one of `key` and `sha256`")
        for burst, rate in (
            ("request_burst", "requests_per_second"),
            ("token_burst", "tokens_per_second"),
        ):
            if getattr(self, burst) is not None and getattr(self, rate) is None:
                raise ValueError(f"key {self.id}: `{burst}` needs `{rate}`")
        return self

    def digest(self) -> str:
        if self.key is not None:
            return key_digest(self.key.get_secret_value())
        return self.sha256 or ""  # validated: one of the two is given

    def limits(self) -> KeyLimits:
        """Its limits; a burst left out is one second's worth (at least one)."""
        return KeyLimits(
            max_concurrent=self.max_concurrent,
            requests_per_second=self.requests_per_second,
            request_burst=self.request_burst or max(1.0, self.requests_per_second or 1.0),
            tokens_per_second=self.tokens_per_second,
            token_burst=self.token_burst or max(1.0, self.tokens_per_second or 1.0),
            max_queued=self.max_queued,
            max_queue_seconds=self.max_queue_seconds,
        )


class KeysFile(_Strict):
    priority_classes: dict[str, int] = Field(
        default_factory=lambda: dict(DEFAULT_PRIORITY_CLASSES), min_length=1
    )
    salt_secret: SecretStr | None = None
    tenants: dict[str, TenantEntry] = Field(default_factory=dict)
    keys: list[KeyEntry] = Field(min_length=1)

    @field_validator("priority_classes")
    @classmethod
    def _ranks(cls, classes: dict[str, int]) -> dict[str, int]:
        if any(rank < 0 for rank in classes.values()):
            raise ValueError("a priority class is a number >= 0 (lower is served first)")
        return classes

    @model_validator(mode="after")
    def _consistent(self) -> KeysFile:
        for name, tenant in self.tenants.items():
            if tenant.isolated and tenant.cache_salt is None and self.salt_secret is None:
                raise ValueError(
                    f"tenants.{name}: an isolated tenant needs its own `cache_salt` or the "
                    "file's `salt_secret`"
                )
        for index, entry in enumerate(self.keys):
            self._check_entry(index, entry)
        self._check_unique()
        return self

    def _check_entry(self, index: int, entry: KeyEntry) -> None:
        if entry.tenant != DEFAULT_TENANT and entry.tenant not in self.tenants:
            raise ValueError(
                f"keys.{index}.tenant: tenant `{entry.tenant}` of key {entry.id} is not in "
                f"`tenants` (declare it, or use the shared `{DEFAULT_TENANT}`)"
            )
        if entry.priority_class not in self.priority_classes:
            known = ", ".join(self.priority_classes)
            raise ValueError(
                f"keys.{index}.priority_class: `{entry.priority_class}` of key {entry.id} is "
                f"not one of {known}"
            )

    def _check_unique(self) -> None:
        ids = Tally(entry.id for entry in self.keys)
        repeated = sorted(key_id for key_id, count in ids.items() if count > 1)
        if repeated:
            raise ValueError(f"keys: ids used twice: {', '.join(repeated)}")
        by_digest: dict[str, str] = {}
        for entry in self.keys:
            first = by_digest.setdefault(entry.digest(), entry.id)
            if first != entry.id:
                raise ValueError(f"keys: {first} and {entry.id} are the same key")

    def client_keys(self) -> dict[str, ClientKey]:
        """digest → the key it authenticates; an isolated tenant's salt is made once."""
        salts = {
            name: TenantSalt(self._secret(tenant), name)
            for name, tenant in self.tenants.items()
            if tenant.isolated
        }
        return {entry.digest(): self._client_key(entry, salts) for entry in self.keys}

    def _secret(self, tenant: TenantEntry) -> bytes:
        secret = tenant.cache_salt or self.salt_secret
        assert secret is not None  # validated: an isolated tenant has one
        return secret.get_secret_value().encode()

    def _client_key(self, entry: KeyEntry, salts: dict[str, TenantSalt]) -> ClientKey:
        return ClientKey(
            id=entry.id,
            tenant=entry.tenant,
            priority_class=entry.priority_class,
            priority=self.priority_classes[entry.priority_class],
            models=None if entry.models is None else frozenset(entry.models),
            limits=entry.limits(),
            salt=salts.get(entry.tenant),
        )


def _no_repeated_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are unique (``json`` would keep the last one silently)."""
    names = Tally(name for name, _ in pairs)
    repeated = [name for name, count in names.items() if count > 1]
    if repeated:
        raise ValueError(f"the name `{repeated[0]}` appears twice in one object")
    return dict(pairs)


def parse_keys_file(content: bytes) -> KeysFile:
    """The file's content, validated; raises ValueError (ValidationError is one) naming the
    problem, never a key."""
    try:
        data = json.loads(content, object_pairs_hook=_no_repeated_names)
    except RecursionError:  # nested past the interpreter's limit
        raise ValueError("the keys file is nested too deeply to be a keys file") from None
    return KeysFile.model_validate(data)


@dataclass(frozen=True, slots=True)
class _InForce:
    """The keys in force: replaced whole, so a request sees one file or the next."""

    by_digest: dict[str, ClientKey]
    priority_classes: dict[str, int]
    content_digest: str


def _in_force(content: bytes) -> _InForce:
    parsed = parse_keys_file(content)
    return _InForce(
        parsed.client_keys(), dict(parsed.priority_classes), hashlib.sha256(content).hexdigest()
    )


def _problem(error: Exception) -> str:
    """A problem as one line that names no key: validation messages name fields and ids."""
    if isinstance(error, OSError):
        return error.strerror or type(error).__name__
    return one_line(error)


# -- the key ring --------------------------------------------------------------------------
class KeyRing:
    """The keys in force, from ``path`` (``None``: anonymous use, no keys checked).

    Raises ``KeysFileError`` when the file cannot be used at start; afterwards ``watch``
    (run it as a supervised background task) and ``reload`` (for SIGHUP) replace the keys
    only with a good file.
    """

    def __init__(
        self,
        path: Path | None,
        registry: CollectorRegistry,
        reload_interval_seconds: float = 5.0,
    ) -> None:
        self.path = path
        self.reload_interval_seconds = reload_interval_seconds
        self._seen: tuple[int, int, int] | str | None = None  # the file's stat, or its error
        self._rejected_digest = ""
        self._in_force = None if path is None else self._first_load(path)
        self._loaded_gauge = Gauge(
            "router_keys_loaded", "Client API keys in force", registry=registry
        )
        self._reloads = Counter(
            "router_keys_reloads",
            "Keys files read after start, by result: loaded, or rejected (the keys in force "
            "stay; the log says why)",
            ["result"],
            registry=registry,
        )
        self._auth_failures = Counter(
            "router_auth_failures",
            "Requests refused with 401, by reason: missing, malformed or unknown key",
            ["reason"],
            registry=registry,
        )
        if self._in_force is not None:
            log.info("keys file %s loaded: keys=%d", path, len(self))
            self._loaded_gauge.set(len(self))

    def _first_load(self, path: Path) -> _InForce:
        try:
            self._seen = _fingerprint(path)
            return _in_force(path.read_bytes())
        except (OSError, ValueError) as error:
            raise KeysFileError(f"keys file {path}: {_problem(error)}") from None

    @property
    def enabled(self) -> bool:
        """Whether requests need a key (a keys file is in use)."""
        return self._in_force is not None

    def __len__(self) -> int:
        return 0 if self._in_force is None else len(self._in_force.by_digest)

    def authenticate(self, authorization: str | None) -> ClientKey:
        """The key an ``Authorization: Bearer <key>`` header presents; 401 when it is
        missing, malformed or unknown (any key passes without a keys file).

        The presented key is hashed and its digest looked up: no comparison of secrets
        whose timing could tell an attacker how much of a guess was right.
        """
        in_force = self._in_force
        if in_force is None:
            return ANONYMOUS
        token = self._bearer_token(authorization)
        key = in_force.by_digest.get(key_digest(token))
        if key is None:
            self._auth_failures.labels("unknown").inc()
            raise _unauthorized("Incorrect API key provided.")
        return key

    def _bearer_token(self, authorization: str | None) -> str:
        if not authorization or not authorization.strip():
            self._auth_failures.labels("missing").inc()
            raise _unauthorized(
                "Missing API key: send it as the header `Authorization: Bearer <key>`."
            )
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token.split()) != 1:
            self._auth_failures.labels("malformed").inc()
            raise _unauthorized(
                "Malformed Authorization header: expected `Authorization: Bearer <key>`."
            )
        return token

    def priority_of(self, key: ClientKey, requested: str | None) -> int:
        """The request's priority: its key's class, or the lower class that the
        ``X-Conductor-Priority`` header names (a higher one is the key's own: a client
        may yield, never jump ahead); an unknown class is a 400 naming the header."""
        if requested is None or not requested.strip():
            return key.priority
        in_force = self._in_force
        classes = DEFAULT_PRIORITY_CLASSES if in_force is None else in_force.priority_classes
        asked = classes.get(requested.strip())
        if asked is None:
            raise ApiError(
                400,
                f"`{PRIORITY_HEADER}`: unknown priority class `{requested.strip()[:64]}`; "
                f"known: {', '.join(classes)}",
                param=PRIORITY_HEADER,
            )
        return max(key.priority, asked)

    # -- reloading -------------------------------------------------------------------------
    def reload(self) -> bool:
        """Reads the file now (SIGHUP): True when its keys are in force, False when it was
        rejected (the keys in force stay; logged and counted)."""
        if self.path is None:
            return False
        try:
            self._seen = _fingerprint(self.path)
            content = self.path.read_bytes()
        except OSError as error:
            self._seen = str(error)
            return self._reject(_problem(error), "")
        return self._apply(content)

    async def watch(self) -> None:
        """Polls the file every ``reload_interval_seconds``: a changed stat, then a changed
        content, is read again. Runs until cancelled (nothing to watch without a file)."""
        if self.path is None:
            return
        while True:
            await asyncio.sleep(self.reload_interval_seconds)
            self._poll(self.path)

    def _poll(self, path: Path) -> None:
        """Reads the file again if its stat changed, applies it if its content did; a file
        that cannot be read is rejected once, until it changes."""
        try:
            seen = _fingerprint(path)
            if seen == self._seen:
                return
            content = path.read_bytes()
        except OSError as error:
            if str(error) != self._seen:
                self._seen = str(error)
                self._reject(_problem(error), "")
            return
        self._seen = seen
        current = "" if self._in_force is None else self._in_force.content_digest
        if hashlib.sha256(content).hexdigest() not in (current, self._rejected_digest):
            self._apply(content)

    def _apply(self, content: bytes) -> bool:
        try:
            in_force = _in_force(content)
        except ValueError as error:
            return self._reject(_problem(error), hashlib.sha256(content).hexdigest())
        self._in_force, self._rejected_digest = in_force, ""
        self._loaded_gauge.set(len(in_force.by_digest))
        self._reloads.labels("loaded").inc()
        log.info("keys file %s loaded: keys=%d", self.path, len(in_force.by_digest))
        return True

    def _reject(self, problem: str, content_digest: str) -> bool:
        self._rejected_digest = content_digest
        self._reloads.labels("rejected").inc()
        log.error(
            "keys file %s rejected, the %d keys in force stay: %s", self.path, len(self), problem
        )
        return False


def _fingerprint(path: Path) -> tuple[int, int, int]:
    """What tells a rewritten file without reading it: mtime, size, inode."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "AuthenticationError", headers=UNAUTHORIZED)
