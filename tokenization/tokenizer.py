"""The stack's own tokenizer: a model directory's HF tokenizer and chat template, giving the
ids vLLM gives, without a round trip to an engine's ``/tokenize`` per request (the router)
and without an engine (the simulator).

vLLM tokenizes with transformers' tokenizer (HF ``tokenizers`` underneath) and renders chat
through the model's jinja2 template; this module takes the same steps with the same settings:

- completions: the ``prompt`` string encoded with the tokenizer's special tokens (BOS) added
  unless the request's ``add_special_tokens`` says not to (vLLM's default: add them);
- chat: the messages normalised as vLLM normalises them for a template that reads
  ``message.content`` as a string (text parts joined by newlines), rendered in transformers'
  jinja2 environment with the tokenizer's named special tokens, ``add_generation_prompt``
  (default true) and ``continue_final_message``, then encoded without adding specials;
- loading as transformers loads: a tokenizer config that sets ``add_bos_token`` or
  ``add_eos_token`` rebuilds the post-processor, and named special tokens missing from the
  added vocabulary are added as special tokens.

What it cannot do the same way raises ``Unsupported`` and the router asks an engine: tools,
documents, a per-request template or template arguments, non-text content, developer and
tool messages, tool calls, reasoning, templates that loop over a message's content (vLLM's
"openai" content format), a processor's template, truncation. The router also checks the
result against an engine's ``/tokenize`` before trusting it (``router.prompt_ids``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, processors

from .prompt_encoder import CHUNK_CACHE_TOKENS, PromptEncoder, encode_whole

NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# request fields that change the prompt in ways this module does not reproduce
ENGINE_CHAT_FIELDS = (
    "tools",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "reasoning_effort",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "truncate_prompt_tokens",
    "prompt_embeds",
)
ENGINE_COMPLETION_FIELDS = ("truncate_prompt_tokens", "prompt_embeds", "suffix")
# a processor's template takes precedence in vLLM over the tokenizer's
PROCESSOR_FILES = ("chat_template.json", "processor_config.json", "preprocessor_config.json")
BILLING_HEADER = "x-anthropic-billing-header"  # vLLM strips this line from system messages
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


def hub_cache_directory(model: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """``model``'s snapshot in the local Hugging Face hub cache (where vLLM and transformers
    download it: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ~/.cache/huggingface/hub)
    when it holds a tokenizer.json: the revision ``refs/main`` names, else any."""
    env = os.environ if environ is None else environ
    if model.count("/") > 1 or not model.strip("/"):
        return None
    hub = env.get("HF_HUB_CACHE") or str(
        Path(env.get("HF_HOME") or Path.home() / ".cache/huggingface") / "hub"
    )
    repo = Path(hub).expanduser() / ("models--" + model.replace("/", "--"))
    ref = repo / "refs" / "main"
    revisions = [ref.read_text().strip()] if ref.is_file() else []
    snapshots = repo / "snapshots"
    if snapshots.is_dir():
        revisions += sorted(p.name for p in snapshots.iterdir())
    for revision in revisions:
        if (snapshots / revision / "tokenizer.json").is_file():
            return snapshots / revision
    return None


class TokenizerUnavailable(ValueError):
    """The directory holds no tokenizer this module can load (the reason says why)."""


class InvalidPrompt(ValueError):
    """A prompt no tokenizer encodes: a lone surrogate (JSON escapes allow one, UTF-8 not)."""


class Unsupported(Exception):
    """This request is tokenized by an engine; ``reason`` is a short metric label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` tag: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: no HTML escaping, its options exposed."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _mentions_content(node: jinja2.nodes.Node) -> bool:
    return any(
        (isinstance(n, jinja2.nodes.Name) and n.name == "content")
        or (isinstance(n, jinja2.nodes.Getattr) and n.attr == "content")
        or (
            isinstance(n, jinja2.nodes.Getitem)
            and isinstance(n.arg, jinja2.nodes.Const)
            and n.arg.value == "content"
        )
        for n in (node, *node.find_all(jinja2.nodes.Node))
    )


def reads_content_as_string(ast: jinja2.nodes.Template) -> bool:
    """True when vLLM surely detects the "string" content format: no loop iterates over
    anything named content, and no macro loops over one of its parameters (vLLM's "openai"
    format is a loop over a message's content, directly or through a macro). A template
    this cannot prove is tokenized by an engine."""
    for loop in ast.find_all(jinja2.nodes.For):
        if _mentions_content(loop.iter):
            return False
    for macro in ast.find_all(jinja2.nodes.Macro):
        params = {arg.name for arg in macro.args}
        for loop in macro.find_all(jinja2.nodes.For):
            if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in params:
                return False
    return True


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer configs write it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, Mapping) else None
    return content if isinstance(content, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TokenizerUnavailable(f"{path}: {error}") from None
    if not isinstance(data, dict):
        raise TokenizerUnavailable(f"{path}: not a JSON object")
    return data


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The tokenizer's default template: ``chat_template.jinja``, else the config's (a
    string, or the one named ``default`` in a list)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A compiled template and its source (continue_final_message looks into it)."""

    template: jinja2.Template
    source: str


class LocalTokenizer:
    """One model directory's tokenizer and chat template (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        special_tokens: dict[str, str],
        chat: ChatTemplate | None,
        chat_unsupported: str | None,
        chunk_cache_tokens: int = CHUNK_CACHE_TOKENS,
    ) -> None:
        self._tokenizer = tokenizer
        self.special_tokens = special_tokens
        self._chat = chat
        self.chat_unsupported = chat_unsupported  # why chat goes to an engine, if it does
        # tiktoken and reused chunks (None: HF encodes every prompt whole, see prompt_encoder)
        self.encoder = PromptEncoder.create(tokenizer, chunk_cache_tokens)

    @classmethod
    def load(cls, directory: Path, chunk_cache_tokens: int = CHUNK_CACHE_TOKENS) -> LocalTokenizer:
        """Reads ``tokenizer.json`` and the configs; raises TokenizerUnavailable.
        ``chunk_cache_tokens``: how many ids of prompt chunks to keep (0: no chunks)."""
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerUnavailable(f"{directory}: no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust library's own exception types
            raise TokenizerUnavailable(f"{path}: {error}") from None
        config = _read_json(directory / "special_tokens_map.json") | _read_json(
            directory / "tokenizer_config.json"
        )
        special = {
            name: text
            for name in NAMED_SPECIAL_TOKENS
            if (text := _token_text(config.get(name))) is not None
        }
        extra = config.get("extra_special_tokens")
        if isinstance(extra, Mapping):
            special |= {k: t for k, v in extra.items() if (t := _token_text(v)) is not None}
        _add_missing_specials(tokenizer, special.values())
        if "add_bos_token" in config or "add_eos_token" in config or not tokenizer.post_processor:
            _rebuild_post_processor(tokenizer, special, config)
        chat, unsupported = _load_chat(directory, config)
        return cls(tokenizer, special, chat, unsupported, chunk_cache_tokens)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """vLLM's ids for ``text``; raises InvalidPrompt for a lone surrogate (which HF
        refuses with a TypeError and tiktoken would replace)."""
        try:
            text.encode()
        except UnicodeEncodeError as error:
            raise InvalidPrompt(
                f"the prompt must be valid Unicode text: a lone surrogate at {error.start}"
            ) from None
        if self.encoder is not None:
            return self.encoder.encode(text, add_special_tokens)
        return encode_whole(self._tokenizer, text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def token_strs(self, ids: list[int]) -> list[str | None]:
        """Each id's vocabulary entry (transformers' ``convert_ids_to_tokens``): vLLM's
        ``/tokenize`` answer with ``return_token_strs``."""
        return [self._tokenizer.id_to_token(i) for i in ids]

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def render_chat(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The chat's prompt text as vLLM renders it; raises Unsupported (including for
        what vLLM would reject: the engine gives the client its own error)."""
        if self._chat is None:
            raise Unsupported(self.chat_unsupported or "no_chat_template")
        if add_generation_prompt and continue_final_message:
            raise Unsupported("request_invalid")
        conversation = normalize_messages(messages)
        if continue_final_message:
            return self._render_continued(conversation)
        return self._render(conversation, add_generation_prompt)

    def _render(self, conversation: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        assert self._chat is not None
        try:
            return self._chat.template.render(
                messages=conversation,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception:  # the template's own raise_exception, or a bug in it
            raise Unsupported("template_error") from None

    def _render_continued(self, conversation: list[dict[str, Any]]) -> str:
        """transformers' continue_final_message: the last message left open (its text
        marked, rendered, and the rendering cut at the mark)."""
        assert self._chat is not None
        final = conversation[-1]["content"]
        if "content" not in self._chat.source:
            raise Unsupported("request_invalid")
        conversation[-1] = {**conversation[-1], "content": final + CONTINUE_TAG}
        rendered = self._render(conversation, add_generation_prompt=False)
        tag = CONTINUE_TAG.strip()
        if final.strip() not in rendered or tag not in rendered:
            raise Unsupported("request_invalid")
        cut = rendered.rindex(tag)
        if rendered[cut : cut + len(CONTINUE_TAG)] == CONTINUE_TAG:
            return rendered[:cut]
        return rendered[:cut].rstrip()

    def prompt(self, chat: bool, body: Mapping[str, Any]) -> tuple[str, bool]:
        """The text a completions (``chat`` false) or chat request body becomes, and
        whether special tokens are added when it is encoded; raises Unsupported."""
        if chat:
            _refuse_fields(body, ENGINE_CHAT_FIELDS)
            if self._flag(body, "add_special_tokens", False):
                raise Unsupported("add_special_tokens")  # vLLM's chat path ignores it
            text = self.render_chat(
                body.get("messages"),
                self._flag(body, "add_generation_prompt", True),
                self._flag(body, "continue_final_message", False),
            )
            return text, False
        _refuse_fields(body, ENGINE_COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise Unsupported("prompt_shape")
        return prompt, self._flag(body, "add_special_tokens", True)

    def prompt_ids(self, chat: bool, body: Mapping[str, Any]) -> list[int]:
        """The request's prompt ids; raises Unsupported and InvalidPrompt."""
        return self.encode(*self.prompt(chat, body))

    @staticmethod
    def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
        value = body.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise Unsupported("request_invalid")
        return value


def _refuse_fields(body: Mapping[str, Any], fields: tuple[str, ...]) -> None:
    for field in fields:
        if body.get(field) is not None:
            raise Unsupported(f"field_{field}")


def _add_missing_specials(tokenizer: Tokenizer, tokens: Any) -> None:
    """transformers adds each named special token the added vocabulary lacks."""
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(tokens) if t not in added]
    if missing:
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in missing]
        )


def _rebuild_post_processor(
    tokenizer: Tokenizer, special: Mapping[str, str], config: Mapping[str, Any]
) -> None:
    """transformers' post-processor from ``add_bos_token``/``add_eos_token`` (default off)."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos = bool(config.get("add_bos_token")) and bos is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    chosen = ((bos, add_bos), (eos, add_eos))
    specials = [(t, tokenizer.token_to_id(t)) for t, on in chosen if on and t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def _load_chat(
    directory: Path, config: Mapping[str, Any]
) -> tuple[ChatTemplate | None, str | None]:
    """The compiled template, or None and why chat is left to the engines."""
    if any((directory / name).is_file() for name in PROCESSOR_FILES):
        return None, "processor_template"
    source = _chat_template(directory, config)
    if source is None:
        return None, "no_chat_template"
    env = _environment()
    try:
        ast = env.parse(source)
        template = env.from_string(source)
    except jinja2.TemplateError:
        return None, "template_error"
    if not reads_content_as_string(ast):
        return None, "openai_content_format"
    return ChatTemplate(template, source), None


def _text_parts(content: Any) -> Iterator[str]:
    """The texts of a message's content (a string, null or a list of text parts)."""
    if content is None:
        return
    if isinstance(content, str):
        yield content
        return
    if not isinstance(content, list):
        raise Unsupported("request_invalid")
    for part in content:
        if isinstance(part, str):
            yield part
        elif (
            isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
            and part.keys() <= {"type", "text"}
        ):
            yield part["text"]
        else:
            raise Unsupported("content_part")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """vLLM's conversation for a string-content template: role, text parts joined by
    newlines, and the string ``name``/``task`` it keeps. Unknown keys are dropped as vLLM
    drops them; what it would turn into something else raises Unsupported."""
    if not isinstance(messages, list) or not messages:
        raise Unsupported("request_invalid")
    conversation = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise Unsupported("request_invalid")
        role = message["role"]
        if role in ("developer", "tool"):
            raise Unsupported(f"role_{role}")
        if message.get("tool_calls") or message.get("reasoning") is not None:
            raise Unsupported("tool_calls_or_reasoning")
        texts = list(_text_parts(message.get("content")))
        if role == "system" and any(text.startswith(BILLING_HEADER) for text in texts):
            raise Unsupported("billing_header")
        entry: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                entry[key] = message[key]
        conversation.append(entry)
    return conversation


# what the router compares with an engine's /tokenize before trusting this module: odd
# whitespace, non-ASCII text, a special token's text, and a multi-turn chat with text parts
PROBE_PROMPTS = (
    "Hello, world!",
    "  two  spaces,\ttab\n\nünïcödé 字 🙂 — 1234567 x^2",
)
PROBE_CHAT = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "twö"}]},
    {"role": "assistant", "content": "Sure."},
    {"role": "user", "content": "And 字 🙂?"},
)


def probes(tokenizer: LocalTokenizer, model: str) -> list[tuple[bool, dict[str, Any]]]:
    """(chat, /tokenize body) pairs whose ids must match an engine's for each path."""
    texts = [*PROBE_PROMPTS]
    if bos := tokenizer.special_tokens.get("bos_token"):
        texts.append(f"{bos}a special token's text")
    bodies = [(False, {"model": model, "prompt": text}) for text in texts]
    return [*bodies, (True, {"model": model, "messages": [dict(m) for m in PROBE_CHAT]})]
