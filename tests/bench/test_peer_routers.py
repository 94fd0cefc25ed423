"""The peer routers' command lines and the exec shim that starts them as a LocalService."""

from __future__ import annotations

import stat
from pathlib import Path

from bench.peer_routers import PEERS, PeerEngine, find_binary, installed_version
from publishers.local import LocalService

ENGINES = [
    PeerEngine(f"http://127.0.0.1:{8000 + i}", f"tcp://127.0.0.1:{9000 + i}",
               f"tcp://127.0.0.1:{9100 + i}")
    for i in range(2)
]  # fmt: skip


def option_values(args: list[str], option: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == option]


def test_kv_aware_subscribes_to_every_engine_s_events() -> None:
    args = PEERS["vllm-router:kv_aware"].arguments(ENGINES, 16, "m")
    assert option_values(args, "--kv-event-source") == [f"{e.url}={e.events}" for e in ENGINES]
    assert option_values(args, "--kv-event-replay-source") == [
        f"{e.url}={e.replay}" for e in ENGINES
    ]
    assert option_values(args, "--kv-event-block-size") == ["16"]
    assert option_values(args, "--policy") == ["kv_aware"]


def test_cache_aware_peers_get_the_workers_and_loopback_metrics() -> None:
    for name in ("vllm-router:cache_aware", "sglang-router:cache_aware"):
        args = PEERS[name].arguments(ENGINES, 16, "m")
        assert "--kv-event-source" not in args
        assert option_values(args, "--prometheus-host") == ["127.0.0.1"], name
        start = args.index("--worker-urls") + 1
        assert args[start : start + 2] == [e.url for e in ENGINES], name
    assert PEERS["sglang-router:cache_aware"].arguments(ENGINES, 16, "m")[0] == "launch"


def fake_router(directory: Path, interpreter: str = "/bin/sh") -> Path:
    """A console script that serves HTTP on the port it is given, like a router would."""
    script = directory / "vllm-router"
    script.write_text(
        f"#!{interpreter}\n"
        'while [ "$1" != "--port" ]; do shift; done\n'
        'exec python3 -m http.server --bind 127.0.0.1 "$2"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_the_shim_execs_the_binary_with_host_and_port(tmp_path: Path) -> None:
    binary = fake_router(tmp_path)
    assert find_binary(PEERS["vllm-router:cache_aware"], tmp_path) == binary
    assert find_binary(PEERS["sglang-router:cache_aware"], tmp_path) is None
    service = LocalService(tmp_path, "peer", "bench.peer_routers", str(binary), "--policy", "x")
    try:
        service.wait_ready(20)
        assert service.process.poll() is None  # the router runs under the service's pid
    finally:
        assert service.stop(5) < 5


def test_a_version_it_cannot_ask_for_is_unknown(tmp_path: Path) -> None:
    assert installed_version(fake_router(tmp_path), "vllm-router") == "unknown"
