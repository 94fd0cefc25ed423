"""Prefill → decode hand-off with the ``kv_transfer_params`` vLLM's disaggregated proxy
uses: the prefill runs one token and returns where its KV lives; the decode
instance pulls that KV and generates the answer."""

from __future__ import annotations

from typing import Any

PREFILL_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The same request, asked to compute the prompt's KV and stop after one token."""
    request = {k: v for k, v in body.items() if k != "stream_options"}
    request.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_TRANSFER_PARAMS))
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


def transfer_params(prefill_answer: Any) -> dict[str, Any]:
    """The prefill's ``kv_transfer_params`` (empty when the engine returned none)."""
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    return params if isinstance(params, dict) else {}


def decode_request(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The original request plus the prefill's transfer parameters."""
    return {**body, "kv_transfer_params": params} if params else dict(body)
