"""The plain query's answer from C (conductor.plain_query) is the handler's, byte for byte.

Random fleets (one to seventy instances, so owner masks wider than a word too; one DP rank
or several; a Mooncake store's pool; kv_store pools; blocks on the CPU tier; holes left by
removals; prompts routers routed; another replica's loads; blocks keyed by Go prefix
hashes or by a hash profile's chain, vLLM's or SGLang's) are queried with random
prompts, salts, contexts and headers (hits only, a replica and its lease, indexing
progress), in JSON and in msgpack; wherever the plain path answers, its bytes must be
those of the handler's answer to the same request (the real index and API, in-process:
the lane's tests compare both over sockets).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from conductor.api import ApiOptions, ConductorApi, HttpLimits
from conductor.hash_profile import HashProfile
from conductor.index import PrefixCacheTable, StreamSource
from conductor.kv_store_watch import StoreWatch
from conductor.lane_http import LaneRequest, answer_bytes, parse_head
from conductor.loads import LEASE_HEADER, REPLICA_HEADER, LoadReport
from conductor.manager import ServiceManager
from conductor.metrics import ConductorMetrics
from conductor.routed import RoutedRequest
from conductor.security import BearerAuth, EndpointAllowlist
from conductor.stream_limits import StreamLimits
from conductor.wire.events import BlockRemoved, BlockStored, EventBatch, Tier

MODEL = "m"
HITS_ONLY = "X-Conductor-Hits-Only: 1\r\n"
PROFILES = [
    HashProfile.model_validate(profile)
    for profile in (
        {
            "strategy": "vllm_v1",
            "algorithm": "sha256_cbor",
            "python_hash_seed": "0",
            "index_projection": "low64_be",
        },
        {
            "strategy": "vllm_v1",
            "algorithm": "sha256",
            "python_hash_seed": "7",
            "index_projection": "low64_be",
        },
        {"strategy": "sglang", "algorithm": "sha256_raw", "index_projection": "first64_be"},
        {"strategy": "sglang_bigram", "algorithm": "sha256_raw", "index_projection": "first64_be"},
    )
]


@dataclass
class Fleet:
    """A context's random fleet and what its queries may ask for."""

    table: PrefixCacheTable
    api: ConductorApi
    block_size: int
    prompts: list[list[int]]


def make_api(table: PrefixCacheTable, token: str = "") -> ConductorApi:
    metrics = ConductorMetrics(table)
    manager = ServiceManager(
        table, metrics, StoreWatch(table, metrics, str, 2.0), StreamLimits(), ingest_thread=False
    )
    return ConductorApi(
        manager, ApiOptions(HttpLimits(), BearerAuth(token), EndpointAllowlist(allow_all=True))
    )


def source(
    instance: str,
    block_size: int,
    dp_rank: int = 0,
    pool: bool = False,
    kv_store: str = "",
    profile: HashProfile | None = None,
) -> StreamSource:
    return StreamSource(
        key=f"{instance}|default|{dp_rank}",
        instance_id=instance,
        tenant_id="default",
        model_name=MODEL,
        lora_name="",
        block_size=block_size,
        dp_rank=dp_rank,
        shared_pool=pool,
        kv_store=kv_store,
        hash_profile=profile,
    )


def random_fleet(rng: random.Random) -> Fleet:
    block_size = rng.choice((1, 4, 16))
    table = PrefixCacheTable()
    base = [rng.randrange(-(2**31), 2**31) for _ in range(12 * block_size)]
    prompts = [base, base[: 5 * block_size] + [7] * 7 * block_size, list(range(12 * block_size))]
    rank = rng.choice((0, 0, 3))
    several_ranks = rng.random() < 0.2
    pool = rng.random() < 0.15
    cpu_tier = rng.random() < 0.15
    count = rng.choice((1, 2, 8, 40, 70))
    # engines saving their CPU blocks to a Mooncake store: its pool serves them (a mask)
    stores = rng.choice((("",), ("", "store-a:1"), ("store-a:1", "store-b:1")))
    profile = rng.choice((None, None, *PROFILES))
    sources = [
        source(f"engine-{i:02d}", block_size, rank, kv_store=rng.choice(stores), profile=profile)
        for i in range(count)
    ]
    if several_ranks:  # some instances have more DP ranks: one more, or two
        for i in range(count):
            for extra in range(rng.choice((0, 0, 1, 2)) if i else 1):
                sources.append(
                    source(f"engine-{i:02d}", block_size, rank + 1 + extra, profile=profile)
                )
    if pool:
        sources.append(source("pool", block_size, pool=True, profile=profile))
    # each prompt's block keys: the engines' own hashes in a profiled context, else any
    keys = [
        list(profile.block_keys(prompt, block_size))
        if profile
        else [which * 1000 + b + 1 for b in range(12)]
        for which, prompt in enumerate(prompts)
    ]
    for registered in sources:
        table.add_stream(registered)
    for registered in sources:
        events: list[BlockStored | BlockRemoved] = []
        for _ in range(rng.randrange(3)):
            which = rng.randrange(len(prompts))
            hashes = keys[which][: rng.randrange(1, len(keys[which]) + 1)]
            tokens = prompts[which][: len(hashes) * block_size]
            tier = Tier.CPU if cpu_tier and rng.random() < 0.5 else None
            events.append(BlockStored(hashes, None, tokens, block_size, tier))
            if rng.random() < 0.3:  # a hole in the middle of the prefix
                events.append(BlockRemoved([rng.choice(hashes)], tier))
        table.apply(registered.key, EventBatch(0.0, events, registered.dp_rank))
    api = make_api(table)
    for _ in range(rng.choice((0, 0, 3))):  # routers sent prompts the index has not seen
        prompt = rng.choice(prompts)
        routed = {
            "model": MODEL,
            "block_size": block_size,
            "instance_id": f"engine-0{rng.randrange(3)}",
        }
        api.routed.add(
            RoutedRequest.model_validate(
                {**routed, "token_ids": prompt[: rng.randrange(len(prompt))]}
            )
        )
    if rng.random() < 0.5:  # another router replica's loads
        loads = {
            s.instance_id: {"queued_prefill_tokens": rng.randrange(9), "in_flight": 1}
            for s in sources[:5]
        }
        api.loads.report(LoadReport.model_validate({"replica": "replica-b", "instances": loads}))
    return Fleet(table, api, block_size, prompts)


def packed_tokens(tokens: list[int]) -> bytes:
    """Token ids as the router and upstream's C++ proxy send them: int32 LE in a bin."""
    return b"".join(token.to_bytes(4, "little", signed=True) for token in tokens)


def raw_query(payload: dict[str, object], packed: bool, extra: str = "") -> bytes:
    if packed:
        body, kind = msgpack.packb(payload), "application/msgpack"
    else:
        body, kind = json.dumps(payload).encode(), "application/json"
    head = f"POST /query HTTP/1.1\r\nHost: h\r\nContent-Type: {kind}\r\n"
    return f"{head}Content-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def both_ways(api: ConductorApi, raw: bytes) -> tuple[bytes | None, bytes]:
    """The plain path's answer (None: declined) and the handler's, to the same request."""
    end = raw.index(b"\r\n\r\n")
    head = parse_head(raw[:end])
    assert head is not None
    body = raw[end + 4 :]
    plain_head = api.read_plain_head(raw[:end])
    plain = None
    if plain_head is not None:  # no guard here: no transport
        plain = api.answer_plain(plain_head, body, None)  # type: ignore[arg-type]
    request = LaneRequest(
        "POST", head.path, head.headers, head.content_type, head.length, body, head.keep_alive,
        None, "127.0.0.1",
    )  # fmt: skip
    return plain, answer_bytes(await api.answer_lane(request), head.keep_alive)


def answer_of(raw: bytes) -> dict[str, Any]:
    """A msgpack answer's body, decoded."""
    return msgpack.unpackb(raw.partition(b"\r\n\r\n")[2])


def random_query(rng: random.Random, fleet: Fleet) -> tuple[dict[str, object], bool, bool]:
    """A query, whether its token ids are packed (msgpack), whether it asks the fleet's
    own context plainly (else: another context, a salt, an instance, a header)."""
    prompt = rng.choice(fleet.prompts)
    tokens = prompt[: rng.randrange(len(prompt) + 1)]
    packed = rng.random() < 0.5
    payload: dict[str, object] = {"model": MODEL, "block_size": fleet.block_size}
    payload["token_ids"] = packed_tokens(tokens) if packed else tokens
    own = True
    twist = rng.random()
    if twist < 0.05:
        payload["block_size"] = fleet.block_size + 1
        own = False
    elif twist < 0.10:
        payload["cache_salt"] = "salted"  # no block was stored with it: no hit
    elif twist < 0.15:
        payload["instance_id"] = "engine-00"
        own = False
    elif twist < 0.20:
        payload["tenant_id"] = ""  # the default tenant, as the handler reads it
    return payload, packed, own


@pytest.mark.parametrize("seed", range(6))
async def test_plain_answers_are_the_handlers(seed: int) -> None:
    rng = random.Random(seed)
    answered = asked_plainly = 0
    for _ in range(12):
        fleet = random_fleet(rng)
        for _ in range(25):
            payload, packed, own = random_query(rng, fleet)
            extra = HITS_ONLY if rng.random() < 0.5 else ""
            if rng.random() < 0.3:  # from a router replica, with a lease or without
                extra += f"{REPLICA_HEADER}: replica-a\r\n"
                extra += rng.choice(("", f"{LEASE_HEADER}: {rng.randrange(100)}\r\n"))
            if rng.random() < 0.2:
                extra += 'X-Conductor-Progress: ["engine-00","nobody"]\r\n'
            if rng.random() < 0.05:  # not a JSON list: refused by the handler alone
                extra += "X-Conductor-Progress: engine-00\r\n"
                own = False
            plain, handler = await both_ways(fleet.api, raw_query(payload, packed, extra))
            if plain is not None:
                assert plain == handler, payload
                answered += 1
            if own:
                asked_plainly += 1
                assert plain is not None, payload
    print(f"{answered} answered plainly, {asked_plainly} of them had to be")
    assert answered >= asked_plainly > 0


@pytest.mark.parametrize(
    "extra",
    [
        "X-Conductor-Tiers: gpu\r\n",
        "X-Conductor-Tiers: gpu,cpu,disk\r\n",  # the default, but asked: the handler's
        "Accept: application/msgpack\r\n",
        "Authorization: Bearer wrong\r\n",
        f"{LEASE_HEADER}: 12\r\n",  # a lease without a replica: ignored by both
    ],
)
async def test_what_the_plain_path_leaves_to_the_handler(extra: str) -> None:
    table = PrefixCacheTable()
    table.add_stream(source("engine-a", 4))
    api = make_api(table, token="secret")
    api.options.auth = BearerAuth("secret", all_routes=True)
    payload = {"model": MODEL, "block_size": 4, "token_ids": [1, 2, 3, 4]}
    authorized = "Authorization: Bearer secret\r\n"
    asked = extra if "Authorization" in extra else extra + authorized
    plain, handler = await both_ways(api, raw_query(payload, False, asked))
    assert (plain is None) == ("Lease" not in extra)
    assert plain is None or plain == handler
    plain, handler = await both_ways(api, raw_query(payload, False, authorized))
    assert plain == handler  # the same query, asking nothing more, is plain


async def test_a_replica_that_must_wait_goes_the_general_way() -> None:
    table = PrefixCacheTable()
    table.add_stream(source("engine-a", 4))
    api = make_api(table)
    api.loads.max_wait_s = 0.01
    payload = {"model": MODEL, "block_size": 4, "token_ids": [1, 2, 3, 4]}
    other = f"{REPLICA_HEADER}: replica-b\r\n{LEASE_HEADER}: 1\r\n"
    plain, _ = await both_ways(api, raw_query(payload, False, other))
    assert plain is not None  # replica-b holds a lease on the model now
    plain, handler = await both_ways(api, raw_query(payload, False, f"{REPLICA_HEADER}: a\r\n"))
    assert plain is None and b"X-Conductor-Other-Replicas: 0" in handler
    assert api.loads.waits == 1  # the handler waited, the plain path did not


async def test_a_routed_prompt_raises_the_instance_not_its_rank_on_every_tier() -> None:
    table = PrefixCacheTable()
    table.add_stream(source("engine-a", 4))
    table.add_stream(source("engine-b", 4))
    api = make_api(table)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    table.apply("engine-a|default|0", EventBatch(0.0, [BlockStored([1, 2], None, tokens, 4)]))
    payload = {"model": MODEL, "block_size": 4, "token_ids": packed_tokens(tokens)}
    plain, handler = await both_ways(api, raw_query(payload, True))
    assert plain is not None and plain == handler
    assert answer_of(plain)["instances"]["engine-a"]["longest_matched"] == 8

    api.routed.add(RoutedRequest.model_validate({**payload, "instance_id": "engine-b"}))
    plain, handler = await both_ways(api, raw_query(payload, True))
    assert plain is not None and plain == handler
    raised = answer_of(plain)["instances"]["engine-b"]
    assert (raised["longest_matched"], raised["dp"]) == (8, {"0": 0})  # its rank's: not raised
    assert api.metrics.routed_raised._value.get() == 2  # once each way

    cpu = BlockStored([9], None, tokens[:4], 4, Tier.CPU)
    table.apply("engine-b|default|0", EventBatch(0.0, [cpu]))
    plain, handler = await both_ways(api, raw_query(payload, True))
    assert plain is not None and plain == handler
    raised = answer_of(plain)["instances"]["engine-b"]
    assert (raised["cpu"], raised["rank_matches"]["0"]["cpu"]) == (8, 4)


async def test_plain_answers_are_counted() -> None:
    table = PrefixCacheTable()
    table.add_stream(source("engine-a", 4))
    api = make_api(table)
    payload = {"model": MODEL, "block_size": 4, "token_ids": [1, 2, 3, 4]}
    for _ in range(3):
        plain, _ = await both_ways(api, raw_query(payload, False))
        assert plain is not None
    metrics = api.metrics
    assert metrics.plain_queries._value.get() == 3
    assert metrics.http_requests.labels("/query", "200")._value.get() == 6  # both ways


# -- the request's readers in C, against the Python ones ---------------------------------
HEADER_NAMES = [
    "Host", "Content-Type", "content-type", "Content-Length", "Connection", "Accept",
    "Authorization", "X-Conductor-Hits-Only", "x-conductor-replica", "X-Conductor-Replica-Lease",
    "X-Conductor-Progress", "X-Conductor-Tiers", "Transfer-Encoding", "Expect", "X-Other",
    "Bad Name", "",
]  # fmt: skip
HEADER_VALUES = [
    "application/json", "Application/MsgPack ; charset=x", "application/msgpack", "close",
    "Keep-Alive", "keep-alive", "1", " 1 ", "1\t", "0", "12", "007", "-1", "", "Bearer s",
    '["a"]', "caf\u00e9", "a\x01b", "x\ty", "application/msgpack, */*",
]  # fmt: skip


def random_head(rng: random.Random) -> bytes:
    version = rng.choice(("HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0"))
    target = rng.choice(("/query", "/query", "/query_by_hash", "/query?x=1"))
    method = rng.choice(("POST", "POST", "GET"))
    lines = [f"{method} {target} {version}"]
    if rng.random() < 0.9:
        lines.append(f"Content-Length: {rng.randrange(200)}")
    for _ in range(rng.randrange(6)):
        lines.append(f"{rng.choice(HEADER_NAMES)}:{rng.choice(HEADER_VALUES)}")
    rng.shuffle(lines[1:])
    return "\r\n".join(lines).encode("latin-1")


@pytest.mark.parametrize("seed", range(3))
def test_the_c_head_reader_reads_no_head_otherwise_than_parse_head(seed: int) -> None:
    rng = random.Random(seed)
    api = make_api(PrefixCacheTable())
    read = 0
    for _ in range(3000):
        raw = random_head(rng)
        plain = api.read_plain_head(raw)
        if plain is None:
            continue
        head = parse_head(raw)
        assert head is not None, raw
        assert head.path == "/query" and "x-conductor-tiers" not in head.headers, raw
        content_type = plain.media_type or "application/octet-stream"
        assert (plain.length, plain.keep_alive, content_type) == (
            head.length, head.keep_alive, head.content_type
        ), raw  # fmt: skip
        names = ("Accept", "Authorization", "X-Conductor-Hits-Only", "X-Conductor-Replica")
        names += ("X-Conductor-Replica-Lease", "X-Conductor-Progress")
        assert list(plain[3:]) == [head.headers.get(name) for name in names], raw
        read += 1
    assert read > 150  # ~9 % of these heads are plain


FIELD_VALUES: list[object] = [
    "m", "", "default", "t\u00e9", 'q"uote', "a\\b", None, 16, 0, -4, 2**63, 4.0, True,
    [1, 2, 3, 4], [], [2**31], "tok", b"\x01\x00\x00\x00", b"\x01\x00",
]  # fmt: skip
FIELDS = ["model", "block_size", "tenant_id", "lora_name", "cache_salt", "token_ids"]
FIELDS += ["instance_id", "lora_id", "colour"]


def random_body(rng: random.Random, packed: bool) -> bytes:
    payload: dict[str, object] = {"model": "m", "block_size": 4, "token_ids": [1, 2, 3, 4]}
    for _ in range(rng.randrange(4)):
        payload[rng.choice(FIELDS)] = rng.choice(FIELD_VALUES)
    if packed:
        if isinstance(payload.get("token_ids"), list) and rng.random() < 0.8:
            tokens = payload["token_ids"]
            if all(isinstance(t, int) and -(2**31) <= t < 2**31 for t in tokens):  # type: ignore[union-attr]
                payload["token_ids"] = packed_tokens(tokens)  # type: ignore[arg-type]
        return msgpack.packb(payload)
    payload = {k: v for k, v in payload.items() if not isinstance(v, bytes)}
    text = json.dumps(payload, ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.2:
        text = text.replace(": ", ":\n  ")
    return text.encode()


@pytest.mark.parametrize("packed", [False, True], ids=["json", "msgpack"])
def test_the_c_body_reader_reads_no_body_otherwise_than_pydantic(packed: bool) -> None:
    from conductor._native import plain_query_fields
    from conductor.api import _decode_msgpack, _refuse_unknown_fields
    from conductor.config import QueryRequest

    rng = random.Random(7)
    read = 0
    for _ in range(3000):
        body = random_body(rng, packed)
        fields = plain_query_fields(body, packed)
        if fields is None:
            continue
        if packed:
            decoded = _decode_msgpack(body, HttpLimits().item_limits["/query"])
            _refuse_unknown_fields(decoded, QueryRequest)
            query = QueryRequest.model_validate(decoded)
        else:
            query = QueryRequest.model_validate_json(body)
        expected = (query.tenant_id, query.model, query.lora_name, query.block_size)
        expected += (query.cache_salt, query.token_ids)
        assert fields == expected, body
        assert query.instance_id is None, body
        read += 1
    assert read > 300
