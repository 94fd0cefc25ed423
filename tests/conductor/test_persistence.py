"""Registrations made over /register survive a restart, and the index refills from the
publishers' replay buffers without any new traffic."""

from __future__ import annotations

import asyncio
import json
import shutil

from conductor import persistence
from conductor.config import Registration
from tests.support.api import eventually, get, matched, post, query, register_and_connect
from tests.support.processes import ConductorProcess
from tests.support.wire_publisher import stored

PROMPT = list(range(1, 13))


def state_file(conductor: ConductorProcess, tmp_path) -> object:
    return tmp_path / f"conductor_state.{conductor.url.rsplit(':', 1)[1]}.json"


async def test_a_restarted_conductor_keeps_registrations_and_refills(
    conductor_factory, http, publisher_factory, tmp_path, request
):
    first = conductor_factory()
    port = int(first.url.rsplit(":", 1)[1])
    publisher, gone = publisher_factory(), publisher_factory()
    await register_and_connect(http, first.url, publisher, "engine-a")
    await register_and_connect(http, first.url, gone, "engine-b")
    assert (await post(http, f"{first.url}/unregister", {"instance_id": "engine-b"}))[0] == 200
    await publisher.publish([stored([101, 102, 103], PROMPT)])
    await eventually(lambda: matched(http, first.url, PROMPT, "engine-a"), lambda n: n == 12)
    saved = json.loads(state_file(first, tmp_path).read_text())
    assert [r["instance_id"] for r in saved["registrations"]] == ["engine-a"]
    first.stop()

    second = ConductorProcess(tmp_path, port=port)  # same directory and port: same state file
    request.addfinalizer(second.stop)
    second.wait_ready()
    _, services = await get(http, f"{second.url}/services")
    assert [s["InstanceID"] for s in services["services"]] == ["engine-a"]
    await eventually(lambda: matched(http, second.url, PROMPT, "engine-a"), lambda n: n == 12)


async def test_a_second_conductor_with_the_same_registrations_answers_identically(
    conductor_factory, http, publisher_factory, tmp_path
):
    first = conductor_factory()
    publishers = [publisher_factory() for _ in range(2)]
    for number, publisher in enumerate(publishers):
        await register_and_connect(http, first.url, publisher, f"engine-{number}")
    await publishers[0].publish([stored([101, 102, 103], PROMPT)])
    await publishers[1].publish([stored([201], PROMPT[:4])])
    expected = await eventually(
        lambda: query(http, first.url, PROMPT),
        lambda a: a["default"]["engine-0"]["GPU"] == 12 and a["default"]["engine-1"]["GPU"] == 4,
    )
    copy = tmp_path / "copy" / "state.json"
    copy.parent.mkdir()
    shutil.copy(state_file(first, tmp_path), copy)
    second = conductor_factory("--state-file", str(copy))
    await eventually(lambda: query(http, second.url, PROMPT), lambda a: a == expected)


async def test_a_conflicting_persisted_entry_is_skipped(conductor_factory, http, tmp_path):
    entry = {
        "endpoint": "tcp://127.0.0.1:1",
        "type": "vLLM",
        "modelname": "m",
        "instance_id": "a",
        "block_size": 4,
    }
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"version": 1, "registrations": [{**entry, "block_size": 8}]}))
    conductor = conductor_factory(
        "--state-file", str(state), config={"kvevent_instance": {"a": entry}}
    )
    _, services = await get(http, f"{conductor.url}/services")
    assert [s["BlockSize"] for s in services["services"]] == [4]
    assert "skipped a|default|0" in conductor.log()


def test_a_corrupt_state_file_stops_start_up_naming_it(tmp_path):
    from tests.conductor.test_cli import run_conductor

    state = tmp_path / "state.json"
    state.write_text("{half")
    result = run_conductor("--state-file", str(state), config_dir=tmp_path)
    assert result.returncode != 0 and str(state) in result.stderr, result.stderr


async def test_registrations_made_together_share_writes_and_all_persist(tmp_path, monkeypatch):
    """1,000 engines registering at once must not rewrite a growing file 1,000 times (it
    made registration O(n^2)); every registration is still on disk when its call returns."""
    writes: list[int] = []
    real_write = persistence._write_json

    def counting_write(path, data) -> None:
        writes.append(len(data["registrations"]))
        real_write(path, data)

    monkeypatch.setattr(persistence, "_write_json", counting_write)
    state = persistence.StateFile(tmp_path / "state.json")
    registrations = [
        Registration.model_validate(
            {
                "endpoint": f"tcp://127.0.0.1:{6000 + n}",
                "type": "vLLM",
                "modelname": "m",
                "block_size": 16,
                "instance_id": f"e{n}",
            }
        )
        for n in range(200)
    ]
    await asyncio.gather(*(state.add(r) for r in registrations))
    assert len(writes) < 10 and writes[-1] == 200
    await state.remove(registrations[0].key)
    restored = persistence.StateFile(tmp_path / "state.json").load()
    assert sorted(restored, key=lambda r: r.key) == sorted(registrations[1:], key=lambda r: r.key)


async def test_a_symlink_at_the_old_temporary_name_is_not_followed(
    conductor_factory, http, tmp_path
):
    """The state was written through the fixed name ``.<file>.tmp``, which open() followed:
    a symlink planted there made the conductor overwrite the file it pointed at."""
    state = tmp_path / "state.json"
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / ".state.json.tmp").symlink_to(target)
    conductor = conductor_factory("--state-file", str(state))
    body = {
        "endpoint": "tcp://127.0.0.1:5557",
        "type": "vLLM",
        "modelname": "m",
        "block_size": 16,
        "instance_id": "engine-a",
    }
    assert (await post(http, f"{conductor.url}/register", body))[0] == 200
    assert target.read_text() == "keep me"
    saved = json.loads(state.read_text())["registrations"]
    assert [entry["instance_id"] for entry in saved] == ["engine-a"]
    assert sorted(path.name for path in tmp_path.glob(".state.json*")) == [".state.json.tmp"]
