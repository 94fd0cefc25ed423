"""An expected failure (refused, reset, timed out, cut, a port in use) as words for a log
line or a one-line error: its type and a short reason, never its repr (aiohttp's carry a
connection key and nested errors, asyncio's repeat the address as a tuple: ~400 characters
of noise). Every command renders failures here, so they read alike everywhere."""

from __future__ import annotations

import os

import aiohttp

MAX_REASON_CHARS = 200


def describe(error: BaseException) -> str:
    """``Type: reason`` for a log line or an error message (``Type`` alone without one)."""
    if isinstance(error, aiohttp.ClientConnectorError):
        reason = connect_failure(error)
    elif isinstance(error, OSError) and error.errno:
        reason = os_reason(error)
    elif isinstance(error, aiohttp.ClientResponseError):
        reason = f"{error.status} {error.message}"
    else:
        reason = str(error)
    # the first line, before any nested object's repr (ClientPayloadError appends its cause's)
    reason = reason.split("\n", 1)[0].split(" <", 1)[0].rstrip(": ")
    name = type(error).__name__
    return f"{name}: {reason[:MAX_REASON_CHARS]}" if reason else name


def os_reason(error: OSError) -> str:
    """The system's words for ``error``: its errno's (asyncio's and socket's own texts repeat
    the address as a tuple), else the resolver's (a failed name lookup's errno is negative)."""
    if error.errno is not None and error.errno > 0:
        return os.strerror(error.errno).lower()
    return (error.strerror or str(error)).lower()


def connect_failure(error: aiohttp.ClientConnectorError) -> str:
    """``cannot connect to host:port: connection refused``."""
    return f"cannot connect to {error.host}:{error.port}: {os_reason(error.os_error)}"


def host_port(host: str | None, port: int) -> str:
    """``host:port``, an IPv6 host in brackets, no host (every interface) as ``*``."""
    where = f"[{host}]" if host and ":" in host else host or "*"
    return f"{where}:{port}"


def cannot_listen(host: str | None, port: int, error: OSError) -> str:
    """``cannot listen on HOST:PORT: address already in use``, the line every command
    exits with when its port is taken."""
    return f"cannot listen on {host_port(host, port)}: {os_reason(error)}"
