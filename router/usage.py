"""The engine's own count of cached prompt tokens, read from its answer on the way past.

vLLM (and the simulator) report ``usage.prompt_tokens_details.cached_tokens``: in a JSON
answer, and in a stream's last usage chunk when the client asked for
``stream_options.include_usage``. The router never asks for it on the client's behalf (that
would add a chunk the client did not request); such streams count as unverified.

A tap sees each chunk after it was written to the client, so it never delays an answer. A
JSON answer is kept (up to ``MAX_KEPT_BYTES``) and parsed once at its end. An SSE stream
keeps only the event still being received, and parses only complete events that mention
``cached_tokens``: with ``continuous_usage_stats`` every chunk does, and the last one wins.
Events are taken as separated by a blank line (``\\n\\n``), as vLLM and SGLang frame them.
"""

from __future__ import annotations

import json
from typing import Any

MAX_KEPT_BYTES = 8 * 1024 * 1024
EVENT_END = b"\n\n"
MARKER = b'"cached_tokens"'


def cached_tokens(answer: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a parsed answer or chunk, if any."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if type(value) is int else None


def _event_cached_tokens(event: bytes) -> int | None:
    """The cached tokens an SSE event's ``data:`` carries (None for ``[DONE]`` or junk)."""
    data = b"\n".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    try:
        return cached_tokens(json.loads(data))
    except ValueError:
        return None


class UsageTap:
    """Fed every chunk of one answer; ``cached_tokens()`` once it has ended."""

    def __init__(self, streaming: bool) -> None:
        self._streaming = streaming
        self._kept = bytearray()  # the JSON answer, or the SSE event not yet complete
        self._overflow = False  # a JSON answer past the bound: nothing to compare
        self._found: int | None = None

    def feed(self, chunk: bytes) -> None:
        if self._streaming:
            self._feed_event_stream(chunk)
        elif not self._overflow:
            self._overflow = not self._keep(chunk)

    def _keep(self, chunk: bytes) -> bool:
        """Append within the bound; past it, drop what was kept and return False."""
        if len(self._kept) + len(chunk) > MAX_KEPT_BYTES:
            self._kept.clear()
            return False
        self._kept += chunk
        return True

    def _feed_event_stream(self, chunk: bytes) -> None:
        end = chunk.rfind(EVENT_END)
        if end < 0:
            self._keep(chunk)  # an event past the bound is lost, the next ones are read
            return
        complete = bytes(self._kept) + chunk[:end] if self._kept else chunk[:end]
        self._kept = bytearray(chunk[end + len(EVENT_END) :])
        self._scan(complete)

    def _scan(self, events: bytes) -> None:
        """Remember the last count these complete events carry (the fast path: none)."""
        if MARKER not in events:
            return
        for event in reversed(events.split(EVENT_END)):
            if MARKER in event and (found := _event_cached_tokens(event)) is not None:
                self._found = found
                return

    def cached_tokens(self) -> int | None:
        """What the engine reported; None when it said nothing we can compare."""
        if self._streaming:
            self._scan(bytes(self._kept))  # a last event whose blank line never came
            self._kept.clear()
            return self._found
        if self._overflow:
            return None
        try:
            return cached_tokens(json.loads(self._kept))
        except ValueError:
            return None
