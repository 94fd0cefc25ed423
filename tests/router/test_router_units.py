"""Router pieces without sockets: config layouts, load accounting, learning, parsing."""

from __future__ import annotations

import argparse
import json

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from conductor.config import load_config
from router import config as router_config
from router import disagg
from router.app import Router
from router.conductor_client import parse_hits, parse_store_states
from router.engine_metrics import engine_in_flight, parse_metrics
from router.keys import KeyRing
from router.policy import POLICIES, REGISTRY, PrefillCostModel
from router.pool import CostLearner, InstancePool
from router.store_loads import StoreLoads, store_loads
from router.upkeep import served_models
from tests.conftest import REPO
from tests.router.inprocess import layout
from tests.router.vllm_metrics import VllmStoreMetrics


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router_config.add_cli_flags(parser)
    return parser.parse_args(argv)


def test_example_multi_model_config_loads():
    path = REPO / "config" / "router-models.json"
    config = router_config.load(parse(["--config", str(path)]))
    models = config.served_models()
    assert [(m.modelname, m.adapters, m.default) for m in models] == [
        ("tiny-llama", ["tiny-sql"], True),
        ("tiny-chat", [], False),
    ]
    assert (models[0].routing.ttft_slo_ms, models[1].routing.policy) == (30000, "kv_cost")
    assert models[1].routing.ttft_slo_ms == 30000  # inherited key by key
    assert KeyRing(REPO / str(config.keys.file), CollectorRegistry()).enabled


def test_example_config_loads():
    config = router_config.load(parse(["--config", str(REPO / "config" / "router.json")]))
    assert config.prefill is not None
    assert [i.instance_id for i in config.prefill.instances] == ["engine-0", "engine-1"]
    params = config.served_models()[0].routing_params()
    assert params.policy == "ttft" and params.ttft_slo_s == 30.0
    assert params.balance_threshold is None and params.block_size == 16
    assert config.kv_stores() == {}  # no store: balancing is off whatever the default
    assert params.ttft_slack == 0.5


def test_example_configs_name_each_engine_the_same_way():
    """The router re-registers what the conductor's example config lists: the two must
    agree field for field, or the conductor answers 409 every re-registration."""
    router = router_config.load(parse(["--config", str(REPO / "config" / "router.json")]))
    conductor = load_config(REPO / "config" / "conductor_config.json")
    model = router.prefill.config
    expected = {
        instance.instance_id: (stream.endpoint, stream.replay_endpoint, stream.dp_rank)
        for instance in router.prefill.instances
        for stream in instance.registrations
    }
    listed = {}
    for registration in conductor.registrations():
        assert (registration.modelname, registration.block_size) == (
            model.modelname,
            model.block_size,
        )
        listed[registration.instance_id] = (
            registration.endpoint,
            registration.replay_endpoint,
            registration.dp_rank,
        )
    assert listed == expected


def test_upstream_proxy_layout_with_hash_profile_is_accepted(tmp_path):
    upstream = {
        "conductor": {"address": "127.0.0.1:13333", "query_timeout_seconds": 1},
        "prefill": {
            "config": {
                "modelname": "m",
                "block_size": 64,
                "hash_profile": {"algorithm": "sha256_cbor"},
            },
            "instances": [
                {
                    "instance_id": "p",
                    "http_endpoint": "http://h:1",
                    "registrations": [{"endpoint": "tcp://h:2", "dp_rank": 0}],
                }
            ],
        },
        "decode": {"instances": [{"http_endpoint": "http://h:3"}]},
    }
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps(upstream))
    config = router_config.load(parse(["--config", str(path)]))
    assert config.conductor.address == "http://127.0.0.1:13333"
    assert config.routing.policy == "ttft"
    assert config.decode.instances[0].http_endpoint == "http://h:3"


def test_cli_flags_build_the_same_layout():
    args = parse(
        "--prefiller-hosts 127.0.0.1 127.0.0.1 --prefiller-ports 8100 8101 --modelname m "
        "--prefiller-instance-ids a b --prefiller-registration a 0 tcp://127.0.0.1:5557 "
        "--decoder-hosts 127.0.0.1 --decoder-ports 8200 --policy kv_cost".split()
    )
    config = router_config.load(args)
    assert [i.http_endpoint for i in config.prefill.instances] == [
        "http://127.0.0.1:8100",
        "http://127.0.0.1:8101",
    ]
    assert config.prefill.instances[0].registrations[0].endpoint == "tcp://127.0.0.1:5557"
    assert config.prefill.instances[1].registrations == []
    assert config.routing.policy == "kv_cost"


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--prefiller-hosts", "h", "--prefiller-ports", "1", "2", "--modelname", "m"], "pair"),
        (["--modelname", "m"], "--config"),
        (
            [
                "--prefiller-hosts",
                "h",
                "--prefiller-ports",
                "1",
                "--modelname",
                "m",
                "--prefiller-registration",
                "ghost",
                "0",
                "tcp://h:1",
            ],
            "unknown instance",
        ),
    ],
)
def test_bad_cli_is_a_clear_error(argv, reason):
    with pytest.raises(ValueError, match=reason):
        router_config.load(parse(argv))


def test_bad_routing_section_names_the_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {
                "prefill": {
                    "config": {"modelname": "m", "block_size": 16},
                    "instances": [{"instance_id": "a", "http_endpoint": "http://h:1"}],
                },
                "routing": {"policy": "fastest"},
            }
        )
    )
    with pytest.raises(router_config.ConfigError, match=r"bad.json: routing.policy: must be one"):
        router_config.load(parse(["--config", str(path)]))


def test_config_and_cli_accept_the_registered_policies():
    assert POLICIES == ("round_robin", "least_loaded", "max_prefix", "kv_cost", "ttft")
    parser = argparse.ArgumentParser()
    router_config.add_cli_flags(parser)
    flag = next(action for action in parser._actions if action.dest == "policy")
    assert list(flag.choices or ()) == list(REGISTRY)
    for policy in REGISTRY.values():
        assert policy.describe() in (flag.help or "")
        assert set(policy.parameters) <= set(router_config.RoutingSection.model_fields)
        section = router_config.RoutingSection.model_validate({"policy": policy.name})
        assert section.policy == policy.name


def test_tickets_account_load_exactly_once():
    pool = InstancePool.build([("a", "http://a"), ("b", "http://b")])
    upstream = pool.prefill["a"]
    ticket = pool.claim(upstream, 1000)
    assert (upstream.in_flight, upstream.queued_prefill_tokens) == (1, 1000)
    ticket.first_token()
    ticket.first_token()
    assert upstream.queued_prefill_tokens == 0
    ticket.release()
    ticket.release()
    assert upstream.in_flight == 0


def test_failed_upstreams_leave_rotation_until_probed():
    pool = InstancePool.build([("a", "http://a"), ("b", "http://b")])
    pool.mark_failed(pool.prefill["a"], now=100.0)
    assert [c.instance_id for c in pool.candidates({})] == ["b"]
    assert pool.due_for_probe(now=100.5) == []
    assert [u.instance_id for u in pool.due_for_probe(now=101.5)] == ["a"]
    assert [c.instance_id for c in pool.candidates({}, out_of_rotation=True)] == ["a"]
    pool.mark_healthy(pool.prefill["a"])
    assert len(pool.candidates({"a": (16, 32, 48)})) == 2
    assert pool.candidates({"a": (16, 32, 48)})[0].disk_tokens == 48


def test_a_model_is_unknown_only_when_every_upstream_that_could_serve_it_said_so():
    pool = InstancePool.build([("a", "http://a")], [("d", "http://d")])
    a, d = pool.prefill["a"], pool.decode["d"]
    assert not pool.serves_nowhere("x") and pool.served_models() == []  # nothing learned
    a.models = ({"id": "m"},)
    assert not pool.serves_nowhere("x")  # "d" is up and has not said what it serves
    d.models = ({"id": "m"}, {"id": "alias"})
    assert pool.serves_nowhere("x") and not pool.serves_nowhere("alias")
    assert [card["id"] for card in pool.served_models()] == ["m", "alias"]
    pool.mark_failed(d)  # down: its list is forgotten and it cannot serve anyway
    assert d.models is None and pool.serves_nowhere("alias")
    pool.mark_healthy(d)  # back, not yet re-learned: never reject on an unknown list
    assert not pool.serves_nowhere("alias")


def test_a_model_is_looked_for_among_its_base_models_upstreams_alone():
    pool = InstancePool.build([("a", "http://a"), ("b", "http://b")], models={"a": "m", "b": "n"})
    pool.prefill["a"].models = ({"id": "m"},)
    assert pool.serves_nowhere("x", "m")  # "b" has not said, but it serves "n"
    assert not pool.serves_nowhere("x") and not pool.serves_nowhere("m", "m")
    pool.prefill["b"].models = ({"id": "n"},)
    assert pool.serves_nowhere("m", "n") and pool.serves_nowhere("x")


def test_a_request_goes_only_where_its_model_may_be_served():
    pool = InstancePool.build([("a", "http://a"), ("b", "http://b"), ("c", "http://c")])
    pool.prefill["a"].models = ({"id": "m"},)
    pool.prefill["b"].models = ({"id": "other"},)  # "c" has not said: it may
    assert [c.instance_id for c in pool.candidates({}, "m")] == ["a", "c"]
    assert [c.instance_id for c in pool.candidates({}, "other")] == ["b", "c"]
    assert len(pool.candidates({})) == 3


def test_served_models_from_a_v1_models_answer():
    answer = {"object": "list", "data": [{"id": "m", "max_model_len": 8}, {"id": 3}, "junk"]}
    assert served_models(answer) == ({"id": "m", "max_model_len": 8},)
    assert served_models({"data": None}) == served_models([]) == ()


def test_engine_reported_load_counts_when_higher():
    pool = InstancePool.build([("a", "http://a")])
    pool.prefill["a"].engine_in_flight = 7
    assert pool.candidates({})[0].in_flight == 7


def test_cost_learner_converges_to_observed_speed():
    learner = CostLearner(PrefillCostModel(overhead_s=0.0, per_token_s=1e-3), weight=0.3)
    for _ in range(40):
        learner.observe(new_tokens=1000, queued_tokens=1000, ttft_s=0.2)  # 1e-4 s/token
    assert learner.model.per_token_s == pytest.approx(1e-4, rel=0.01)
    learner.observe(0, 0, 1.0)  # nothing to learn from
    assert learner.samples == 40


def test_parse_hits_understands_both_conductor_shapes():
    go = {"default": {"a": {"longest_matched": 48, "GPU": 16, "CPU": 32, "DISK": 48, "DP": {}}}}
    cpp = {"instances": {"a": {"gpu": 16, "cpu": 32, "disk": 48, "longest_matched": 48}}}
    assert parse_hits(go, "default") == parse_hits(cpp, "default") == {"a": (16, 32, 48)}
    assert parse_hits({"other": {}}, "default") == {}
    assert parse_hits({"default": {"a": "junk", "b": {"GPU": 4}}}, "default") == {"b": (4, 4, 4)}


def test_engine_in_flight_from_vllm_metrics():
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{model_name="m"} 2.0\n'
        "vllm:gpu_cache_usage_perc 0.5\n"
    )
    assert engine_in_flight(parse_metrics(text)[0]) == (5, 0)


def test_engine_in_flight_from_sglang_metrics():
    """SGLang 0.5.23 with --enable-metrics names the same two numbers its own way."""
    labels = 'engine_type="unified",model_name="tiny-llama",pp_rank="0",tp_rank="0"'
    text = (
        "# HELP sglang:num_running_reqs The number of running requests.\n"
        f"sglang:num_running_reqs{{{labels}}} 1.0\n"
        f"sglang:num_queue_reqs{{{labels}}} 4.0\n"
        f"sglang:token_usage{{{labels}}} 0.25\n"
    )
    assert engine_in_flight(parse_metrics(text)[0]) == (5, 0)


def test_disaggregation_requests():
    body = {
        "model": "m",
        "prompt": "hi",
        "stream": True,
        "max_tokens": 50,
        "stream_options": {"include_usage": True},
    }
    prefill = disagg.prefill_request(body)
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    params = disagg.transfer_params({"kv_transfer_params": {"remote_engine_id": "e"}})
    decode = disagg.decode_request(body, params)
    assert decode["kv_transfer_params"] == {"remote_engine_id": "e"}
    assert decode["stream"] is True and decode["max_tokens"] == 50
    assert disagg.transfer_params({"choices": []}) == {}


def store_config(tmp_path, routing: dict, kv_store: str = "") -> router_config.RouterConfig:
    instance = {"instance_id": "a", "http_endpoint": "http://h:1", "kv_store": kv_store}
    path = tmp_path / "store.json"
    path.write_text(
        json.dumps(
            {
                "prefill": {
                    "config": {"modelname": "m", "block_size": 16},
                    "instances": [instance],
                },
                "routing": routing,
            }
        )
    )
    return router_config.load(parse(["--config", str(path)]))


def test_balancing_without_a_store_is_rejected_naming_kv_store(tmp_path):
    with pytest.raises(
        router_config.ConfigError, match="balance_threshold needs a KV transfer path: set kv_store"
    ):
        store_config(tmp_path, {"balance_threshold": 2})
    assert store_config(tmp_path, {"balance_threshold": "inf"}).kv_stores() == {}  # off is fine
    config = store_config(tmp_path, {"balance_threshold": 2}, kv_store="127.0.0.1:50051")
    assert config.served_models()[0].routing_params().balance_threshold == 2
    assert config.kv_stores() == {"a": "127.0.0.1:50051"}
    assert (
        store_config(tmp_path, {}, kv_store="127.0.0.1:50051")
        .served_models()[0]
        .routing_params()
        .balance_threshold
        is None
    )
    with pytest.raises(router_config.ConfigError, match="kv_store"):
        store_config(tmp_path, {}, kv_store="127.0.0.1")
    with pytest.raises(router_config.ConfigError, match="store_bandwidth_bytes_s"):
        store_config(tmp_path, {"cost": {"store_bandwidth_bytes_s": 0}}, kv_store="h:1")


def test_an_instance_whose_store_is_down_has_its_gpu_hit_alone():
    pool = InstancePool.build(
        [("a", "http://a"), ("b", "http://b"), ("c", "http://c")],
        kv_stores={"a": "s:1", "b": "s:2"},
    )
    hits = {name: (16, 48, 64) for name in "abc"}
    pool.stores_down.add("s:2")
    found = {
        c.instance_id: (c.gpu_tokens, c.cpu_tokens, c.disk_tokens, c.store)
        for c in pool.candidates(hits)
    }
    assert found == {"a": (16, 48, 64, True), "b": (16, 16, 16, False), "c": (16, 48, 64, False)}


def test_store_cost_is_learned_from_the_engines_store_loads():
    learner = CostLearner(PrefillCostModel(), weight=0.2)
    for _ in range(30):  # 1 KiB per token read at 20 MB/s, as a small model over loopback TCP
        learner.observe_store_loads(StoreLoads(tokens=1000, bytes=1_024_000, seconds=0.0512))
    learner.observe_store_loads(StoreLoads(tokens=0, bytes=0, seconds=0))  # an idle scrape
    assert learner.store_samples == 30
    assert learner.model.store_bytes_per_token == pytest.approx(1024)
    assert learner.model.store_bandwidth_bytes_s == pytest.approx(20e6)
    assert learner.model.store_load_s(1000) == pytest.approx(0.0512)
    big = StoreLoads(tokens=100_000, bytes=102_400_000, seconds=1.024)  # 100 MB/s
    learner.observe_store_loads(big)
    assert 80e6 < learner.model.store_bandwidth_bytes_s < 100e6  # weighted by bytes moved


def test_store_loads_are_read_from_vllm_metrics():
    metrics = VllmStoreMetrics()
    metrics.load(tokens=128, nbytes=131072, seconds=0.008, reads=2)
    assert store_loads(metrics.text()) == StoreLoads(128, 131072, 0.008)
    nothing_loaded = CollectorRegistry()
    Counter("vllm:external_prefix_cache_hits", "hits", registry=nothing_loaded)
    assert store_loads(generate_latest(nothing_loaded).decode()) == StoreLoads(0, 0, 0)
    assert store_loads("sglang:cache_hit_rate 0.5\n") is None  # no vLLM engine
    assert store_loads("vllm:x{ 1\n") is None  # does not parse
    now = StoreLoads(228, 231072, 0.5)
    assert now.since(StoreLoads(128, 131072, 0.25)) == StoreLoads(100, 100000, 0.25)
    assert now.since(None) is None
    assert StoreLoads(5, 10, 0.1).since(now) is None  # the engine restarted


def test_store_states_from_the_conductors_health():
    health = {
        "status": "degraded",
        "kv_stores": {
            "127.0.0.1:1": {"blocks": 3, "state": "up", "checked_s_ago": 0.4},
            "127.0.0.1:2": {"blocks": 0, "state": "down", "checked_s_ago": 0.1},
            "127.0.0.1:3": {"blocks": 0, "state": "unchecked", "checked_s_ago": None},
            "127.0.0.1:4": 17,  # an older conductor: block counts only
            "127.0.0.1:5": {"state": "on fire"},
        },
    }
    assert parse_store_states(health) == {
        "127.0.0.1:1": "up",
        "127.0.0.1:2": "down",
        "127.0.0.1:3": "unchecked",
        "127.0.0.1:4": "unchecked",
        "127.0.0.1:5": "unchecked",
    }
    assert parse_store_states({"status": "ok"}) == parse_store_states([]) == {}


@pytest.mark.parametrize(("policy", "forgone"), [("max_prefix", 0), ("round_robin", 32 + 64 + 32)])
def test_a_longer_prefix_left_elsewhere_is_counted_as_forgone(policy, forgone):
    """``router_cache_forgone_tokens_total``: the tokens by which the longest hit on any
    tier (capped at the prompt) exceeds the chosen instance's hit, per decision."""
    config = layout(["http://127.0.0.1:9", "http://127.0.0.1:10"], routing={"policy": policy})
    router = Router(router_config.RouterConfig.model_validate(config))
    hits = {"e0": (32, 64, 64), "e1": (0, 0, 0)}
    decider = router.catalog.default.decider
    candidates = decider.candidates(hits, set())
    chosen = [decider.decide(100, candidates, None).instance_id for _ in range(3)]
    assert chosen == (["e0"] * 3 if policy == "max_prefix" else ["e0", "e1", "e0"])
    # round robin takes e0's GPU hit alone (32 of its 64), and e1's nothing
    registry = router.metrics.registry
    assert registry.get_sample_value("router_cache_forgone_tokens_total") == forgone


def model(name: str, *instances: str, **settings: object) -> dict:
    return {
        "modelname": name,
        "block_size": 16,
        "instances": [{"instance_id": i, "http_endpoint": f"http://{i}:1"} for i in instances],
        **settings,
    }


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({}, "give the served models: `models`, or `prefill` for one model"),
        (
            {
                "models": [model("a", "x")],
                "prefill": json.loads(json.dumps(layout(["http://h:1"])["prefill"])),
            },
            "give `prefill` (one model) or `models`, not both",
        ),
        (
            {"models": [model("a", "x"), model("a", "y")]},
            "model and adapter names must be unique: a",
        ),
        (
            {"models": [model("a", "x", adapters=["b"]), model("b", "y")]},
            "model and adapter names must be unique: b",
        ),
        ({"models": [model("a", "x"), model("b", "x")]}, "instance_id values must be unique: x"),
        (
            {"models": [model("a", "x", default=True), model("b", "y", default=True)]},
            "at most one model can be the default",
        ),
        (
            {"models": [model("a", "x")], "decode": {"instances": [{"http_endpoint": "http://d"}]}},
            "each model lists its own `decode` instances",
        ),
        ({"models": [model("a", "x", routing={"policy": "nope"})]}, "models.0.routing.policy"),
    ],
)
def test_a_models_list_that_cannot_be_served_names_the_problem(tmp_path, config, reason):
    path = tmp_path / "router.json"
    path.write_text(json.dumps(config))
    with pytest.raises(router_config.ConfigError) as error:
        router_config.load(parse(["--config", str(path)]))
    assert reason in str(error.value)
