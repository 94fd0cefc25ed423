"""The HTTP/1.1 the query lane reads and writes: plain request heads and whole answers.

The lane (``conductor.query_lane``) answers ``POST /query`` and ``/query_by_hash``
without aiohttp's request machinery, which costs ~80 µs of CPU a request on this
project's VM, more than the index's own work on a typical query. It reads only the
common, unambiguous case: a request line ``POST <hot path> HTTP/1.x``, header lines of a
token, a colon and a value, one ``Content-Length``, no ``Transfer-Encoding``, ``Expect``
or ``Upgrade``. ``parse_head`` answers None to anything else, and the lane hands that
connection to aiohttp, which answers it as it always did (its errors included).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

HEAD_END = b"\r\n\r\n"
LANE_ROUTES = ("/query", "/query_by_hash")  # what the lane answers
_LANE_TARGETS = frozenset(route.encode() for route in LANE_ROUTES)
MAX_HEAD_BYTES = 8190  # aiohttp's own limit on a request line and on a header line
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"  # a header name, as RFC 9110 has it
# every header line at once: a token, a colon, a value without control bytes (a tab is no
# control byte here), each line ended by CRLF (one regex over the block, not one a line)
_HEADER_BLOCK = re.compile(rb"(?:" + _TOKEN + rb":[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")
DECLINED_HEADERS = frozenset({"transfer-encoding", "expect", "upgrade"})
_VERSIONS = {b"HTTP/1.1": (1, 1), b"HTTP/1.0": (1, 0)}
_REASONS = {status.value: status.phrase for status in HTTPStatus}
DEFAULT_CONTENT_TYPE = "application/octet-stream"  # aiohttp's, for a body without one


class ApiRequest(Protocol):
    """What the query routes and their checks read of a request: aiohttp's
    ``web.Request``, or the lane's ``LaneRequest``."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def content_type(self) -> str: ...
    @property
    def content_length(self) -> int | None: ...
    @property
    def transport(self) -> Any: ...
    @property
    def remote(self) -> str | None: ...


@dataclass(frozen=True)
class LaneRequest:
    """A request the lane read whole: what the query handlers read of ``web.Request``."""

    method: str
    path: str
    headers: CIMultiDictProxy[str]
    content_type: str  # as aiohttp gives it: lower case, without parameters
    content_length: int
    body: bytes | None  # None: it did not arrive within the body timeout
    keep_alive: bool
    transport: Any  # the connection's, which ``ConnectionGuard.request_done`` is told of
    remote: str | None


@dataclass(frozen=True)
class Head:
    """A request head the lane serves; the body is ``length`` bytes after it."""

    path: str
    headers: CIMultiDictProxy[str]
    content_type: str
    length: int
    keep_alive: bool


def parse_head(head: bytes) -> Head | None:
    """``head`` (up to, not with, the blank line) if the lane serves it, else None."""
    request_line, _, header_block = head.partition(b"\r\n")
    parts = request_line.split(b" ")
    if len(parts) != 3:
        return None
    method, target, version_text = parts
    version = _VERSIONS.get(version_text)
    if method != b"POST" or target not in _LANE_TARGETS or version is None:
        return None
    if header_block:
        header_block += b"\r\n"
        if _HEADER_BLOCK.fullmatch(header_block) is None:
            return None
    headers: CIMultiDict[str] = CIMultiDict()
    length = None
    for line in header_block.decode("latin-1").split("\r\n")[:-1]:
        name, _, value = line.partition(":")
        value = value.strip(" \t")
        lowered = name.lower()
        if lowered in DECLINED_HEADERS:
            return None
        if lowered == "content-length":
            if length is not None or not value.isdigit() or not value.isascii():
                return None
            length = int(value)
        headers.add(name, value)
    if length is None:
        return None
    connection = headers.get("Connection", "").lower()
    keep_alive = connection != "close" if version == (1, 1) else connection == "keep-alive"
    content_type = headers.get("Content-Type")
    media_type = (
        content_type.partition(";")[0].strip().lower() if content_type else DEFAULT_CONTENT_TYPE
    )
    return Head(target.decode("ascii"), CIMultiDictProxy(headers), media_type, length, keep_alive)


def answer_head(
    status: int, headers: Iterable[tuple[str, str]], length: int, keep_alive: bool
) -> bytes:
    """An answer's head: its status, ``headers`` and the body's ``length``."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"Content-Length: {length}")
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def answer_bytes(response: web.Response, keep_alive: bool) -> bytes:
    """``response`` as HTTP/1.1 bytes: its status, headers and body, with its length."""
    body = response.body
    assert isinstance(body, bytes), "the query handlers answer with bytes"
    return answer_head(response.status, response.headers.items(), len(body), keep_alive) + body
