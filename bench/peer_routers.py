"""The routers users pick instead of ours, run in front of the replay's engine simulators.

Each peer is a PyPI wheel wrapping a Rust binary (the project's ``routers`` extra, or any
venv: ``--peer-bin-dir``): vllm-router (``cache_aware``: an approximate prefix tree of the
prompts it routed, fed with the token ids every engine's ``/v1/completions/render`` returns;
``kv_aware``: an index of the engines' own KV events, subscribed over ZMQ like our conductor)
and sglang-router (``cache_aware``: an approximate tree over the prompt's characters; it
rejects token-id prompts). Each runs with its defaults, as a user would start it, on
127.0.0.1 only (sglang-router binds every interface unless told otherwise).

The replay starts a peer through ``publishers.local.LocalService`` as it starts our
services: ``python -m bench.peer_routers --host H --port P BINARY ARGS...`` replaces itself
(``exec``, same pid, so stopping the service stops the router) with ``BINARY ARGS... --host H
--port P``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from publishers.local import HOST, free_port

VERSION_TIMEOUT_S = 20.0
READY_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class PeerEngine:
    """What a peer needs to know about one engine."""

    url: str
    events: str  # the engine's KV-event PUB endpoint
    replay: str  # its replay endpoint


@dataclass(frozen=True, slots=True)
class PeerRouter:
    name: str  # "<binary>:<policy>", the run's label
    binary: str  # the console script the wheel installs
    distribution: str  # the PyPI name, for the version
    subcommand: tuple[str, ...]
    ready_path: str  # answers 200 once every worker is registered

    @property
    def policy(self) -> str:
        return self.name.split(":", 1)[1]

    def arguments(self, engines: Sequence[PeerEngine], block_size: int, model: str) -> list[str]:
        """Everything after the binary but ``--host``/``--port``: the workers, the policy,
        metrics on loopback, and (kv_aware) each engine's event streams."""
        args = [
            *self.subcommand,
            "--policy", self.policy,
            "--worker-urls", *(engine.url for engine in engines),
            "--prometheus-host", HOST,
            "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1",  # seconds; the default 30 slows start-up
            "--log-level", "warning" if self.binary == "vllm-router" else "warn",
        ]  # fmt: skip
        if self.policy == "kv_aware":
            for engine in engines:
                args += ["--kv-event-source", f"{engine.url}={engine.events}"]
                args += ["--kv-event-replay-source", f"{engine.url}={engine.replay}"]
            args += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        return args


PEERS = {
    peer.name: peer
    for peer in (
        PeerRouter("vllm-router:cache_aware", "vllm-router", "vllm-router", (), "/health"),
        PeerRouter("vllm-router:kv_aware", "vllm-router", "vllm-router", (), "/health"),
        PeerRouter(
            "sglang-router:cache_aware", "sglang-router", "sglang-router", ("launch",), "/readiness"
        ),
    )
}
TEXT_ONLY = frozenset({"sglang-router:cache_aware"})  # token-id prompts get a 422


def find_binary(peer: PeerRouter, bin_dir: Path | None) -> Path | None:
    """The peer's executable in ``bin_dir`` (or on PATH without one); None if absent."""
    found = shutil.which(peer.binary, path=None if bin_dir is None else str(bin_dir))
    return Path(found) if found else None


def installed_version(binary: Path, distribution: str) -> str:
    """The wheel's version, asked of the interpreter the console script runs on (its
    ``#!`` line): these binaries have no ``--version`` of their own in common."""
    first_line = binary.read_bytes().split(b"\n", 1)[0].decode(errors="replace")
    if not first_line.startswith("#!"):
        return "unknown"
    interpreter = first_line[2:].strip().split()
    script = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    try:
        answer = subprocess.run(
            [*interpreter, "-c", script, distribution],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return answer.stdout.strip() or "unknown"


def wait_http_ready(url: str, timeout_s: float) -> None:
    """Until ``GET url`` answers 200: the router has registered its workers."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as answer:
                if answer.status == 200:
                    return
                last = f"HTTP {answer.status}"
        except urllib.error.HTTPError as error:
            last = f"HTTP {error.code}"
        except OSError as error:
            last = str(error)
        time.sleep(READY_POLL_S)
    raise TimeoutError(f"{url} not ready within {timeout_s:.0f} s ({last})")


def main(argv: Sequence[str] | None = None) -> None:
    """Exec ``BINARY ARGS... --host H --port P`` in place of this process."""
    parser = argparse.ArgumentParser(prog="python -m bench.peer_routers", description=main.__doc__)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="BINARY ARGS...")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the router's binary and its arguments")
    binary, *rest = args.command
    os.execv(binary, [binary, *rest, "--host", args.host, "--port", args.port])


if __name__ == "__main__":
    sys.exit(main())
