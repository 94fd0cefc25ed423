"""Client API keys (router/keys.py): the keys file's rules, authentication, priority
classes, reloading while running, tenants' cache salts, and no key material anywhere but
the file."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.errors import ApiError
from router.keys import (
    ANONYMOUS,
    ClientKey,
    KeyRing,
    KeysFileError,
    effective_cache_salt,
    key_digest,
)
from tests.support.api import eventually

PROD_KEY = "sk-acme-prod-0123456789"
DEV_KEY = "sk-acme-dev-9876543210"
POOL_KEY = "sk-pool-5555555555"
SALT_SECRET = "file-wide-salt-secret"
ACME_SALT = "acme-own-salt-secret"
SECRETS = (PROD_KEY, DEV_KEY, POOL_KEY, SALT_SECRET, ACME_SALT)


def keys_file(**changes: Any) -> dict[str, Any]:
    return {
        "salt_secret": SALT_SECRET,
        "tenants": {
            "acme": {"isolated": True, "cache_salt": ACME_SALT},
            "globex": {"isolated": True},
            "pool": {"isolated": False},
        },
        "keys": [
            {
                "id": "acme-prod",
                "key": PROD_KEY,
                "tenant": "acme",
                "priority_class": "interactive",
                "models": ["m1", "m1-sql"],
                "max_concurrent": 8,
                "requests_per_second": 20,
                "tokens_per_second": 100000,
                "max_queued": 4,
                "max_queue_seconds": 2.5,
            },
            {"id": "acme-dev", "sha256": key_digest(DEV_KEY).upper(), "tenant": "globex"},
            {"id": "pool-1", "key": POOL_KEY, "tenant": "pool", "priority_class": "batch"},
        ],
        **changes,
    }


def write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def ring(tmp_path: Path, registry: CollectorRegistry) -> KeyRing:
    return KeyRing(write(tmp_path / "keys.json", keys_file()), registry)


def bearer(key: str) -> str:
    return f"Bearer {key}"


# -- the file ------------------------------------------------------------------------------
def first_key(**fields: Any) -> dict[str, Any]:
    """The file with its first key's fields changed (``None`` removes one)."""
    data = keys_file()
    entry = {**data["keys"][0], **fields}
    data["keys"][0] = {name: value for name, value in entry.items() if value is not None}
    return data


BAD_FILES: list[tuple[dict[str, Any], str]] = [
    (first_key(max_concurent=8), "keys.0.max_concurent: unknown key"),
    (keys_file(tenant={}), "tenant: unknown key"),
    (first_key(key=None), "keys.0: key acme-prod: give exactly one of `key` and `sha256`"),
    (
        first_key(sha256="ab" * 32),
        "keys.0: key acme-prod: give exactly one of `key` and `sha256`",
    ),
    (first_key(key=None, sha256="xyz"), "keys.0.sha256: expected 64 hex digits"),
    (first_key(key="sk with spaces"), "keys.0.key: a key must be non-empty text without spaces"),
    (
        first_key(tenant="initech"),
        "keys.0.tenant: tenant `initech` of key acme-prod is not in `tenants` (declare it, "
        "or use the shared `default`)",
    ),
    (
        first_key(priority_class="vip"),
        "keys.0.priority_class: `vip` of key acme-prod is not one of interactive, standard, batch",
    ),
    (first_key(id="acme-dev"), "keys: ids used twice: acme-dev"),
    (first_key(key=POOL_KEY), "keys: acme-prod and pool-1 are the same key"),
    (first_key(key=None, sha256=key_digest(POOL_KEY)), "keys: acme-prod and pool-1 are"),
    (
        keys_file(salt_secret=None),
        "tenants.globex: an isolated tenant needs its own `cache_salt` or the file's `salt_secret`",
    ),
    (
        keys_file(tenants={"pool": {"cache_salt": "x"}}),
        "tenants.pool: cache_salt is for isolated tenants",
    ),
    (
        first_key(request_burst=5, requests_per_second=None),
        "keys.0: key acme-prod: `request_burst` needs `requests_per_second`",
    ),
    (first_key(max_concurrent="8"), "keys.0.max_concurrent: Input should be a valid integer"),
    (first_key(max_concurrent=0), "keys.0.max_concurrent: Input should be greater than"),
    (first_key(models=[]), "keys.0.models: List should have at least 1 item"),
    (first_key(id="acme prod"), "keys.0.id: String should match pattern"),
    (keys_file(keys=[]), "keys: List should have at least 1 item"),
    (keys_file(priority_classes={"now": -1}), "priority_classes: a priority class is a number"),
]


@pytest.mark.parametrize(("data", "problem"), BAD_FILES)
def test_a_bad_file_is_refused_at_start_naming_the_problem(
    tmp_path: Path, registry: CollectorRegistry, data: dict[str, Any], problem: str
) -> None:
    path = write(tmp_path / "keys.json", data)
    with pytest.raises(KeysFileError) as refused:
        KeyRing(path, registry)
    assert str(refused.value).startswith(f"keys file {path}: {problem}")
    assert not any(secret in str(refused.value) for secret in SECRETS)


def test_a_file_that_is_no_json_or_missing_is_refused(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    path = tmp_path / "keys.json"
    with pytest.raises(KeysFileError, match="No such file or directory"):
        KeyRing(path, registry)
    path.write_text('{"keys": [], "keys": []}')
    with pytest.raises(KeysFileError, match="the name `keys` appears twice in one object"):
        KeyRing(path, registry)
    path.write_text(f'{{"keys": [{{"id": "a", "key": "{PROD_KEY}"}}')
    with pytest.raises(KeysFileError) as refused:
        KeyRing(path, registry)
    assert "line 1" in str(refused.value) and PROD_KEY not in str(refused.value)
    path.write_text("[" * 100_000 + "]" * 100_000)  # past the interpreter's recursion limit
    with pytest.raises(KeysFileError, match="nested too deeply"):
        KeyRing(path, registry)


# -- authentication ------------------------------------------------------------------------
def test_a_key_in_the_file_authenticates_as_its_entry(ring: KeyRing) -> None:
    prod = ring.authenticate(bearer(PROD_KEY))
    assert (prod.id, prod.tenant, prod.priority_class, prod.priority) == (
        "acme-prod",
        "acme",
        "interactive",
        0,
    )
    assert prod.models == frozenset({"m1", "m1-sql"})
    limits = prod.limits
    assert (limits.max_concurrent, limits.requests_per_second, limits.request_burst) == (8, 20, 20)
    assert (limits.tokens_per_second, limits.token_burst) == (100000, 100000)
    assert (limits.max_queued, limits.max_queue_seconds) == (4, 2.5)
    assert ring.authenticate(f"bearer  {DEV_KEY} ").id == "acme-dev"  # by its sha256
    pool = ring.authenticate(bearer(POOL_KEY))
    assert (pool.tenant, pool.priority, pool.models, pool.limits.max_concurrent) == (
        "pool",
        2,
        None,
        None,
    )
    assert len(ring) == 3 and ring.enabled


@pytest.mark.parametrize(
    ("header", "reason", "message"),
    [
        (None, "missing", "Missing API key: send it as the header `Authorization: Bearer <key>`."),
        ("  ", "missing", "Missing API key: send it as the header `Authorization: Bearer <key>`."),
        (f"Basic {PROD_KEY}", "malformed", "Malformed Authorization header"),
        ("Bearer", "malformed", "Malformed Authorization header"),
        (f"Bearer {PROD_KEY} {DEV_KEY}", "malformed", "Malformed Authorization header"),
        ("Bearer sk-guess", "unknown", "Incorrect API key provided."),
        (f"Bearer {key_digest(PROD_KEY)}", "unknown", "Incorrect API key provided."),
    ],
)
def test_no_usable_key_is_a_401_asking_for_a_bearer_token(
    ring: KeyRing, registry: CollectorRegistry, header: str | None, reason: str, message: str
) -> None:
    with pytest.raises(ApiError) as refused:
        ring.authenticate(header)
    error = refused.value
    assert (error.status, error.kind) == (401, "AuthenticationError")
    assert error.message.startswith(message)
    assert error.headers == {"WWW-Authenticate": "Bearer"}
    response = error.response()
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert registry.get_sample_value("router_auth_failures_total", {"reason": reason}) == 1


def test_without_a_keys_file_everyone_is_the_anonymous_shared_key(
    registry: CollectorRegistry,
) -> None:
    ring = KeyRing(None, registry)
    assert ring.authenticate(None) is ANONYMOUS
    assert ring.authenticate("Bearer anything") is ANONYMOUS
    assert (ANONYMOUS.tenant, ANONYMOUS.isolated, ANONYMOUS.models) == ("default", False, None)
    assert not ring.enabled and not ring.reload()


def test_a_key_allows_the_models_of_its_list_only(ring: KeyRing) -> None:
    prod = ring.authenticate(bearer(PROD_KEY))
    assert prod.allows("m1-sql") and not prod.allows("m2")  # the router's 404: test_gateway


# -- priority ------------------------------------------------------------------------------
def test_the_priority_header_may_lower_the_keys_class_never_raise_it(ring: KeyRing) -> None:
    standard = ring.authenticate(bearer(DEV_KEY))
    assert ring.priority_of(standard, None) == 1
    assert ring.priority_of(standard, "batch") == 2
    assert ring.priority_of(standard, " interactive ") == 1  # no jumping ahead
    batch = ring.authenticate(bearer(POOL_KEY))
    assert ring.priority_of(batch, "interactive") == 2
    with pytest.raises(ApiError) as refused:
        ring.priority_of(standard, "urgent")
    error = refused.value
    assert (error.status, error.param) == (400, "X-Conductor-Priority")
    assert error.message == (
        "`X-Conductor-Priority`: unknown priority class `urgent`; known: interactive, "
        "standard, batch"
    )


def test_the_file_names_its_own_priority_classes(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    data = keys_file(priority_classes={"gold": 0, "silver": 5})
    for entry in data["keys"]:
        entry["priority_class"] = "silver"
    ring = KeyRing(write(tmp_path / "keys.json", data), registry)
    silver = ring.authenticate(bearer(POOL_KEY))
    assert (silver.priority_class, silver.priority) == ("silver", 5)
    with pytest.raises(ApiError, match="known: gold, silver"):
        ring.priority_of(silver, "batch")


# -- reloading -----------------------------------------------------------------------------
@pytest.fixture
async def watched(tmp_path: Path, registry: CollectorRegistry) -> AsyncIterator[KeyRing]:
    """A key ring polling its file every 20 ms."""
    ring = KeyRing(write(tmp_path / "keys.json", keys_file()), registry, 0.02)
    task = asyncio.create_task(ring.watch())
    yield ring
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def reloads(registry: CollectorRegistry, result: str) -> Callable[[], Awaitable[float | None]]:
    async def probe() -> float | None:
        return registry.get_sample_value("router_keys_reloads_total", {"result": result})

    return probe


def authenticates(ring: KeyRing, key: str) -> Callable[[], Awaitable[str | None]]:
    async def probe() -> str | None:
        try:
            return ring.authenticate(bearer(key)).id
        except ApiError:
            return None

    return probe


async def test_a_changed_file_is_used_without_restart(
    watched: KeyRing, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "router.keys")
    data = keys_file()
    data["keys"][2]["id"] = "pool-renamed"
    del data["keys"][0]
    assert watched.path is not None
    write(watched.path, data)
    await eventually(authenticates(watched, POOL_KEY), lambda got: got == "pool-renamed", 2.0)
    assert await authenticates(watched, PROD_KEY)() is None
    assert registry.get_sample_value("router_keys_reloads_total", {"result": "loaded"}) == 1
    assert registry.get_sample_value("router_keys_loaded") == 2
    assert f"keys file {watched.path} loaded: keys=2" in caplog.messages


async def test_a_bad_new_file_keeps_the_keys_in_force_and_says_why_once(
    watched: KeyRing, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    assert watched.path is not None
    rejected = reloads(registry, "rejected")
    write(watched.path, first_key(tenant="initech"))
    await eventually(rejected, lambda count: count == 1, 2.0)
    await asyncio.sleep(0.1)  # five more polls of the same bad file: no more lines
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"keys file {watched.path} rejected, the 3 keys in force stay: keys.0.tenant: tenant "
        "`initech` of key acme-prod is not in `tenants` (declare it, or use the shared "
        "`default`)"
    ]
    assert await rejected() == 1
    assert watched.authenticate(bearer(PROD_KEY)).id == "acme-prod"
    watched.path.unlink()  # a file gone is one more rejection, the keys stay
    await eventually(rejected, lambda count: count == 2, 2.0)
    assert watched.authenticate(bearer(PROD_KEY)).id == "acme-prod"
    write(watched.path, keys_file(salt_secret="a-new-secret"))  # fixed: in force
    await eventually(reloads(registry, "loaded"), lambda count: count == 1, 2.0)
    assert watched.authenticate(bearer(PROD_KEY)).id == "acme-prod"


def test_reload_reads_the_file_at_once(ring: KeyRing, registry: CollectorRegistry) -> None:
    assert ring.path is not None
    write(ring.path, keys_file(keys=[{"id": "only", "key": DEV_KEY}]))
    assert ring.reload()
    assert ring.authenticate(bearer(DEV_KEY)).id == "only"
    write(ring.path, keys_file(keys=[]))
    assert not ring.reload()
    assert ring.authenticate(bearer(DEV_KEY)).id == "only"
    assert registry.get_sample_value("router_keys_loaded") == 1


# -- tenants' cache salts ------------------------------------------------------------------
def test_an_isolated_tenants_salt_is_an_hmac_of_its_secret(ring: KeyRing) -> None:
    prod = ring.authenticate(bearer(PROD_KEY))
    expected = hmac.new(ACME_SALT.encode(), b"acme\0chat-1", hashlib.sha256).hexdigest()
    assert effective_cache_salt(prod, "chat-1") == expected
    globex = ring.authenticate(bearer(DEV_KEY))  # no salt of its own: the file's secret
    expected = hmac.new(SALT_SECRET.encode(), b"globex\0", hashlib.sha256).hexdigest()
    assert effective_cache_salt(globex, "") == expected


def test_isolated_tenants_never_share_a_salt_and_shared_ones_pass_theirs(
    ring: KeyRing,
) -> None:
    prod, globex, pool = (ring.authenticate(bearer(k)) for k in (PROD_KEY, DEV_KEY, POOL_KEY))
    for client_salt in ("", "chat-1"):
        salts = {effective_cache_salt(k, client_salt) for k in (prod, globex, pool)}
        assert len(salts) == 3
    assert effective_cache_salt(pool, "chat-1") == "chat-1"
    assert effective_cache_salt(pool, "") == ""
    assert effective_cache_salt(ANONYMOUS, "x") == "x"
    # a shared tenant's client cannot send the isolated salt it does not know: it differs
    # from every salt derived from one it sent
    assert effective_cache_salt(prod, "chat-1") != effective_cache_salt(prod, "chat-2")


def test_two_routers_with_one_file_derive_the_same_salts(ring: KeyRing) -> None:
    other = KeyRing(ring.path, CollectorRegistry())
    for key in (PROD_KEY, DEV_KEY, POOL_KEY):
        ours, theirs = ring.authenticate(bearer(key)), other.authenticate(bearer(key))
        assert effective_cache_salt(ours, "s") == effective_cache_salt(theirs, "s")


# -- no key material -----------------------------------------------------------------------
async def test_no_key_material_in_reprs_logs_errors_or_metrics(
    tmp_path: Path, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    path = write(tmp_path / "keys.json", keys_file())
    ring = KeyRing(path, registry)
    shown: list[str] = []
    for key in (PROD_KEY, DEV_KEY, POOL_KEY):
        client: ClientKey = ring.authenticate(bearer(key))
        shown += [repr(client), str(client)]
    for header in (None, f"Basic {PROD_KEY}", f"Bearer {PROD_KEY}x"):
        with pytest.raises(ApiError) as refused:
            ring.authenticate(header)
        shown += [str(refused.value), repr(refused.value)]
    path.write_text(json.dumps(keys_file())[:-20])  # cut inside a key entry
    assert not ring.reload()
    write(path, first_key(max_concurrent=-1))
    assert not ring.reload()
    shown += [caplog.text, generate_latest(registry).decode()]
    assert "acme-prod" in shown[0]
    assert all(secret not in text for text in shown for secret in SECRETS)
