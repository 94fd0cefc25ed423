"""The router's own tokenizer (``tokenization.tokenizer``) on the tiny model: ids recorded from real
vLLM 0.32 serving it (``tests/real/test_real_fleet.py`` checks the same against a live
engine), what it leaves to an engine, and how the router and the simulator use it."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import jinja2
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fleet.tiny_model import CHAT_TEMPLATE
from publishers.engine.tokenizer import ModelTokenizer
from router import upkeep
from router.__main__ import main as router_main
from tests.router.inprocess import MODEL, layout
from tests.support.api import eventually, metric
from tokenization.tokenizer import (
    LocalTokenizer,
    TokenizerUnavailable,
    Unsupported,
    hub_cache_directory,
)
from tokenization.tokenizer import reads_content_as_string as string_format

# real vLLM 0.32's /tokenize for the tiny model (BOS 0, <|start_header_id|> 2,
# <|end_header_id|> 3, <|eot_id|> 4)
VLLM_IDS = {
    "Hello, world!": [0, 4056, 16, 933, 80, 72, 5],
}


@pytest.fixture(scope="module")
def local(model_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.load(model_dir)


def copy_with(model_dir: Path, tmp_path: Path, **config: object) -> Path:
    """The tiny model's tokenizer files with ``config`` merged into tokenizer_config.json."""
    target = tmp_path / "model"
    target.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(model_dir / name, target)
    data = json.loads((model_dir / "tokenizer_config.json").read_text()) | config
    (target / "tokenizer_config.json").write_text(json.dumps(data))
    return target


def test_completion_ids_are_vllms(local):
    for prompt, ids in VLLM_IDS.items():
        assert local.prompt_ids(False, {"prompt": prompt}) == ids
        assert local.prompt_ids(False, {"prompt": prompt, "add_special_tokens": False}) == ids[1:]


def test_chat_is_the_template_then_tokens_without_specials_again(local):
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b"], "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": []},
        ]
    }
    text, add_special_tokens = local.prompt(True, body)
    assert not add_special_tokens
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\na\nb<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = local.prompt_ids(True, body)
    assert ids[:2] == [0, 2] and ids.count(0) == 1  # one BOS: the template's


def test_continue_final_message_leaves_the_last_message_open(local):
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "Once"}]
    text, _ = local.prompt(
        True,
        {"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nOnce")


@pytest.mark.parametrize(
    ("chat", "body", "reason"),
    [
        (True, {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "field_tools"),
        (True, {"messages": [{"role": "developer", "content": "x"}]}, "role_developer"),
        (True, {"messages": [{"role": "tool", "content": "x"}]}, "role_tool"),
        (
            True,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "content_part",
        ),
        (
            True,
            {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True},
            "add_special_tokens",
        ),  # fmt: skip
        (True, {"messages": []}, "request_invalid"),
        (True, {"messages": [{"role": "user"}], "continue_final_message": True}, "request_invalid"),
        (False, {"prompt": ["a", "b"]}, "prompt_shape"),
        (False, {"prompt": "x", "truncate_prompt_tokens": 3}, "field_truncate_prompt_tokens"),
        (False, {"prompt": "x", "add_special_tokens": "yes"}, "request_invalid"),
    ],
)
def test_what_it_cannot_do_identically_goes_to_an_engine(local, chat, body, reason):
    with pytest.raises(Unsupported) as raised:
        local.prompt_ids(chat, body)
    assert raised.value.reason == reason


@pytest.mark.parametrize(
    ("template", "string"),
    [
        (CHAT_TEMPLATE, True),
        (
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}"
            "{% endfor %}",
            True,
        ),  # fmt: skip
        (
            "{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}"
            "{% endfor %}",
            False,
        ),  # fmt: skip
        (
            "{% for m in messages %}{% set c = m.content %}{% for p in c %}{% endfor %}"
            "{% endfor %}",
            True,
        ),  # vLLM follows only names it assigned from messages: string
        ("{% macro show(x) %}{% for p in x %}{{ p }}{% endfor %}{% endmacro %}", False),
    ],
)
def test_only_a_template_surely_reading_content_as_a_string_is_rendered(template, string):
    assert string_format(jinja2.Environment().parse(template)) is string


def test_a_template_that_loops_over_content_leaves_chat_to_the_engines(model_dir, tmp_path):
    template = "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"
    local = LocalTokenizer.load(copy_with(model_dir, tmp_path, chat_template=template))
    assert local.chat_unsupported == "openai_content_format"
    with pytest.raises(Unsupported):
        local.prompt_ids(True, {"messages": [{"role": "user", "content": "x"}]})
    assert local.prompt_ids(False, {"prompt": "Hello, world!"}) == VLLM_IDS["Hello, world!"]


def test_add_bos_token_false_rebuilds_the_post_processor_as_transformers(model_dir, tmp_path):
    local = LocalTokenizer.load(copy_with(model_dir, tmp_path, add_bos_token=False))
    assert local.prompt_ids(False, {"prompt": "Hello, world!"}) == VLLM_IDS["Hello, world!"][1:]


def test_a_directory_without_a_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerUnavailable, match="no tokenizer.json"):
        LocalTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerUnavailable, match="tokenizer.json"):
        LocalTokenizer.load(tmp_path)


def test_the_simulator_tokenizes_as_the_router(model_dir, local):
    sim = ModelTokenizer(model_dir)
    messages = [{"role": "user", "content": "Hello, world!"}]
    assert sim.encode_prompt("Hello, world!") == VLLM_IDS["Hello, world!"]
    assert sim.chat_prompt(messages, True) == local.prompt_ids(True, {"messages": messages})
    with pytest.raises(ValueError, match="cannot render"):
        sim.chat_prompt([{"role": "developer", "content": "x"}], True)


# -- in the router ---------------------------------------------------------------------------
@pytest.fixture
async def engine(local) -> AsyncIterator[Engine]:
    """An upstream whose /tokenize is the tiny model's (or, told so, another tokenizer's)."""
    state = Engine(local)
    server = TestServer(state.app(), host="127.0.0.1")
    await server.start_server()
    state.url = f"http://127.0.0.1:{server.port}"
    yield state
    await server.close()


@dataclass
class Engine:
    local: LocalTokenizer
    url: str = ""
    disagree: bool = False
    root: str | None = None  # the model directory its /v1/models card names, as vLLM's
    tokenized: int = 0  # /tokenize calls
    received: list[dict] = field(default_factory=list)  # completion bodies, as they came

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.tokenized += 1
        body = await request.json()
        tokens = self.local.prompt_ids("messages" in body, body)
        return web.json_response({"tokens": [t + 1 for t in tokens] if self.disagree else tokens})

    async def _complete(self, request: web.Request) -> web.Response:
        self.received.append(await request.json())
        return web.json_response({"choices": [{"text": "ok"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "root": self.root}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/tokenize", self._tokenize),
                web.post("/v1/completions", self._complete),
                web.post("/v1/chat/completions", self._complete),
                web.get("/v1/models", self._models),
                web.get("/health", self._models),
                web.get("/metrics", self._metrics),
            ]
        )
        return app


async def _route(http: aiohttp.ClientSession, url: str, path: str, body: dict) -> str:
    async with http.post(f"{url}{path}", json={"model": MODEL, **body}) as response:
        assert response.status == 200, await response.text()
        return response.headers["x-conductor-tokenized-by"]


CHAT = {"messages": [{"role": "user", "content": "Hello, world!"}]}


async def test_the_router_tokenizes_itself_once_an_engine_agreed(serve, engine, model_dir, http):
    _, url = await serve(layout([engine.url], tokenizer={"path": str(model_dir)}))
    for path in ("completions", "chat"):
        gauge = f'router_local_tokenizer_active{{path="{path}"}}'
        await eventually(lambda g=gauge: metric(http, url, g), lambda value: value == 1)
    asked = engine.tokenized
    assert await _route(http, url, "/v1/completions", {"prompt": "Hello, world!"}) == "local"
    assert await _route(http, url, "/v1/chat/completions", CHAT) == "local"
    assert await _route(http, url, "/v1/completions", {"prompt": [1, 2, 3]}) == "given"
    chat_with_tools = CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]}
    assert await _route(http, url, "/v1/chat/completions", chat_with_tools) == "engine"
    assert engine.tokenized == asked + 1
    skipped = 'router_tokenize_local_skipped_total{reason="field_tools"}'
    assert await metric(http, url, skipped) == 1
    assert await metric(http, url, 'router_tokenize_total{path="local"}') == 2


async def test_a_completion_goes_on_as_the_routers_ids(serve, engine, model_dir, http):
    """The engine gets the ids the router computed, so it does not tokenize the prompt
    again; with ``echo`` (the engine would echo the ids' decoding), in a chat (vLLM takes no
    ids there), or with ``forward_token_ids`` off, it gets the request as sent."""
    local = LocalTokenizer.load(model_dir)
    prompt = {"prompt": "Hello, world!", "temperature": 0.5, "add_special_tokens": False}
    for forward in (True, False):
        tokenizer = {"path": str(model_dir), "verify": False, "forward_token_ids": forward}
        _, url = await serve(layout([engine.url], tokenizer=tokenizer))
        engine.received.clear()
        for path, body in [
            ("/v1/completions", prompt),
            ("/v1/completions", prompt | {"echo": True}),
            ("/v1/chat/completions", CHAT),
        ]:
            assert await _route(http, url, path, body) == "local"
        ids = local.prompt_ids(False, prompt)
        as_sent = [{"model": MODEL, **body} for body in (prompt, prompt | {"echo": True}, CHAT)]
        assert engine.received[0] == (as_sent[0] | {"prompt": ids} if forward else as_sent[0])
        assert engine.received[1:] == as_sent[1:]


async def test_an_engine_that_disagrees_keeps_tokenizing(serve, engine, model_dir, http, caplog):
    engine.disagree = True
    router, url = await serve(layout([engine.url], tokenizer={"path": str(model_dir)}))
    await eventually(lambda: asyncio.sleep(0, router.upkeep.tasks["tokenizers"].state),
                     lambda state: state != "running")  # fmt: skip
    assert await _route(http, url, "/v1/completions", {"prompt": "Hello, world!"}) == "engine"
    assert "disagrees with instance=e0" in caplog.text
    assert await metric(http, url, 'router_local_tokenizer_active{path="completions"}') == 0


async def test_verify_false_trusts_the_directory_at_once(serve, engine, model_dir, http):
    engine.disagree = True  # never asked
    _, url = await serve(layout([engine.url], tokenizer={"path": str(model_dir), "verify": False}))
    assert await _route(http, url, "/v1/chat/completions", CHAT) == "local"
    assert engine.tokenized == 0


async def test_a_conversation_reuses_its_earlier_turns_ids(serve, engine, model_dir, http):
    tokenizer = {"path": str(model_dir), "verify": False}
    _, url = await serve(layout([engine.url], tokenizer=tokenizer))
    history = " ".join(f"turn {n} says something rather long about item{n}" for n in range(300))
    for turn in (history, history + " and one more question"):
        assert await _route(http, url, "/v1/completions", {"prompt": turn}) == "local"
    assert await metric(http, url, "router_tokenizer_chunks_active") == 1
    reused = await metric(http, url, 'router_tokenizer_chunk_tokens_total{source="reused"}')
    encoded = await metric(http, url, 'router_tokenizer_chunk_tokens_total{source="encoded"}')
    assert reused > 0.8 * encoded  # the second turn came from the first one's chunks
    audits = 'router_tokenizer_chunk_audits_total{result="agreed"}'
    await eventually(lambda: metric(http, url, audits), lambda agreed: agreed == 1)


async def test_chunk_cache_tokens_zero_keeps_no_chunks(serve, engine, model_dir, http):
    tokenizer = {"path": str(model_dir), "verify": False, "chunk_cache_tokens": 0}
    router, url = await serve(layout([engine.url], tokenizer=tokenizer))
    local = router.catalog.default.tokenizer.local
    encoder = local.encoder if local is not None else None
    assert encoder is not None and not encoder.chunking and encoder.fast is not None
    assert await _route(http, url, "/v1/completions", {"prompt": "x " * 5000}) == "local"
    assert await metric(http, url, "router_tokenizer_chunks_active") == 0
    assert await metric(http, url, "router_tokenizer_fast_bpe_active") == 1
    assert await metric(http, url, 'router_tokenizer_chunk_tokens_total{source="encoded"}') == 0


@pytest.mark.parametrize("chat", [False, True])
async def test_a_lone_surrogate_in_the_prompt_is_a_400(serve, engine, model_dir, http, chat):
    _, url = await serve(layout([engine.url], tokenizer={"path": str(model_dir), "verify": False}))
    text = b'"a\\ud800b"'
    body = b'"messages": [{"role": "user", "content": %s}]' % text if chat else b'"prompt": ' + text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    data = b'{"model": "%s", %s}' % (MODEL.encode(), body)
    async with http.post(f"{url}{path}", data=data) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["param"] == ("messages" if chat else "prompt")
    assert error["message"].startswith("the prompt must be valid Unicode text: a lone surrogate")
    assert engine.received == []


def test_a_configured_directory_that_cannot_be_read_stops_the_router(tmp_path):
    with pytest.raises(SystemExit, match="tokenizer: .*no tokenizer.json"):
        router_main(["--config", str(_config_file(tmp_path, {"path": str(tmp_path)}))])


def _config_file(tmp_path: Path, tokenizer: dict) -> Path:
    path = tmp_path / "router.json"
    path.write_text(json.dumps(layout(["http://127.0.0.1:9"], tokenizer=tokenizer)))
    return path


async def test_a_router_without_a_tokenizer_loads_the_one_its_engines_name(
    serve, engine, model_dir, http, caplog
):
    """No tokenizer configured and none found at start: the router says so, with the
    setting, then loads the model directory the engine's /v1/models names (vLLM's card
    ``root``), as this host can read it, and tokenizes itself once the engine agreed."""
    engine.root = str(model_dir)
    _, url = await serve(layout([engine.url]))
    assert "model=m: no tokenizer files found" in caplog.text
    assert "tokenizer.path" in caplog.text
    gauge = 'router_local_tokenizer_active{path="completions"}'
    await eventually(lambda: metric(http, url, gauge), lambda value: value == 1, timeout=15.0)
    tokenizer = (await (await http.get(f"{url}/health")).json())["models"][MODEL]["tokenizer"]
    assert tokenizer["directory"] == str(model_dir) and "note" not in tokenizer
    assert await _route(http, url, "/v1/completions", {"prompt": "Hello, world!"}) == "local"


async def test_an_engines_directory_the_router_cannot_load_is_said_once(
    serve, engine, tmp_path, http, caplog, monkeypatch
):
    """Its tokenizer.json is broken: a warning, not one every round of the upkeep."""
    monkeypatch.setattr(upkeep, "MODELS_RETRY_S", 0.01)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("not json")
    engine.root = str(broken)
    router, url = await serve(layout([engine.url]))
    await asyncio.sleep(0.5)  # many rounds
    assert caplog.text.count("cannot load the tokenizer") == 1
    assert router.catalog.default.tokenizer.local is None
    assert await _route(http, url, "/v1/completions", {"prompt": "Hello, world!"}) == "engine"


async def test_health_names_the_setting_while_engines_tokenize(serve, engine, http):
    _, url = await serve(layout([engine.url]))
    tokenizer = (await (await http.get(f"{url}/health")).json())["models"][MODEL]["tokenizer"]
    assert tokenizer["local"] == [] and "tokenizer.path" in tokenizer["note"]


def test_a_models_snapshot_in_the_hugging_face_cache_is_found(model_dir, tmp_path):
    """Where vLLM and transformers download a model: the revision refs/main names."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.parent.mkdir(parents=True)
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    environ = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    assert hub_cache_directory("org/tiny", environ) == snapshot
    assert hub_cache_directory("org/other", environ) is None
    assert hub_cache_directory("org/tiny", {"HF_HOME": str(tmp_path)}) == snapshot
