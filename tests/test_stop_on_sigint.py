"""Every long-running command stops on SIGINT within 2 s, even when started with SIGINT
ignored (as a non-interactive shell starts a background job: the signal then reaches the
program only through a handler it installs itself)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from publishers.local import HOST, free_port
from tests.support.fleet import READY_LINE

STOP_BOUND_S = 2.0


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=_ignore_sigint,
        )  # fmt: skip


def _wait_for(log: Path, text: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert process.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s"
        time.sleep(0.1)


def _stop_time(process: subprocess.Popen, log: Path) -> float:
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"still running 10 s after SIGINT:\n{log.read_text(errors='replace')}")
    return time.monotonic() - started


def _commands(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Each command with the log line that says it is up."""
    empty = tmp_path / "conductor_config.json"
    empty.write_text("{}")
    fleet = tmp_path / "fleet.json"
    fleet.write_text(
        json.dumps(
            {"model": {"name": "m"}, "block_size": 16, "engines": [{"name": "a", "kind": "sim"}]}
        )
    )
    port = str(free_port())
    return {
        "conductor": (
            ["conductor", "--host", HOST, "--port", port, "--config", str(empty)],
            "listening",
        ),
        "engine-sim": (
            ["publishers.engine", "--host", HOST, "--port", port, "--served-model-name", "m"],
            "serving",
        ),
        "demo": (["publishers.demo", "--requests", "5000"], "requests over"),
        "fleet": (["fleet", "up", str(fleet), "--run-dir", str(tmp_path / "run")], READY_LINE),
    }


@pytest.mark.parametrize("command", ["conductor", "engine-sim", "demo", "fleet"])
def test_sigint_stops_the_command_within_two_seconds(tmp_path: Path, command: str) -> None:
    args, ready = _commands(tmp_path)[command]
    log = tmp_path / f"{command}.log"
    process = _start(args, log)
    _wait_for(log, ready, process)
    took = _stop_time(process, log)
    assert took < STOP_BOUND_S, f"{command} took {took:.2f} s to stop"
