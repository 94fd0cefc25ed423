"""Store checks end to end: the conductor as a subprocess, real ZMQ publishers, and a real
HTTP server on loopback answering ``GET /get_all_keys`` the way a Mooncake master's admin
server does (the real master is exercised in ``tests/store/test_store_index.py``).

A store evicts without an event: every check drops the pool blocks whose keys are gone,
except blocks announced while the answer was on its way; a failing check marks the store
down, empties its pools and drops its CPU events until a check answers again.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from conductor.config import ConductorConfig, one_line
from conductor.kv_store_watch import StoreKeys
from conductor.wire import BlockStored, decode_batch
from conductor.wire.events import Tier
from tests.support.api import eventually, get, metric, post, query, register_and_connect
from tests.support.processes import free_port
from tests.support.wire_publisher import removed, stored

STORE = "127.0.0.1:50051"
INTERVAL_S = 0.1
PROMPT = list(range(1, 13))  # three blocks of 4
HASHES = [101, 102, 103]
CAPTURE = json.loads(
    (
        Path(__file__).resolve().parents[1] / "fixtures" / "vllm_store_connector_capture.json"
    ).read_text(encoding="utf-8")
)


def store_key(block_hash: int, model: str = "m") -> str:
    """vLLM MooncakeStoreConnector's key of a block whose digest ends in ``block_hash``."""
    return f"{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{'ab' * 24}{block_hash:016x}"


class AdminServer:
    """A store master's admin server as the conductor uses it: ``/get_all_keys`` answers
    ``keys`` as they were when the request came in, after ``gate`` opens (when set), or
    ``status`` when it is not 200."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.status = 200
        self.gate: asyncio.Event | None = None
        self.asked = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> AdminServer:
        app = web.Application()
        app.router.add_get("/get_all_keys", self._all_keys)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _all_keys(self, request: web.Request) -> web.Response:
        answer = "".join(f"{key}\n" for key in self.keys)
        self.asked.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.status != 200:
            return web.Response(status=self.status, text="unavailable")
        return web.Response(text=answer)


@pytest.fixture
async def admin() -> AsyncIterator[AdminServer]:
    server = await AdminServer().start()
    yield server
    await server.stop()


def store_config(admin: AdminServer, **extra: str) -> dict:
    return {
        "kv_store_admin_urls": {STORE: admin.url, **extra},
        "kv_store_check_interval_s": INTERVAL_S,
    }


def tiers(answer: dict) -> dict[str, tuple[int, int, int]]:
    return {name: (m["GPU"], m["CPU"], m["DISK"]) for name, m in answer["default"].items()}


async def cpu_of(http: aiohttp.ClientSession, base: str, instance: str) -> int:
    return tiers(await query(http, base, PROMPT))[instance][1]


async def store_health(http: aiohttp.ClientSession, base: str) -> dict:
    return (await get(http, f"{base}/health"))[1]


async def checks(http: aiohttp.ClientSession, base: str) -> float:
    return await metric(http, base, "conductor_kv_store_checks_total")


# -- the key list --------------------------------------------------------------------------------
def test_keys_of_the_captured_master_are_the_blocks_its_engines_announced() -> None:
    """Real vLLM's saved blocks (medium "cpu") and the real master's key list agree: each
    key's digest ends in the 16 hex digits of the block's event hash."""
    announced = set()
    for step in CAPTURE["steps"]:
        for frames in step["frames"].values():
            for frame in frames:
                batch = decode_batch(base64.b64decode(frame["payload_b64"]), b"kv-events")
                announced.update(
                    h
                    for e in batch.events
                    if isinstance(e, BlockStored) and e.tier is Tier.CPU
                    for h in e.block_hashes
                )
    body = CAPTURE["master_admin"]["/get_all_keys"]["body"].encode()
    keys = StoreKeys()
    keys.feed(body)
    assert keys.finish().digests == announced and (keys.keys, keys.unparsable) == (5, 0)


def test_keys_parse_the_same_in_any_chunking() -> None:
    """Chunks split keys anywhere; CRLF, a missing last newline, foreign and malformed
    keys (no digest, too short, not hex) are all handled."""
    lines = [
        store_key(1),
        store_key(2, model="other-model"),  # another model's block: just a digest
        "not-a-connector-key",
        "m@tp_rank:0@group:0@abc",  # too short to be a digest
        "m@tp_rank:0@group:0@" + "g" * 64,
        f"m@x@{'0' * 48}{2**64 - 1:016x}\r",
        store_key(3),
    ]
    body = "\n".join(lines).encode()  # no final newline
    whole = StoreKeys()
    whole.feed(body)
    whole.finish()
    assert whole.digests == {1, 2, 2**64 - 1, 3}
    assert (whole.keys, whole.unparsable) == (7, 3)
    for size in (1, 7, 64):
        chunked = StoreKeys()
        for start in range(0, len(body), size):
            chunked.feed(body[start : start + size])
        assert chunked.finish() == whole


# -- configuration ---------------------------------------------------------------------------
def test_store_admin_urls_default_to_the_masters_host_on_port_9003() -> None:
    config = ConductorConfig.model_validate(
        {"kv_store_admin_urls": {STORE: "http://127.0.0.1:9100/"}}
    )
    assert config.store_admin_url(STORE) == "http://127.0.0.1:9100"
    assert config.store_admin_url("10.0.0.7:50051") == "http://10.0.0.7:9003"
    assert config.store_admin_url("[::1]:50051") == "http://[::1]:9003"
    assert config.kv_store_check_interval_s == 2.0
    assert config.kv_store_check_silence_s == 10.0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"kv_store_admin_urls": {"10.0.0.7": "http://h:1"}}, "kv_store_admin_urls.10.0.0.7"),
        ({"kv_store_admin_urls": {STORE: "ftp://h:1"}}, "http(s)://host:port URL"),
        ({"kv_store_admin_urls": {STORE: "http://h:1/?x=1"}}, "http(s)://host:port URL"),
        ({"kv_store_admin_urls": {STORE: 9003}}, f"kv_store_admin_urls.{STORE}"),
        ({"kv_store_check_interval_s": 0}, "greater than or equal to 0.05"),
        ({"kv_store_check_interval_s": "2"}, "kv_store_check_interval_s"),
        ({"kv_store_check_silence_s": 0}, "kv_store_check_silence_s"),
        ({"kv_store_check_silence_s": 61}, "less than or equal to 60"),
    ],
)
def test_store_settings_are_validated(config: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        ConductorConfig.model_validate(config)
    assert message in one_line(error.value)


# -- the running service -----------------------------------------------------------------------
async def test_kv_store_pool_is_shared_by_the_instances_of_that_store(
    conductor_factory, admin, http, publisher_factory
):
    """vLLM's MooncakeStoreConnector saves blocks to the store and says so with medium
    "cpu": they are CPU hits of every instance registered with that store (even one that
    never computed them), of no other, and outlive the engine that saved them."""
    admin.keys = [store_key(h) for h in HASHES]
    base = conductor_factory(config=store_config(admin)).url
    a, b, c = publisher_factory(), publisher_factory(), publisher_factory()
    body = await register_and_connect(http, base, a, "engine-a", kv_store=STORE)
    await register_and_connect(http, base, b, "engine-b", kv_store=STORE)
    await register_and_connect(http, base, c, "engine-c")
    assert (await post(http, f"{base}/register", body))[0] == 200
    status, _ = await post(http, f"{base}/register", {**body, "kv_store": "127.0.0.1:1"})
    assert status == 409

    await a.publish([stored(HASHES, PROMPT)])
    await a.publish([stored(HASHES, PROMPT, medium="cpu")])
    answer = await eventually(
        lambda: query(http, base, PROMPT), lambda got: tiers(got)["engine-b"][1] == 12
    )
    assert tiers(answer) == {
        "engine-a": (12, 12, 12),
        "engine-b": (0, 12, 12),
        "engine-c": (0, 0, 0),
    }
    _, services = await get(http, f"{base}/services")
    assert [s["KVStore"] for s in services["services"]] == [STORE, STORE, ""]
    health = await eventually(
        lambda: store_health(http, base), lambda h: h["kv_stores"][STORE]["state"] == "up"
    )
    assert health["status"] == "ok"
    assert health["kv_stores"][STORE]["blocks"] == 3
    assert 0 <= health["kv_stores"][STORE]["checked_s_ago"] < 5
    assert health["streams"]["engine-a|default|0"]["kv_store"] == STORE
    _, view = await get(http, f"{base}/global_view")
    (context,) = view["contexts"]
    assert context["kv_stores"] == {STORE: {"blocks": 3, "instances": ["engine-a", "engine-b"]}}
    assert sorted(context["instances"]) == ["engine-a", "engine-b", "engine-c"]

    await a.publish([removed(HASHES[2:], medium="cpu")])
    await eventually(lambda: cpu_of(http, base, "engine-b"), lambda cpu: cpu == 8)

    await a.close()  # the engine is lost: its GPU blocks go, the store keeps its copies
    answer = await eventually(
        lambda: query(http, base, PROMPT), lambda got: tiers(got)["engine-a"][0] == 0
    )
    assert tiers(answer) == {"engine-a": (0, 8, 8), "engine-b": (0, 8, 8), "engine-c": (0, 0, 0)}
    await post(http, f"{base}/unregister", {"instance_id": "engine-a"})
    answer = await query(http, base, PROMPT)
    assert tiers(answer) == {"engine-b": (0, 8, 8), "engine-c": (0, 0, 0)}

    await post(http, f"{base}/unregister", {"instance_id": "engine-b"})  # the store's last
    health = await store_health(http, base)
    assert health["kv_stores"] == {} and health["blocks"] == 0
    assert f'kv_store="{STORE}"' not in await (await http.get(f"{base}/metrics")).text()


async def test_evicted_blocks_leave_and_blocks_saved_during_a_check_stay(
    conductor_factory, admin, http, publisher_factory
):
    """A block whose key left the store goes at the next check. A block announced while a
    check's answer (which predates it) travels survives that check, and is judged by the
    next one. Keys of other models and malformed keys change nothing."""
    admin.keys = [store_key(h) for h in HASHES] + [store_key(7, "other"), "junk"]
    conductor = conductor_factory(config=store_config(admin))
    base = conductor.url
    a, b = publisher_factory(), publisher_factory()
    await register_and_connect(http, base, a, "engine-a", kv_store=STORE)
    await register_and_connect(http, base, b, "engine-b", kv_store=STORE)
    await a.publish([stored(HASHES[:2], PROMPT[:8], medium="cpu")])
    await eventually(lambda: cpu_of(http, base, "engine-b"), lambda cpu: cpu == 8)
    await asyncio.sleep(3 * INTERVAL_S)  # checks that find the keys change nothing
    assert await cpu_of(http, base, "engine-b") == 8
    assert await metric(http, base, "conductor_kv_store_keys") == 5

    admin.keys.remove(store_key(HASHES[1]))  # the store evicted block 1
    await eventually(lambda: cpu_of(http, base, "engine-b"), lambda cpu: cpu == 4, timeout=2)
    assert await metric(http, base, "conductor_kv_store_blocks_dropped_total") == 1
    text = await (await http.get(f"{base}/metrics")).text()
    assert f'conductor_kv_store_keys{{kind="unparsable",kv_store="{STORE}"}} 1.0' in text
    assert conductor.log().count("are no MooncakeStoreConnector block keys") == 1

    # a check is under way with the key list of now; block 1 is saved again meanwhile
    admin.gate, admin.asked = asyncio.Event(), asyncio.Event()
    await asyncio.wait_for(admin.asked.wait(), 5)
    before = await checks(http, base)
    await b.publish([stored(HASHES[1:], PROMPT[4:], parent=HASHES[0], medium="cpu")])
    await eventually(lambda: cpu_of(http, base, "engine-a"), lambda cpu: cpu == 12)
    admin.keys.append(store_key(HASHES[1]))  # what the checks after the held one see
    admin.gate.set()
    await eventually(lambda: checks(http, base), lambda n: n > before)
    assert await cpu_of(http, base, "engine-a") == 12  # the held answer did not drop it
    admin.gate = None
    admin.keys.remove(store_key(HASHES[1]))  # an answer that came after its announcement
    await eventually(lambda: cpu_of(http, base, "engine-a"), lambda cpu: cpu == 4, timeout=2)


async def test_a_store_down_is_cleared_degrades_health_and_drops_its_cpu_events(
    conductor_factory, admin, http, publisher_factory
):
    """A master that does not answer may be gone or restart empty: its pools go at once,
    /health is degraded and its CPU events are dropped (counted) until it answers; then
    new events index again. Engines' GPU blocks and a Mooncake-type store pool stay."""
    admin.keys = [store_key(h) for h in HASHES]
    base = conductor_factory(config=store_config(admin)).url
    a, b, pool = publisher_factory(), publisher_factory(), publisher_factory()
    await register_and_connect(http, base, a, "engine-a", kv_store=STORE)
    await register_and_connect(http, base, b, "engine-b", kv_store=STORE)
    await register_and_connect(http, base, pool, "mooncake-pool", type="Mooncake")
    await a.publish([stored(HASHES, PROMPT)])
    await a.publish([stored(HASHES, PROMPT, medium="cpu")])
    await pool.publish([stored(HASHES[:1], PROMPT[:4], medium="disk")])
    await eventually(
        lambda: query(http, base, PROMPT),
        lambda got: tiers(got) == {"engine-a": (12, 12, 12), "engine-b": (0, 12, 12)},
    )

    admin.status = 503
    health = await eventually(
        lambda: store_health(http, base),
        lambda h: h["kv_stores"][STORE]["state"] == "down",
        timeout=2,
    )
    assert health["status"] == "degraded" and health["kv_stores"][STORE]["blocks"] == 0
    assert tiers(await query(http, base, PROMPT)) == {
        "engine-a": (12, 12, 12),
        "engine-b": (0, 0, 4),  # the Mooncake pool's DISK block stays
    }
    await b.publish([stored(HASHES, PROMPT, medium="cpu")])
    await b.publish([stored(HASHES[:1], PROMPT[:4])])
    await eventually(lambda: query(http, base, PROMPT), lambda got: tiers(got)["engine-b"][0])
    assert await cpu_of(http, base, "engine-b") == 4  # its own GPU block only
    assert await metric(http, base, "conductor_dropped_events_total") == 1  # kv_store_down
    text = await (await http.get(f"{base}/metrics")).text()
    assert f'conductor_kv_store_checks_total{{kv_store="{STORE}",outcome="status"}}' in text
    assert f'{{conductor_kv_store_state="down",kv_store="{STORE}"}} 1.0' in text

    admin.status = 200
    health = await eventually(
        lambda: store_health(http, base),
        lambda h: h["kv_stores"][STORE]["state"] == "up",
        timeout=2,
    )
    assert health["status"] == "ok"
    await a.publish([stored(HASHES, PROMPT, medium="cpu")])
    await eventually(lambda: cpu_of(http, base, "engine-b"), lambda cpu: cpu == 12)


async def test_a_store_nobody_answers_for_is_down_from_its_first_check(
    conductor_factory, admin, http, publisher_factory
):
    """No admin server at the configured address: refused, so down (and the conductor
    logs why, once)."""
    other = "127.0.0.1:50052"
    conductor = conductor_factory(
        config=store_config(admin, **{other: f"http://127.0.0.1:{free_port()}"})
    )
    base = conductor.url
    await register_and_connect(http, base, publisher_factory(), "engine-a", kv_store=other)
    await register_and_connect(http, base, publisher_factory(), "engine-b", kv_store=STORE)
    health = await eventually(
        lambda: store_health(http, base),
        lambda h: (
            h["kv_stores"][other]["state"] == "down" and h["kv_stores"][STORE]["state"] == "up"
        ),
        timeout=2,
    )
    assert health["status"] == "degraded"
    await asyncio.sleep(3 * INTERVAL_S)
    text = await (await http.get(f"{base}/metrics")).text()
    assert f'conductor_kv_store_checks_total{{kv_store="{other}",outcome="unreachable"}}' in text
    assert conductor.log().count(f"kv_store={other} down") == 1
    reason = rf"kv_store={other} down: cannot connect to 127\.0\.0\.1:\d+: connection refused at"
    assert re.search(reason, conductor.log()), conductor.log_tail()


async def test_a_master_that_stops_answering_is_down_after_its_silence_timeout(
    conductor_factory, admin, http, publisher_factory
):
    """A hung master (it accepts the request, then says nothing) is down once the check's
    silence timeout (``kv_store_check_silence_s``, 1 s here) passes, and its pool is
    emptied."""
    admin.keys = [store_key(h) for h in HASHES]
    conductor = conductor_factory(config={**store_config(admin), "kv_store_check_silence_s": 1})
    base = conductor.url
    a = publisher_factory()
    await register_and_connect(http, base, a, "engine-a", kv_store=STORE)
    await a.publish([stored(HASHES, PROMPT, medium="cpu")])
    await eventually(lambda: cpu_of(http, base, "engine-a"), lambda cpu: cpu == 12)
    admin.gate = asyncio.Event()  # never opened
    silence = 1.0
    health = await eventually(
        lambda: store_health(http, base),
        lambda h: h["kv_stores"][STORE]["state"] == "down",
        timeout=silence + 5,
    )
    assert health["kv_stores"][STORE]["blocks"] == 0
    text = await (await http.get(f"{base}/metrics")).text()
    assert f'conductor_kv_store_checks_total{{kv_store="{STORE}",outcome="timeout"}} 1.0' in text
    assert "1 s of silence" in conductor.log(), conductor.log_tail()
    admin.gate.set()
