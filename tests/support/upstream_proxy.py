"""A conductor client that behaves as upstream Mooncake's example cache-aware P/D proxy.

Upstream ships ``mooncake-conductor/example/cache_aware_disagg_proxy.py`` (branch
``dev/conductor``, commit 19ffa6e4a) for its C++ conductor. This is our own rendering of what
that proxy does towards the conductor and the prefill engines, so tests can hold our
conductor to it over real sockets, without FastAPI or httpx:

* at start, one msgpack ``POST /register`` per (prefill instance, DP rank), in order, with
  the proxy's body keys; a non-2xx answer, or a success body whose ``status`` is not
  "registered successfully" or whose ``instance_id`` is not the one sent, aborts;
* per request, the prompt's tokens from a prefill engine's ``/tokenize`` (engines taken in
  turn), a msgpack ``POST /query`` carrying them as little-endian int32 bytes, and the
  choice of prefill from the answer's ``instances``: the largest ``longest_matched`` among
  the configured instances, ties taken in turn, otherwise a round-robin fallback under the
  proxy's reason names;
* the prefill request the proxy then sends to the chosen engine.

Decode, streaming and the proxy's own config parsing are left out.
"""

from __future__ import annotations

import itertools
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack

from router.disagg import PREFILL_TRANSFER_PARAMS  # the vLLM-defined ask, as the proxy sends it

MSGPACK = "application/msgpack"
REGISTERED = "registered successfully"
# the profile of upstream's sample config: vLLM's sha256_cbor block hashes, PYTHONHASHSEED=0
HASH_PROFILE = {
    "strategy": "vllm_v1",
    "algorithm": "sha256_cbor",
    "python_hash_seed": "0",
    "index_projection": "low64_be",
}


class ConductorProtocolError(ValueError):
    """A conductor answer the proxy cannot use (upstream's name for it)."""


@dataclass(frozen=True)
class Prefill:
    """A prefill engine: its id, its OpenAI server and its KV-event streams by DP rank."""

    instance_id: str
    http_endpoint: str
    registrations: tuple[tuple[str, int], ...]  # (event endpoint, dp_rank)


@dataclass(frozen=True)
class PrefillPool:
    """The proxy config's ``prefill.config``: what every registration and query carries."""

    modelname: str
    block_size: int
    hash_profile: Mapping[str, str] = field(default_factory=lambda: dict(HASH_PROFILE))
    tenant_id: str = "default"
    lora_name: str = ""


@dataclass(frozen=True)
class Choice:
    """Where the proxy sends a request's prefill, and why.

    ``fallback`` is the proxy's reason when the choice was not made by cache (None when it
    was); ``candidates`` are the usable ``longest_matched`` values it compared."""

    instance_id: str
    fallback: str | None
    candidates: dict[str, int] = field(default_factory=dict)


class UpstreamProxy:
    """The proxy's conductor-facing half, over the caller's aiohttp session."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        conductor_url: str,
        pool: PrefillPool,
        prefills: list[Prefill],
        query_timeout_s: float = 1.0,
        registration_timeout_s: float = 5.0,
    ) -> None:
        self.http, self.conductor_url, self.pool = http, conductor_url, pool
        self.prefills = {prefill.instance_id: prefill for prefill in prefills}
        self.query_timeout = aiohttp.ClientTimeout(total=query_timeout_s)
        self.registration_timeout = aiohttp.ClientTimeout(total=registration_timeout_s)
        # three independent rotations, as the proxy keeps them
        self._tokenizers = itertools.cycle(prefills)
        self._fallbacks = itertools.cycle(prefills)
        self._tie_turns: dict[tuple[str, ...], int] = {}

    # -- start-up -----------------------------------------------------------------------
    def registration_bodies(self) -> list[dict[str, Any]]:
        """One ``/register`` body per (instance, DP rank): no replay endpoint, no salt."""
        return [
            {
                "endpoint": endpoint,
                "type": "vLLM",
                "modelname": self.pool.modelname,
                "instance_id": prefill.instance_id,
                "block_size": self.pool.block_size,
                "dp_rank": dp_rank,
                "tenant_id": self.pool.tenant_id,
                "lora_name": self.pool.lora_name,
                "hash_profile": dict(self.pool.hash_profile),
            }
            for prefill in self.prefills.values()
            for endpoint, dp_rank in prefill.registrations
        ]

    async def register_all(self) -> None:
        """Register every stream in turn; the first refusal or odd answer raises."""
        for body in self.registration_bodies():
            answer = await self._conductor("/register", body, {}, self.registration_timeout)
            echoed = answer.get("instance_id") == body["instance_id"]
            if answer.get("status") != REGISTERED or not echoed:
                raise ConductorProtocolError(f"unexpected /register success body: {answer}")

    # -- per request --------------------------------------------------------------------
    async def choose_prefill(self, request: Mapping[str, Any], request_id: str) -> Choice:
        """Tokenize, ask the conductor, and choose as the proxy's ``select_prefill``."""
        try:
            tokens = await self.tokenize(next(self._tokenizers), request, request_id)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return self._fallback("tokenization_failed")
        try:
            answer = await self.query(request, tokens, request_id)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return self._fallback("conductor_query_failed")
        instances = answer.get("instances")
        if not isinstance(instances, dict):
            return self._fallback("invalid_instances_response")
        candidates = self._candidates(instances)
        if not candidates:
            return self._fallback("no_routable_cache_result")
        best = max(candidates.values())
        if best == 0:
            return self._fallback("all_cache_hits_zero", candidates)
        leaders = tuple(sorted(name for name, hit in candidates.items() if hit == best))
        turn = self._tie_turns.get(leaders, 0)
        self._tie_turns[leaders] = turn + 1
        return Choice(leaders[turn % len(leaders)], None, candidates)

    async def tokenize(
        self, prefill: Prefill, request: Mapping[str, Any], request_id: str
    ) -> list[int]:
        """The prompt's token ids from the engine's ``/tokenize`` (a one-token copy)."""
        url = f"{prefill.http_endpoint}/tokenize"
        async with self.http.post(
            url,
            json=_one_token(request),
            headers=_engine_headers(request_id),
            timeout=self.query_timeout,
        ) as response:
            response.raise_for_status()
            answer = await response.json()
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or any(type(token) is not int for token in tokens):
            raise ValueError(f"/tokenize answered no token id list: {answer!r:.200}")
        return tokens

    async def query(
        self, request: Mapping[str, Any], tokens: list[int], request_id: str
    ) -> dict[str, Any]:
        """``POST /query`` in msgpack: the request's model and salt, the pool's context."""
        model = request.get("model")
        if not isinstance(model, str) or not model:
            raise ConductorProtocolError("the request names no model")
        body: dict[str, Any] = {
            "model": model,
            "block_size": self.pool.block_size,
            "token_ids": struct.pack(f"<{len(tokens)}i", *tokens),
            "tenant_id": self.pool.tenant_id,
            "lora_name": self.pool.lora_name,
        }
        if "cache_salt" in request:
            body["cache_salt"] = request["cache_salt"]
        headers = {"X-Request-Id": request_id}
        return await self._conductor("/query", body, headers, self.query_timeout)

    async def prefill(
        self, instance_id: str, api: str, request: Mapping[str, Any], request_id: str
    ) -> dict[str, Any]:
        """The proxy's prefill request to the chosen engine; its JSON answer."""
        body = _one_token(request) | {"kv_transfer_params": dict(PREFILL_TRANSFER_PARAMS)}
        url = f"{self.prefills[instance_id].http_endpoint}{api}"
        async with self.http.post(url, json=body, headers=_engine_headers(request_id)) as response:
            response.raise_for_status()
            answer: dict[str, Any] = await response.json()
            return answer

    # -- helpers ------------------------------------------------------------------------
    async def _conductor(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
    ) -> dict[str, Any]:
        """A msgpack POST; a non-2xx status raises, a body that is no map too."""
        async with self.http.post(
            f"{self.conductor_url}{path}",
            data=msgpack.packb(body, use_bin_type=True),
            headers={"Content-Type": MSGPACK, **headers},
            timeout=timeout,
        ) as response:
            response.raise_for_status()
            raw = await response.read()
        try:
            answer = msgpack.unpackb(raw, raw=False)
        except ValueError:
            raise ConductorProtocolError(f"{path} answered invalid msgpack") from None
        if not isinstance(answer, dict):
            raise ConductorProtocolError(f"{path} answered no msgpack map")
        return answer

    def _candidates(self, instances: dict[Any, Any]) -> dict[str, int]:
        """The configured instances whose entry is a map with an int ``longest_matched``
        of at least 0 (a bool is no int here); anything else is ignored."""
        candidates = {}
        for instance_id, hit in instances.items():
            if instance_id not in self.prefills or not isinstance(hit, dict):
                continue
            longest = hit.get("longest_matched")
            if type(longest) is int and longest >= 0:
                candidates[instance_id] = longest
        return candidates

    def _fallback(self, reason: str, candidates: dict[str, int] | None = None) -> Choice:
        return Choice(next(self._fallbacks).instance_id, reason, candidates or {})


def _one_token(request: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the request asking for one token, whole (what tokenize and prefill get)."""
    body = dict(request) | {"stream": False, "max_tokens": 1}
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    return body


def _engine_headers(request_id: str) -> dict[str, str]:
    """The proxy's headers to engines: its API key (the text "None" when unset) and id."""
    return {
        "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}",
        "X-Request-Id": request_id,
    }
