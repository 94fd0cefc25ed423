"""The two dialects of one conductor process, over real HTTP: a msgpack request gets the
shapes, error reasons and statuses of upstream Mooncake's C++ conductor (``mooncake-
conductor/src/kvevent/event_manager.cpp`` on branch ``dev/conductor``, commit 19ffa6e4a,
and its tests ``tests/event_manager_test.cpp``); a JSON request keeps the Go service's.

Each test names what upstream does, in our words; where we deliberately differ (our
extension fields, a 409 for JSON) the test says so."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import msgpack
import pytest
from multidict import CIMultiDictProxy

from conductor.api import (
    HITS_ONLY_HEADER,
    INDEXED_UNTIL_HEADER,
    MSGPACK,
    NO_CONTEXT_HEADER,
    PROGRESS_HEADER,
)
from conductor.dialect import TIERS_HEADER
from conductor.hash_profile import HashProfile, root_digest
from router.conductor_client import registration_bodies
from router.config import ModelSection, PrefillInstance, StreamRegistration
from tests.support.api import eventually, get, post
from tests.support.processes import ConductorProcess
from tests.support.wire_publisher import WirePublisher, stored

PROFILE = {
    "strategy": "vllm_v1",
    "algorithm": "sha256_cbor",
    "python_hash_seed": "0",
    "index_projection": "low64_be",
}
PROMPT = list(range(1, 13))  # three blocks of 4
# PROMPT's blocks as an engine hashing as PROFILE says names them in its events
BLOCK_KEYS = list(HashProfile.model_validate(PROFILE).block_keys(PROMPT, 4))
UPSTREAM_SERVICE_KEYS = {
    "Endpoint",
    "ReplayEndpoint",
    "Type",
    "ModelName",
    "LoraName",
    "TenantID",
    "InstanceID",
    "BlockSize",
    "DPRank",
    "CacheGroup",
    "HashProfile",
}
UPSTREAM_CONTEXT_KEYS = {
    "model_name",
    "lora_name",
    "block_size",
    "tenant_id",
    "prefix_count",
    "hash_profile",
    "instances",
}
Answer = tuple[int, Any, CIMultiDictProxy[str]]


async def mp_post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> Answer:
    """A POST as upstream's proxy sends it: msgpack, with its Content-Type."""
    sent = {"Content-Type": MSGPACK, **(headers or {})}
    raw = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    async with http.post(url, data=raw, headers=sent) as response:
        assert response.content_type == MSGPACK
        return response.status, msgpack.unpackb(await response.read()), response.headers


async def mp_get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url, headers={"Accept": MSGPACK}) as response:
        assert response.content_type == MSGPACK
        return response.status, msgpack.unpackb(await response.read())


def upstream_registration(endpoint: str, instance_id: str, **changes: Any) -> dict[str, Any]:
    """A ``/register`` body exactly as upstream's example proxy builds one."""
    body = {
        "endpoint": endpoint,
        "type": "vLLM",
        "modelname": "m",
        "instance_id": instance_id,
        "block_size": 4,
        "dp_rank": 0,
        "tenant_id": "default",
        "lora_name": "",
        "hash_profile": PROFILE,
    }
    return {**body, **changes}


def tokens(values: list[int]) -> bytes:
    return b"".join(value.to_bytes(4, "little", signed=True) for value in values)


def query_body(**changes: Any) -> dict[str, Any]:
    """A ``/query`` body as upstream's proxy sends it: int32 little-endian tokens in a bin."""
    body = {
        "model": "m",
        "block_size": 4,
        "token_ids": tokens(PROMPT),
        "tenant_id": "default",
        "lora_name": "",
    }
    return {**body, **changes}


async def register_connected(
    http: aiohttp.ClientSession, base: str, publisher: WirePublisher, instance_id: str, **changes
) -> None:
    """Register in msgpack and wait until the stream's SUB socket is connected."""
    body = upstream_registration(publisher.endpoint, instance_id, **changes)
    status, answer, _ = await mp_post(http, f"{base}/register", body)
    assert status == 200, answer

    async def state() -> str:
        _, services = await get(http, f"{base}/services")
        listed = services["services"]
        return next(s["State"] for s in listed if s["Endpoint"] == publisher.endpoint)

    await eventually(state, lambda found: found == "connected")
    await asyncio.sleep(0.1)  # the subscription travels after the TCP connect


async def tiered_fleet(http, base: str, publisher_factory) -> None:
    """Instance ``a``: rank 0 holds blocks 0-1 on GPU and block 2 on CPU, rank 1 block 0 on
    GPU; instance ``b`` (rank 0) holds nothing."""
    rank0, rank1, idle = publisher_factory(), publisher_factory(), publisher_factory()
    await register_connected(http, base, rank0, "a")
    await register_connected(http, base, rank1, "a", dp_rank=1)
    await register_connected(http, base, idle, "b")
    first, second, third = BLOCK_KEYS  # the streams are profiled: keyed by engine hashes
    await rank0.publish(
        [
            stored([first, second], PROMPT[:8]),
            stored([third], PROMPT[8:], parent=second, medium="CPU"),
        ]
    )
    await rank1.publish([stored([first], PROMPT[:4])], dp_rank=1)

    async def hit() -> tuple[int, int]:
        _, answer, _ = await mp_post(http, f"{base}/query", query_body())
        return answer["instances"]["a"]["longest_matched"], answer["instances"]["a"]["dp"]["1"]

    await eventually(hit, lambda matched: matched == (12, 4))  # both ranks' batches applied


# -- /register -------------------------------------------------------------------------------
async def test_register_answers_as_upstream_and_is_idempotent(conductor, http):
    """Upstream answers a registration, and the same one again, 200 ``{"status":
    "registered successfully", "instance_id"}``: its proxy checks both values. The same
    registration in JSON is the same registration."""
    body = upstream_registration("tcp://127.0.0.1:5601", "prefill-a")
    for _ in range(2):
        status, answer, _ = await mp_post(http, f"{conductor.url}/register", body)
        assert (status, answer) == (
            200,
            {"instance_id": "prefill-a", "status": "registered successfully"},
        )
    assert (await post(http, f"{conductor.url}/register", body))[0] == 200


@pytest.mark.parametrize(
    "second",
    [
        upstream_registration(
            "tcp://127.0.0.1:5601", "prefill-a", hash_profile={**PROFILE, "python_hash_seed": "00"}
        ),
        upstream_registration("tcp://127.0.0.1:5601", "prefill-a", cache_group=0),
        upstream_registration(
            "tcp://127.0.0.1:5602", "prefill-b", hash_profile={**PROFILE, "algorithm": "sha256"}
        ),
        {
            **upstream_registration("tcp://127.0.0.1:5602", "prefill-b"),
            "hash_profile": None,
        },
    ],
    ids=["other_seed_text", "cache_group_0_after_null", "context_other_algorithm", "no_profile"],
)
async def test_a_conflict_is_400_invalid_registration_in_msgpack_and_409_in_json(
    conductor, http, second
):
    """Upstream: the same service key with any other field (the profile, a cache group 0
    where null was), or another profile in a context (tenant, model, LoRA, block size) a
    registration bound, is 400 ``invalid_registration`` without a field. JSON keeps the Go
    conductor's 409."""
    first = upstream_registration("tcp://127.0.0.1:5601", "prefill-a")
    assert (await mp_post(http, f"{conductor.url}/register", first))[0] == 200
    status, answer, _ = await mp_post(http, f"{conductor.url}/register", second)
    assert (status, set(answer), answer["reason"]) == (
        400,
        {"error", "reason"},
        "invalid_registration",
    ), answer
    assert (await post(http, f"{conductor.url}/register", second)) == (
        409,
        {"error": answer["error"], "field": None},
    )


@pytest.mark.parametrize(
    ("change", "reason", "field"),
    [
        ({"bogus": 1}, "unknown_field", "bogus"),
        ({"hash_profile": {**PROFILE, "root_digest": "ab" * 32}}, "unknown_field", None),
        ({"hash_profile": "vllm_v1"}, "invalid_type", "hash_profile"),
        ({"hash_profile": {**PROFILE, "algorithm": "SHA256"}}, "invalid_value", None),
        ({"hash_profile": {**PROFILE, "strategy": "vllm_v2"}}, "invalid_value", None),
        ({"hash_profile": {**PROFILE, "index_projection": "low32"}}, "invalid_value", None),
        ({"hash_profile": {**PROFILE, "python_hash_seed": "4294967296"}}, "invalid_value", None),
        ({"hash_profile": {**PROFILE, "python_hash_seed": "-1"}}, "invalid_value", None),
        ({"hash_profile": {**PROFILE, "python_hash_seed": 0}}, "invalid_type", None),
        ({"cache_group": 1}, "unsupported", "cache_group"),
        ({"cache_group": "0"}, "invalid_type", "cache_group"),
        ({"cache_group": True}, "invalid_type", "cache_group"),
        ({"block_size": 0}, "out_of_range", "block_size"),
        ({"block_size": 16.0}, "invalid_type", "block_size"),
        ({"dp_rank": -1}, "out_of_range", "dp_rank"),
        ({"type": "vllm2"}, "invalid_value", "type"),
        ({"modelname": ""}, "invalid_value", "modelname"),
        ({"endpoint": None}, "invalid_type", "endpoint"),
        ({"tenant_id": None}, "invalid_type", "tenant_id"),
    ],
)
async def test_register_refusals_carry_upstreams_reason(
    shared_conductor, http, change, reason, field
):
    """Upstream refuses these with 400 and the reason named, the field too where one field
    is at fault (ours names a profile's key by its path, ``hash_profile.algorithm``)."""
    body = {**upstream_registration("tcp://127.0.0.1:5603", "refused"), **change}
    status, answer, _ = await mp_post(http, f"{shared_conductor.url}/register", body)
    assert (status, answer["reason"]) == (400, reason), answer
    if field is not None:
        assert answer["field"] == field, answer
    else:
        assert answer["field"].startswith("hash_profile."), answer


async def test_a_missing_profile_key_is_missing(shared_conductor, http):
    profile = {key: value for key, value in PROFILE.items() if key != "index_projection"}
    body = upstream_registration("tcp://127.0.0.1:5604", "refused", hash_profile=profile)
    status, answer, _ = await mp_post(http, f"{shared_conductor.url}/register", body)
    assert (status, answer["reason"], answer["field"]) == (
        400,
        "missing",
        "hash_profile.index_projection",
    )


async def test_our_extension_fields_and_the_routers_bodies_stay_accepted(conductor, http):
    """Upstream refuses any field it does not know; ours (``kv_store``, ``additionalsalt``,
    the Go ``lora_id`` of a query) are accepted in msgpack too, and so is every body our
    router sends (without a hash profile: upstream requires one, we do not)."""
    instance = PrefillInstance(
        instance_id="routed",
        http_endpoint="http://127.0.0.1:1",
        registrations=[StreamRegistration(endpoint="tcp://127.0.0.1:5605")],
        kv_store="127.0.0.1:50051",
    )
    model = ModelSection(modelname="m", block_size=4, instances=[instance])
    for body in registration_bodies(model):
        assert (await mp_post(http, f"{conductor.url}/register", body))[0] == 200
    extended = upstream_registration(
        "tcp://127.0.0.1:5606", "salted", modelname="m2", additionalsalt="s", kv_store=""
    )
    assert (await mp_post(http, f"{conductor.url}/register", extended))[0] == 200
    status, answer, _ = await mp_post(http, f"{conductor.url}/query", query_body(lora_id=None))
    assert status == 200 and set(answer["instances"]) == {"routed"}, answer


# -- /query ----------------------------------------------------------------------------------
async def test_query_answers_in_upstreams_shape(conductor, http, publisher_factory):
    """Upstream's ``/query`` answer: ``{"instances": {id: {longest_matched, dp, rank_matches,
    gpu, cpu, disk}}}`` in instance-id order, every registered rank listed (zero hits too),
    rank keys decimal strings, values tokens, each rank's tiers cumulative (gpu <= cpu <=
    disk), ``dp`` each rank's GPU hit, the instance tiers the best of its ranks and
    ``longest_matched`` its disk tier. Exactly so when the client names those tiers (by
    default the later revision's are there too: see below)."""
    await tiered_fleet(http, conductor.url, publisher_factory)
    tip = {TIERS_HEADER: "gpu,cpu,disk"}
    status, answer, headers = await mp_post(http, f"{conductor.url}/query", query_body(), tip)
    assert status == 200 and NO_CONTEXT_HEADER not in headers
    assert answer == {
        "instances": {
            "a": {
                "longest_matched": 12,
                "dp": {"0": 8, "1": 4},
                "rank_matches": {
                    "0": {"gpu": 8, "cpu": 12, "disk": 12},
                    "1": {"gpu": 4, "cpu": 4, "disk": 4},
                },
                "gpu": 8,
                "cpu": 12,
                "disk": 12,
            },
            "b": {
                "longest_matched": 0,
                "dp": {"0": 0},
                "rank_matches": {"0": {"gpu": 0, "cpu": 0, "disk": 0}},
                "gpu": 0,
                "cpu": 0,
                "disk": 0,
            },
        }
    }
    assert list(answer["instances"]) == ["a", "b"]


async def shared_pool_fleet(http, base: str, publisher_factory) -> None:
    """``tiered_fleet``, and a Mooncake store stream of the context holding blocks 0-1 on
    CPU and all three on disk."""
    await tiered_fleet(http, base, publisher_factory)
    store = publisher_factory(with_replay=False)
    await register_connected(http, base, store, "store", type="Mooncake")
    first, second, third = BLOCK_KEYS
    await store.publish(
        [
            stored([first, second], PROMPT[:8], medium="CPU"),
            stored([first, second, third], PROMPT, medium="DISK"),
        ]
    )

    async def hit() -> int:
        _, answer, _ = await mp_post(http, f"{base}/query", query_body())
        return answer["instances"]["b"]["longest_matched"]

    await eventually(hit, lambda matched: matched == 12)


LATER_TIERS = "npu,cpu_local,cpu_share,disk"


async def test_the_later_revisions_tiers_split_own_cpu_from_a_shared_pool(
    conductor, http, publisher_factory
):
    """Upstream's later revision (``StorageTier {kNpu, kCpuLocal, kCpuShare, kDisk}`` in
    ``prefixindex/types.h`` at 1b6bbb02a; an engine's own CPU blocks are ``kCpuLocal`` and
    a store's ``kCpuShare`` in ``kvevent/event_handler.cpp`` at 4588ea70d) answers ``npu``,
    ``cpu_local``, ``cpu_share``, ``disk``, cumulative in that order, and no longer ``gpu``
    or ``cpu``; nothing in the request chooses. By default our msgpack answer carries both
    revisions' names (gpu = npu, cpu = cpu_share), so both clients read it unchanged; a
    client naming the later set gets exactly the later shape, in its key order."""
    await shared_pool_fleet(http, conductor.url, publisher_factory)
    _, answer, _ = await mp_post(http, f"{conductor.url}/query", query_body())
    a, b = answer["instances"]["a"], answer["instances"]["b"]
    both = {"gpu": 8, "cpu": 12, "npu": 8, "cpu_local": 12, "cpu_share": 12, "disk": 12}
    assert a["rank_matches"] == {
        "0": both,
        "1": {"gpu": 4, "cpu": 8, "npu": 4, "cpu_local": 4, "cpu_share": 8, "disk": 12},
    }
    assert {key: a[key] for key in both} == both and a["longest_matched"] == 12
    # b holds nothing itself: what the pool holds is its CPU and disk hit, not its own
    assert b["rank_matches"]["0"] == {
        "gpu": 0,
        "cpu": 8,
        "npu": 0,
        "cpu_local": 0,
        "cpu_share": 8,
        "disk": 12,
    }

    later = {TIERS_HEADER: LATER_TIERS}
    _, answer, _ = await mp_post(http, f"{conductor.url}/query", query_body(), later)
    b = answer["instances"]["b"]
    assert b == {
        "longest_matched": 12,
        "dp": {"0": 0},
        "rank_matches": {"0": {"npu": 0, "cpu_local": 0, "cpu_share": 8, "disk": 12}},
        "npu": 0,
        "cpu_local": 0,
        "cpu_share": 8,
        "disk": 12,
    }
    assert list(b) == ["longest_matched", "dp", "rank_matches", *LATER_TIERS.split(",")]


async def test_the_tiers_header_in_json_and_its_refusal(conductor, http, publisher_factory):
    """In the Go dialect the header names the tiers too, in Go's capitals; a tier nobody
    answers is a 400 naming the header, in either dialect's envelope."""
    await shared_pool_fleet(http, conductor.url, publisher_factory)
    body = {"model": "m", "block_size": 4, "token_ids": PROMPT, "instance_id": "b"}
    headers = {TIERS_HEADER: " NPU, cpu_local,CPU_SHARE ,disk"}
    assert await post(http, f"{conductor.url}/query", body, headers=headers) == (
        200,
        {
            "default": {
                "b": {
                    "longest_matched": 12,
                    "DP": {"0": 12},
                    "NPU": 0,
                    "CPU_LOCAL": 0,
                    "CPU_SHARE": 8,
                    "DISK": 12,
                }
            }
        },
    )
    bad = {TIERS_HEADER: "gpu,hbm"}
    status, answer = await post(http, f"{conductor.url}/query", body, headers=bad)
    assert (status, answer["field"]) == (400, TIERS_HEADER)
    assert "unknown tier 'hbm'" in answer["error"]
    status, answer, _ = await mp_post(http, f"{conductor.url}/query", query_body(), bad)
    assert (status, answer["reason"], answer["field"]) == (400, "invalid_value", TIERS_HEADER)


async def test_a_json_query_keeps_the_go_shape(conductor, http, publisher_factory):
    """The Go service's answer to the same query: by tenant, ``DP`` each rank's deepest
    tier, upper-case tiers."""
    await tiered_fleet(http, conductor.url, publisher_factory)
    body = {"model": "m", "block_size": 4, "token_ids": PROMPT}
    assert await post(http, f"{conductor.url}/query", body) == (
        200,
        {
            "default": {
                "a": {
                    "longest_matched": 12,
                    "DP": {"0": 12, "1": 4},
                    "GPU": 8,
                    "CPU": 12,
                    "DISK": 12,
                },
                "b": {"longest_matched": 0, "DP": {"0": 0}, "GPU": 0, "CPU": 0, "DISK": 0},
            }
        },
    )


async def test_query_filters_and_our_headers(conductor, http, publisher_factory):
    """Upstream: an ``instance_id`` naming no instance, and a context nobody registered,
    are ``{"instances": {}}`` (Go listed the named id with zeros). Our extension headers
    work in this dialect too: hits only, indexing progress, and why no context matched."""
    base = conductor.url
    await tiered_fleet(http, base, publisher_factory)
    _, answer, _ = await mp_post(http, f"{base}/query", query_body(instance_id="ghost"))
    assert answer == {"instances": {}}
    _, answer, _ = await mp_post(http, f"{base}/query", query_body(instance_id="b"))
    assert list(answer["instances"]) == ["b"]
    _, answer, headers = await mp_post(http, f"{base}/query", query_body(block_size=8))
    assert answer == {"instances": {}}
    assert headers[NO_CONTEXT_HEADER].startswith('no context matched model="m" block_size=8')
    asked = {HITS_ONLY_HEADER: "1", PROGRESS_HEADER: '["a"]'}
    _, answer, headers = await mp_post(http, f"{base}/query", query_body(), asked)
    assert list(answer["instances"]) == ["a"]
    assert '"a":' in headers[INDEXED_UNTIL_HEADER]


@pytest.mark.parametrize(
    ("body", "reason", "field", "index"),
    [
        (query_body(token_ids=[1, "x", 3]), "invalid_type", "token_ids", 1),
        (query_body(token_ids=[1, 2, 2**31]), "out_of_range", "token_ids", 2),
        (query_body(token_ids=b"\x01\x00\x00"), "invalid_value", "token_ids", None),
        (query_body(token_ids="1 2 3"), "invalid_type", "token_ids", None),
        (query_body(python_hash_seed="0"), "unknown_field", "python_hash_seed", None),
        (query_body(root_digest="ab"), "unknown_field", "root_digest", None),
        (query_body(block_size=0), "out_of_range", "block_size", None),
        (query_body(block_size=4.0), "invalid_type", "block_size", None),
        (query_body(model=""), "invalid_value", "model", None),
        (query_body(cache_salt=5), "invalid_type", "cache_salt", None),
        ({"block_size": 4, "token_ids": tokens(PROMPT)}, "missing", "model", None),
        ([1, 2], "invalid_msgpack", None, None),
        (msgpack.packb({1: 2}), "invalid_msgpack", None, None),
        (b"\xc1", "invalid_msgpack", None, None),
    ],
)
async def test_query_refusals_carry_upstreams_reason(
    shared_conductor, http, body, reason, field, index
):
    """Upstream's error envelope: ``{"error", "reason"}``, then ``field`` when one field is
    at fault and ``index`` for a bad element of ``token_ids``, nothing else."""
    status, answer, _ = await mp_post(http, f"{shared_conductor.url}/query", body)
    expected = {"reason": reason, "field": field, "index": index}
    assert status == 400, answer
    assert answer == {
        "error": answer["error"],
        **{k: v for k, v in expected.items() if v is not None},
    }


async def test_a_json_error_keeps_the_go_envelope(shared_conductor, http):
    body = {"model": "m", "block_size": 4, "token_ids": [1, "x"], "python_hash_seed": "0"}
    assert await post(http, f"{shared_conductor.url}/query", body) == (
        400,
        {"error": "token_ids: element 1 ('x') is not an int32", "field": "token_ids"},
    )


# -- /unregister -----------------------------------------------------------------------------
async def test_unregister_answers_as_upstream(conductor, http):
    """Upstream: 200 ``{"status": "unregistered successfully", "removed_instances":
    ["instance|tenant|rank"]}``; an unknown service 404 with its key in ``error`` and no
    reason; an unknown field refused."""
    base = conductor.url
    body = upstream_registration("tcp://127.0.0.1:5607", "prefill-a", dp_rank=2)
    assert (await mp_post(http, f"{base}/register", body))[0] == 200
    gone = {"instance_id": "prefill-a", "tenant_id": "default", "dp_rank": 2}
    assert (await mp_post(http, f"{base}/unregister", gone))[:2] == (
        200,
        {"removed_instances": ["prefill-a|default|2"], "status": "unregistered successfully"},
    )
    status, answer, _ = await mp_post(http, f"{base}/unregister", gone)
    assert status == 404 and "reason" not in answer
    assert answer["error"] == "service not found: prefill-a|default|2"
    status, answer, _ = await mp_post(http, f"{base}/unregister", {**gone, "endpoint": "x"})
    assert (status, answer["reason"], answer["field"]) == (400, "unknown_field", "endpoint")


# -- /services, /global_view -----------------------------------------------------------------
async def test_views_show_upstreams_keys_in_both_encodings(conductor, http, publisher_factory):
    """Upstream's ``/services`` lists each registration under Go-style keys plus
    ``CacheGroup`` and ``HashProfile`` (with the derived ``root_digest``); its
    ``/global_view`` counts contexts and shows each one's ``prefix_count`` (distinct blocks
    held on any tier), profile and instances' ranks. Ours answers a superset (our extra
    keys stay), the same in JSON and msgpack."""
    base = conductor.url
    await tiered_fleet(http, base, publisher_factory)
    profile = {**PROFILE, "root_digest": root_digest("sha256_cbor", "0")}
    for status, services in [await ask(http, f"{base}/services") for ask in (mp_get, get)]:
        assert status == 200 and services["count"] == 3
        first = services["services"][0]
        assert UPSTREAM_SERVICE_KEYS <= set(first)
        assert (first["InstanceID"], first["DPRank"], first["CacheGroup"]) == ("a", 0, None)
        assert (first["Type"], first["ModelName"], first["BlockSize"]) == ("vLLM", "m", 4)
        assert first["HashProfile"] == profile
    for status, view in [await ask(http, f"{base}/global_view") for ask in (mp_get, get)]:
        assert status == 200 and view["context_count"] == 1
        (context,) = view["contexts"]
        assert UPSTREAM_CONTEXT_KEYS <= set(context)
        assert {key: context[key] for key in UPSTREAM_CONTEXT_KEYS} == {
            "model_name": "m",
            "lora_name": "",
            "block_size": 4,
            "tenant_id": "default",
            "prefix_count": 3,
            "hash_profile": profile,
            "instances": {"a": [0, 1], "b": [0]},
        }


async def test_a_view_error_is_in_the_dialect_asked(conductor, http):
    url = f"{conductor.url}/global_view?hashes=x"
    async with http.get(url, headers={"Accept": MSGPACK}) as response:
        answer = msgpack.unpackb(await response.read())
    assert (response.status, answer["reason"], answer["field"]) == (400, "invalid_type", "hashes")


# -- config file, state file -----------------------------------------------------------------
async def test_an_upstream_config_file_starts_and_rpc_is_said_not_served(conductor_factory, http):
    """Upstream's ``conductor_config.json`` (``src/kvevent/config.cpp``): entries with a
    ``hash_profile`` and a ``cache_group``; a later revision's ``rpc_server_port`` (its
    coro_rpc channel, which we do not speak) is accepted and logged as not served, and
    the ``services`` list of its tests (``tests/python/test_client_e2e.py``), which its
    config.cpp (2c7cc9f58) does not read, is accepted and said unread."""
    unnamed = upstream_registration("tcp://127.0.0.1:5609", "", cache_group=0)
    del unnamed["instance_id"]  # upstream, as we, names it after its entry then
    entries = {
        "prefill-a-rank0": {
            **upstream_registration("tcp://127.0.0.1:5608", "prefill-a", cache_group=None),
            "replay_endpoint": "",
        },
        "prefill-b": unnamed,
    }
    config = {
        "http_server_port": 13333,
        "rpc_server_port": 50051,
        "kvevent_instance": entries,
        "services": [{"endpoint": "tcp://127.0.0.1:5611"}],
    }
    conductor = conductor_factory(config=config)
    _, answer = await get(http, f"{conductor.url}/services")
    root = root_digest("sha256_cbor", "0")
    listed = {s["InstanceID"]: (s["CacheGroup"], s["HashProfile"]) for s in answer["services"]}
    assert listed == {
        "prefill-a": (None, {**PROFILE, "root_digest": root}),
        "prefill-b": (0, {**PROFILE, "root_digest": root}),
    }

    async def log() -> str:
        return conductor.log()

    expected = "rpc_server_port=50051 is not served: this conductor speaks HTTP only"
    await eventually(log, lambda text: expected in text)
    assert "the services list is not read" in conductor.log()
    assert "5611" not in json.dumps(answer)


async def test_the_profile_survives_a_restart(conductor_factory, http, tmp_path, request):
    """Kept in the state file like the registration's other fields: the restarted
    conductor answers the proxy's repeated registration as the same one."""
    first = conductor_factory()
    port = int(first.url.rsplit(":", 1)[1])
    body = upstream_registration(
        "tcp://127.0.0.1:5610", "prefill-a", hash_profile={**PROFILE, "python_hash_seed": "007"}
    )
    assert (await mp_post(http, f"{first.url}/register", body))[0] == 200
    first.stop()
    second = ConductorProcess(tmp_path, port=port)  # same directory and port: same state file
    request.addfinalizer(second.stop)
    second.wait_ready()
    _, services = await get(http, f"{second.url}/services")
    assert services["services"][0]["HashProfile"]["python_hash_seed"] == "007"
    assert (await mp_post(http, f"{second.url}/register", body))[0] == 200
    other = {**body, "hash_profile": {**PROFILE, "python_hash_seed": "7"}}
    assert (await mp_post(http, f"{second.url}/register", other))[0] == 400
