"""Fleet files with several models, LoRA adapters and a keys file: what the spec refuses, what
the plan gives the engines and the router, and a simulated fleet of two models through
``mooncake-fleet up``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from conductor.config import one_line
from fleet.plan import make_plan
from fleet.spec import FleetSpec, load
from fleet.tiny_model import LORA_NAME, lora_adapter_dir, write_tiny_model
from router.config import RouterConfig
from tests.support.api import eventually
from tests.support.fleet import FleetProcess

REPO = Path(__file__).resolve().parents[2]
SIM_MODELS = REPO / "config" / "fleet-sim-models.json"
LORA_FLEET = REPO / "config" / "fleet-lora.json"
KEYS_EXAMPLE = REPO / "config" / "keys-example.json"
# config/keys-example.json's keys: one may use tiny-llama and its adapter, one tiny-chat, one
# (the file holds its SHA-256) every model
LLAMA_KEY, CHAT_KEY, ANY_KEY = "sk-example-acme", "sk-example-chat", "sk-example-batch"
LLAMA_ENGINES, CHAT_ENGINES = {"llama-0", "llama-1"}, {"chat-0", "chat-1"}

TWO_MODELS: dict[str, Any] = {
    "models": [{"name": "a"}, {"name": "b"}],
    "engines": [
        {"name": "a-0", "kind": "sim", "model": "a"},
        {"name": "b-0", "kind": "sim", "model": "b"},
    ],
}


def _problem(spec: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as error:
        FleetSpec.model_validate(spec)
    return one_line(error.value)


def _models(*models: dict[str, Any]) -> dict[str, Any]:
    return {**TWO_MODELS, "models": list(models)}


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            {
                **TWO_MODELS,
                "engines": [*TWO_MODELS["engines"], {"name": "x", "kind": "sim", "model": "c"}],
            },  # fmt: skip
            "engines.2.model: no model `c` in the fleet (it serves a, b)",
        ),
        (_models({"name": "a"}, {"name": "a"}), "model and adapter names must be unique: a"),
        (
            _models({"name": "a", "adapters": {"b": "lora/b"}}, {"name": "b"}),
            "model and adapter names must be unique: b",
        ),
        (
            _models({"name": "a"}, {"name": "b"}, {"name": "c"}),
            'models.2: no engine serves `c` (an engine says so with "model": "c")',
        ),
        (
            _models({"name": "a", "default": True}, {"name": "b", "default": True}),
            "models: at most one model can be the default",
        ),
        (
            {**TWO_MODELS, "model": {"name": "a"}},
            "give `model` (one model) or `models`, not both",
        ),
        (
            {
                **_models({"name": "a", "adapters": {"a-sql": "lora/a-sql"}}, {"name": "b"}),
                "engines": [
                    {"name": "s", "kind": "sglang", "model": "a"},
                    {"name": "b-0", "kind": "sim", "model": "b"},
                ],
            },
            "engines.0: sglang engine `s` cannot serve the LoRA adapters of `a`: the fleet "
            "runs LoRA on vllm and sim engines only",
        ),
        (
            {
                **_models({"name": "a", "block_size": 16}, {"name": "b"}),
                "engines": [
                    {"name": "a-0", "kind": "vllm", "model": "a"},
                    {"name": "b-0", "kind": "vllm", "model": "b"},
                ],
            },
            "engines.0: vLLM on CPU needs a block_size multiple of 32, not 16",
        ),
        (
            _models({"name": "a", "max_lora_rank": 12}, {"name": "b"}),
            "models.0.max_lora_rank: must be one of 1, 8, 16",
        ),
        (
            _models({"name": "a", "adapters": {"a b": "x"}}, {"name": "b"}),
            "models.0.adapters.a b.[key]: String should match pattern",
        ),
        (
            _models({"name": "a", "routing": {"policy": "fastest"}}, {"name": "b"}),
            "models.0.routing.policy: must be one of",
        ),
        (
            {"model": {"name": "a", "adapters": {}}, "engines": [{"name": "x", "kind": "sim"}]},
            "model.adapters: unknown key",
        ),
    ],
)
def test_fleet_model_mistakes_name_the_field(spec: dict[str, Any], reason: str) -> None:
    assert reason in _problem(spec)


def test_the_keys_file_is_found_beside_the_fleet_file_and_checked(tmp_path: Path) -> None:
    assert load(SIM_MODELS).keys == KEYS_EXAMPLE
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(json.dumps({**TWO_MODELS, "keys": "keys.json"}))
    with pytest.raises(ValidationError) as error:
        load(fleet_file)
    assert one_line(error.value).startswith(f"keys: cannot read {tmp_path / 'keys.json'}: ")
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{"id": "k", "key": "s", "x": 1}]}))
    with pytest.raises(ValidationError) as error:
        load(fleet_file)
    assert one_line(error.value) == f"keys: {tmp_path / 'keys.json'}: keys.0.x: unknown key"
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{"id": "k", "key": "s"}]}))
    assert load(fleet_file).keys == tmp_path / "keys.json"


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_each_engine_serves_its_model_and_the_router_lists_every_model(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    plan = make_plan(load(SIM_MODELS), tmp_path / "run", model_dir)
    engines = {engine.name: engine for engine in plan.engines}
    adapter = f"{LORA_NAME}={lora_adapter_dir(model_dir)}"
    for name in LLAMA_ENGINES:
        argv = engines[name].argv
        assert (_flag(argv, "--served-model-name"), _flag(argv, "--block-size")) == (
            "tiny-llama",
            "32",
        )
        assert "--enable-lora" in argv and _flag(argv, "--lora-modules") == adapter
        assert _flag(argv, "--max-lora-rank") == "8"
        assert _flag(argv, "--tokenizer") == str(model_dir)
        assert engines[name].details == {"model": "tiny-llama"}
    for name in CHAT_ENGINES:
        argv = engines[name].argv
        assert (_flag(argv, "--served-model-name"), _flag(argv, "--block-size")) == (
            "tiny-chat",
            "16",
        )
        assert "--enable-lora" not in argv and "--tokenizer" not in argv

    router = json.loads((tmp_path / "run" / "router.json").read_text())
    RouterConfig.model_validate(router)  # the router takes it as it is
    assert "prefill" not in router and router["routing"] == {"policy": "ttft"}
    assert router["keys"] == {"file": str(KEYS_EXAMPLE)}
    llama, chat = router["models"]
    assert {i["instance_id"] for i in llama["instances"]} == LLAMA_ENGINES
    assert {i["instance_id"] for i in chat["instances"]} == CHAT_ENGINES
    for instance in llama["instances"] + chat["instances"]:  # registered per engine
        engine = engines[instance["instance_id"]]
        assert instance["http_endpoint"] == engine.url
        assert instance["registrations"] == [
            {
                "endpoint": engine.events_endpoint,
                "replay_endpoint": engine.replay_endpoint,
                "type": "vLLM",
            }
        ]
    assert {k: v for k, v in llama.items() if k != "instances"} == {
        "modelname": "tiny-llama",
        "block_size": 32,
        "adapters": [LORA_NAME],
        "default": True,
        "routing": {},
        "tokenizer": {"path": str(model_dir)},
    }
    assert {k: v for k, v in chat.items() if k != "instances"} == {
        "modelname": "tiny-chat",
        "block_size": 16,
        "adapters": [],
        "default": False,
        "routing": {"policy": "least_loaded"},
        "max_concurrent_requests": 4,
        "max_queued_requests": 64,
    }


def test_real_vllm_serves_the_tiny_models_adapter(tmp_path: Path) -> None:
    spec = load(LORA_FLEET).model_copy(update={"vllm_python": "/opt/vllm/bin/python"})
    model_dir = tmp_path / "model"
    plan = make_plan(spec, tmp_path / "run", model_dir)
    for engine in plan.engines:
        assert _flag(engine.argv, "--model") == str(model_dir)
        lora = engine.argv[engine.argv.index("--enable-lora") :][:5]
        assert lora == [
            "--enable-lora",
            "--lora-modules",
            f"{LORA_NAME}={lora_adapter_dir(model_dir)}",
            "--max-lora-rank",
            "8",
        ]
    router = json.loads((tmp_path / "run" / "router.json").read_text())
    [model] = router["models"]
    assert model["adapters"] == [LORA_NAME] and model["tokenizer"] == {"path": str(model_dir)}


def test_the_one_model_form_keeps_the_upstream_layout_and_gains_keys(tmp_path: Path) -> None:
    spec = FleetSpec.model_validate(
        {"engines": [{"name": "x", "kind": "sim"}], "keys": str(KEYS_EXAMPLE)}
    )
    make_plan(spec, tmp_path, model_dir=None)
    router = json.loads((tmp_path / "router.json").read_text())
    assert router["prefill"]["config"] == {"modelname": "tiny-llama", "block_size": 32}
    assert router["keys"] == {"file": str(KEYS_EXAMPLE)} and "models" not in router


# -- config/fleet-sim-models.json, up ------------------------------------------------------
def _on_free_ports(spec: dict[str, Any]) -> dict[str, Any]:
    """The fleet file with every port left to the fleet (a test must not take 8000)."""

    def free(section: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in section.items() if k not in ("port", "replay_port")}

    engines = [free(engine) for engine in spec["engines"]]
    return {**spec, "conductor": {}, "router": free(spec["router"]), "engines": engines}


@pytest.fixture(scope="module")
def sim_models_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """config/fleet-sim-models.json up, on free ports, with a tiny model of its own."""
    tmp = tmp_path_factory.mktemp("models")
    spec = _on_free_ports(json.loads(SIM_MODELS.read_text()))
    llama, chat = spec["models"]
    llama = {**llama, "path": str(write_tiny_model(tmp / "model"))}
    spec |= {"models": [llama, chat], "keys": str(KEYS_EXAMPLE)}
    fleet = FleetProcess(tmp / "run", spec)
    try:
        yield fleet.wait_ready(timeout=90)
    finally:
        fleet.stop()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _chat(
    http: aiohttp.ClientSession, router: str, model: str | None, key: str
) -> tuple[int, Any, Any]:
    """A short chat through the router: status, headers, body."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Which engines serve {model}? " * 4}],
        "max_tokens": 2,
    }
    if model is not None:
        body["model"] = model
    url = f"{router}/v1/chat/completions"
    async with http.post(url, json=body, headers=_bearer(key)) as response:
        return response.status, response.headers, await response.json(content_type=None)


async def _listed(http: aiohttp.ClientSession, router: str, key: str = ANY_KEY) -> dict[str, Any]:
    """/v1/models through the router, as the key sees it: id → card."""
    async with http.get(f"{router}/v1/models", headers=_bearer(key)) as response:
        assert response.status == 200, await response.text()
        return {card["id"]: card for card in (await response.json())["data"]}


async def test_the_router_lists_both_models(
    sim_models_fleet: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    router = sim_models_fleet["router"]["url"]
    wanted = {"tiny-llama", "tiny-chat", LORA_NAME}
    cards = await eventually(lambda: _listed(http, router), lambda c: wanted <= set(c))
    assert cards["tiny-llama"].get("parent") is None and cards["tiny-chat"].get("parent") is None
    assert cards[LORA_NAME]["parent"] == "tiny-llama"


@pytest.mark.parametrize(
    ("model", "key", "engines"),
    [
        ("tiny-llama", LLAMA_KEY, LLAMA_ENGINES),
        ("tiny-chat", CHAT_KEY, CHAT_ENGINES),
        (None, LLAMA_KEY, LLAMA_ENGINES),  # the default model
    ],
)
async def test_a_request_lands_on_its_models_engines(
    sim_models_fleet: dict[str, Any],
    http: aiohttp.ClientSession,
    model: str | None,
    key: str,
    engines: set[str],
) -> None:
    router = sim_models_fleet["router"]["url"]
    for _ in range(2):
        status, headers, body = await _chat(http, router, model, key)
        assert status == 200, body
        assert headers["x-conductor-prefill-instance"] in engines
        assert headers["x-engine-instance-id"] == headers["x-conductor-prefill-instance"]
        assert body["model"] == (model or "tiny-llama")


async def test_an_adapter_request_lands_on_its_base_models_engines(
    sim_models_fleet: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    router = sim_models_fleet["router"]["url"]
    status, headers, body = await _chat(http, router, LORA_NAME, LLAMA_KEY)
    assert status == 200, body
    assert headers["x-conductor-prefill-instance"] in LLAMA_ENGINES
    assert body["model"] == LORA_NAME


async def test_an_unknown_model_is_not_found(
    sim_models_fleet: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    router = sim_models_fleet["router"]["url"]
    status, _, body = await _chat(http, router, "tiny-nope", LLAMA_KEY)
    assert status == 404, body
    assert body["error"]["message"].startswith("The model `tiny-nope` does not exist.")


async def test_the_keys_file_holds_the_router_to_its_keys(
    sim_models_fleet: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    """The fleet's keys file is the router's: a request needs a key, and a key sees and
    uses only its models."""
    router = sim_models_fleet["router"]["url"]
    async with http.get(f"{router}/v1/models") as response:
        assert response.status == 401
    await eventually(lambda: _listed(http, router), lambda c: {"tiny-llama", "tiny-chat"} <= set(c))
    assert set(await _listed(http, router, CHAT_KEY)) == {"tiny-chat"}
    assert "tiny-chat" not in await _listed(http, router, LLAMA_KEY)
    status, _, body = await _chat(http, router, "tiny-llama", CHAT_KEY)
    assert status == 404, body


@pytest.mark.needs("vllm")
async def test_config_fleet_lora_serves_the_adapter_on_real_vllm(
    tmp_path_factory: pytest.TempPathFactory, http: aiohttp.ClientSession
) -> None:
    """config/fleet-lora.json's first engine (one real vLLM is enough to show the flags
    work): the router lists the adapter vLLM loaded and sends its requests there."""
    from tests.real.conftest import ENGINE_START_TIMEOUT_S, running_fleet
    from tests.support.parts import VLLM_PYTHON

    tmp_path = tmp_path_factory.mktemp("lora")  # short: vLLM's sockets in it take <108 bytes

    spec = _on_free_ports(json.loads(LORA_FLEET.read_text()))
    [model] = spec["models"]
    spec |= {
        "models": [{**model, "path": str(write_tiny_model(tmp_path / "model"))}],
        "engines": spec["engines"][:1],
        "vllm_python": str(VLLM_PYTHON),
        "startup_timeout_s": ENGINE_START_TIMEOUT_S,
    }
    with running_fleet(tmp_path / "run", spec) as services:
        router = services["router"]["url"]
        cards = await eventually(lambda: _listed(http, router), lambda c: LORA_NAME in c)
        assert cards[LORA_NAME]["parent"] == "tiny-llama"
        assert cards[LORA_NAME]["root"] == str(lora_adapter_dir(tmp_path / "model"))
        status, headers, body = await _chat(http, router, LORA_NAME, ANY_KEY)
        assert status == 200, body
        assert body["model"] == LORA_NAME and headers["x-conductor-prefill-instance"] == "vllm-0"
