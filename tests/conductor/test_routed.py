"""``POST /routed``: a prompt a router sent to an instance counts there in ``/query``'s
answers before the instance's events are indexed, for the report's time."""

from __future__ import annotations

import asyncio

import msgpack

from conductor.hashing import token_bytes
from conductor.routed import RoutedPrompts, RoutedRequest
from tests.support.api import eventually, matched, metric, post, query, register_and_connect
from tests.support.wire_publisher import stored

PROMPT = list(range(1, 25))  # six blocks of 4


def routed(instance_id: str, tokens: list[int], **fields: object) -> dict[str, object]:
    return {"model": "m", "block_size": 4, "token_ids": tokens, "instance_id": instance_id,
            **fields}  # fmt: skip


async def test_a_routed_prompt_counts_on_its_instance_until_its_time_ends(
    served, http, publisher_factory
):
    base = served.url
    for name in ("a", "b"):
        await register_and_connect(http, base, publisher_factory(), name)
    status, answer = await post(http, f"{base}/routed", routed("b", PROMPT, ttl_s=1.0))
    assert (status, answer) == (200, {"status": "recorded"})

    # a prompt sharing its first four blocks: a GPU hit of 16 tokens on b, nothing on a
    other = PROMPT[:16] + [99] * 8
    assert await matched(http, base, other, "b") == 16
    assert await matched(http, base, other, "a") == 0
    entry = (await query(http, base, other))["default"]["b"]
    assert (entry["longest_matched"], entry["GPU"], entry["CPU"], entry["DISK"]) == (16,) * 4
    assert await matched(http, base, [7] * 24, "b") == 0  # another first block
    assert await matched(http, base, PROMPT, "b", cache_salt="s") == 0  # another salt
    assert await matched(http, base, PROMPT, "b", lora_name="x") == 0  # another context
    assert await metric(http, base, "conductor_routed_raised_total") >= 2
    assert await metric(http, base, "conductor_routed_prompts") == 1
    # a report naming no instance of the context adds none to the answers
    assert (await post(http, f"{base}/routed", routed("ghost", PROMPT)))[0] == 200
    assert sorted((await query(http, base, PROMPT))["default"]) == ["a", "b"]

    await asyncio.sleep(1.1)
    assert await matched(http, base, PROMPT, "b") == 0


async def test_the_larger_of_the_index_and_the_routed_prompt_counts(
    served, http, publisher_factory
):
    base = served.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "a")
    await publisher.publish([stored([1, 2, 3], PROMPT[:12])])
    await eventually(lambda: matched(http, base, PROMPT, "a"), lambda n: n == 12)
    assert (await post(http, f"{base}/routed", routed("a", PROMPT[:8])))[0] == 200
    assert await matched(http, base, PROMPT, "a") == 12  # the index holds more
    assert (await post(http, f"{base}/routed", routed("a", PROMPT)))[0] == 200
    assert await matched(http, base, PROMPT, "a") == 24
    # the instance named by the query only; the others as they are
    answer = await query(http, base, PROMPT, instance_id="a")
    assert answer["default"]["a"]["GPU"] == 24
    # an instance down: its routed prompts no longer count
    down = {"instance_id": "a", "reason": "test", "ttl_s": 30}
    assert (await post(http, f"{base}/instance_down", down))[0] == 200
    assert await matched(http, base, PROMPT, "a") == 0


async def test_msgpack_reports_and_bad_reports(served, http, publisher_factory):
    base = served.url
    await register_and_connect(http, base, publisher_factory(), "a")
    body = routed("a", [], token_ids=token_bytes(PROMPT))  # packed int32, as routers send
    async with http.post(
        f"{base}/routed",
        data=msgpack.packb(body),
        headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"},
    ) as response:
        assert response.status == 200
        assert msgpack.unpackb(await response.read()) == {"status": "recorded"}
    assert await matched(http, base, PROMPT, "a") == 24

    status, answer = await post(http, f"{base}/routed", routed("a", [1, 2]))
    assert (status, answer) == (200, {"status": "no complete block"})
    assert await metric(http, base, 'conductor_routed_reports_total{outcome="no_block"}') == 1
    for bad, field in (
        ({k: v for k, v in routed("a", PROMPT).items() if k != "instance_id"}, None),
        (routed("a", PROMPT, ttl_s=0), "ttl_s"),
        (routed("a", PROMPT, ttl_s=3600), "ttl_s"),
        (routed("a", ["x"]), "token_ids"),
    ):
        status, answer = await post(http, f"{base}/routed", bad)
        assert status == 400, bad
        assert field is None or answer["field"] == field
        assert field is not None or "instance_id" in answer["error"]
    status, answer = await post(http, f"{base}/routed", routed("a", [1] * 131_073))
    assert (status, answer["field"]) == (413, "token_ids")  # as /query's limit


def test_the_table_is_bounded_and_counts_what_it_pushed_out() -> None:
    now = [0.0]
    table = RoutedPrompts(max_entries=3, clock=lambda: now[0])

    def report(instance_id: str, first: int) -> None:
        tokens = [first, 2, 3, 4, 5, 6, 7, 8]
        request = RoutedRequest(
            model="m", block_size=4, token_ids=token_bytes(tokens), instance_id=instance_id
        )
        assert table.add(request)

    key = RoutedRequest(model="m", block_size=4, token_ids=b"", instance_id="a").context_key()
    for first in range(5):
        report(f"i{first}", first)
    assert len(table) == 3 and table.dropped == 2
    assert table.match(key, token_bytes([4, 2, 3, 4, 5, 6, 7, 8]), "") == {"i4": 2}
    assert table.match(key, token_bytes([0, 2, 3, 4]), "") == {}  # pushed out
    now[0] = 10.0  # past the default time: expired, not dropped
    report("i5", 5)
    assert len(table) == 1 and table.dropped == 2


def test_the_table_holds_at_most_max_hashes_block_hashes() -> None:
    """A report may carry a maximum-size prompt: the hashes in all are bounded too."""
    table = RoutedPrompts(max_hashes=5)
    key = RoutedRequest(model="m", block_size=4, token_ids=b"", instance_id="a").context_key()
    for first in range(3):  # two blocks each: the third pushes the first out
        tokens = token_bytes([first, 2, 3, 4, 5, 6, 7, 8])
        assert table.add(RoutedRequest(model="m", block_size=4, token_ids=tokens, instance_id="a"))
    assert len(table) == 2 and table.dropped == 1
    assert table.match(key, token_bytes([0, 2, 3, 4, 5, 6, 7, 8]), "") == {}
    assert table.match(key, token_bytes([2, 2, 3, 4, 5, 6, 7, 8]), "") == {"a": 2}
