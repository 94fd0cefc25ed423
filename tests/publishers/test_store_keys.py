"""The store's layout as vLLM's MooncakeStoreConnector writes it, and the config file it
reads: pinned against the capture of a real connector (no store needed)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest

from publishers.engine.block_hash import BlockHasher
from publishers.mooncake_store import (
    MIB,
    MooncakeConfig,
    StoreAddress,
    block_key,
    connector_config,
    key_event_hash,
    model_key_name,
    parse_block_key,
    parse_size,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURE = json.loads((FIXTURES / "vllm_store_connector_capture.json").read_text())
STORED_KEYS = CAPTURE["master_admin"]["/get_all_keys"]["body"].split()


def announced_cpu_hashes() -> set[int]:
    """Every block hash the connector announced with medium "cpu" in the capture."""
    hashes = set()
    for step in CAPTURE["steps"]:
        for frames in step["frames"].values():
            for frame in frames:
                _, events, _ = msgpack.unpackb(base64.b64decode(frame["payload_b64"]))
                hashes |= {h for e in events if e["medium"] == "cpu" for h in e["block_hashes"]}
    return hashes


def test_keys_are_the_connectors_and_name_the_announced_hashes() -> None:
    prompt = CAPTURE["steps"][2]["prompt_token_ids"]  # the longest: all five saved blocks
    digests = BlockHasher("sha256", "0").block_digests(prompt, CAPTURE["block_size"])
    model = model_key_name(f"/models/{CAPTURE['model_path_basename']}/")
    assert {block_key(model, digest) for digest in digests} == set(STORED_KEYS)
    assert {key_event_hash(key) for key in STORED_KEYS} == announced_cpu_hashes()
    parsed = parse_block_key(STORED_KEYS[0])
    assert parsed.model_name == "tiny-model0" and len(parsed.digest) == 32


@pytest.mark.parametrize(
    "key",
    ["nope", "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@xyz", "m@tp_rank:1@group:0@" + "ab" * 32],
)
def test_other_keys_are_refused_clearly(key: str) -> None:
    with pytest.raises(ValueError, match="not a KV block key"):
        parse_block_key(key)


def test_the_config_file_follows_vllms_rules(tmp_path: Path) -> None:
    address = StoreAddress("127.0.0.1:50051", "http://127.0.0.1:8080/metadata")
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(connector_config(address, 128 * MIB)))
    config = MooncakeConfig.from_file(path)
    assert (config.address, config.mode, config.local_buffer_size) == (
        address,
        "standalone-store",
        128 * MIB,
    )
    assert parse_size("256MB") == 256 * MIB and parse_size("1.5 kb") == 1536
    for wrong in (
        {"mode": "standalone-store", "global_segment_size": "1GB"},  # the store lends memory
        {"mode": "embedded", "global_segment_size": 0},
        {"local_buffer_size": "lots"},
    ):
        path.write_text(json.dumps(connector_config(address, MIB) | wrong))
        with pytest.raises(ValueError, match="mooncake.json"):
            MooncakeConfig.from_file(path)


def test_the_config_path_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ValueError, match="MOONCAKE_CONFIG_PATH"):
        MooncakeConfig.from_env()
