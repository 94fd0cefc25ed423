#!/usr/bin/env python3
"""Capture real SGLang's KV-event frames for a scripted request sequence (a test fixture).

Starts real SGLang for CPUs (``scripts/install-sglang-cpu.sh``) on the tiny model
(``fleet/tiny_model.py``) with ZMQ KV events and a page size of 16, subscribes before the
first request, and sends token-id prompts one at a time: a prompt, its repeat, its
extension, a distinct prompt, a partial match, ``POST /flush_cache``, then distinct prompts
until the pool (``--max-total-tokens``) evicts, and two repeats. It records every live
frame exactly (topic, sequence number, payload hex, and the payload decoded), each
answer's ``usage``, and the replay from sequence 0 (every reply frame and the end marker).
``tests/publishers/engine/test_engine_sglang.py`` drives the simulator's SGLang mode with
the same sequence and compares.

    usage: /tmp/bare/bin/python scripts/capture-sglang-frames.py
               [--sglang-python PATH] [--out tests/fixtures/sglang_frames.json]

Run it with the project's venv (it imports ``fleet`` and ``publishers``); SGLang runs in
its own. It stops SGLang with SIGTERM to its main process and removes what SGLang leaves in
its private TMPDIR and ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleet.tiny_model import write_tiny_model  # noqa: E402
from publishers.local import HOST, free_port  # noqa: E402

SGLANG_VERSION = "0.5.23"
PAGE_SIZE = 16
MAX_TOTAL_TOKENS = 512  # 32 pages: six 127-token prompts evict
TOPIC = "kv-events"
MODEL = "tiny"
READY_TIMEOUT_S = 240.0
SETTLE_S = 0.6  # a request's frames have all arrived when none came for this long
FRAME_WAIT_S = 5.0  # the longest a request's first frame may take after its answer
STOP_TIMEOUT_S = 60.0
END_SEQ = b"\xff" * 8
SEED = 20261125


def sglang_flags(model: Path, port: int, events: int, replay: int) -> list[str]:
    """The server's flags: the CPU path, page size 16, a small pool, the usage report."""
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://{HOST}:{events}",
        "bind": True,
        "replay_endpoint": f"tcp://{HOST}:{replay}",
        "topic": TOPIC,
    }
    return [
        "--model-path", str(model), "--served-model-name", MODEL,
        "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
        "--page-size", str(PAGE_SIZE), "--mem-fraction-static", "0.05",
        "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--skip-server-warmup",
        "--enable-cache-report", "--host", HOST, "--port", str(port),
        "--kv-events-config", json.dumps(config),
    ]  # fmt: skip


def script() -> list[dict[str, Any]]:
    """The request sequence: token-id prompts (ids 10..3999, never special) and a flush."""
    rng = random.Random(SEED)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(count)]

    a, b = tokens(70), tokens(50)
    partial = a[:40] + tokens(30)  # matches 2 of A's 4 pages: splits A's radix node
    fills = [tokens(127) for _ in range(6)]  # 7 pages each: the fifth and sixth evict
    return [
        {"prompt": a},
        {"prompt": a},
        {"prompt": a + tokens(40)},
        {"prompt": b},
        {"prompt": partial},
        {"prompt": a, "cache_salt": "tenant-a"},  # another namespace: no hit
        {"flush_cache": True},
        *({"prompt": fill} for fill in fills),
        {"prompt": fills[-1]},  # still cached
        {"prompt": fills[0]},  # evicted: computed again, evicting the next oldest
    ]


class Capture:
    """The SUB socket and what it recorded; DEALER replays."""

    def __init__(self, context: zmq.Context, events: int, replay: int) -> None:
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://{HOST}:{events}")
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.connect(f"tcp://{HOST}:{replay}")

    def frames(self, first_wait: float) -> list[dict[str, Any]]:
        """Every frame until none arrives for SETTLE_S (the first may take ``first_wait``)."""
        recorded: list[dict[str, Any]] = []
        wait = first_wait
        while self.sub.poll(int(wait * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            recorded.append(frame_record(topic, seq, payload))
            wait = SETTLE_S
        return recorded

    def replay(self, start_seq: int) -> list[list[str]]:
        """Every reply frame (hex) to ``[b"", start_seq]``, through the end marker."""
        self.dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        replies: list[list[str]] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.dealer.poll(1000):
            reply = self.dealer.recv_multipart()
            replies.append([frame.hex() for frame in reply])
            if len(reply) >= 2 and reply[-2] == END_SEQ:
                return replies
        raise TimeoutError(f"no end marker after {len(replies)} replay replies")

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


def frame_record(topic: bytes, seq: bytes, payload: bytes) -> dict[str, Any]:
    return {
        "topic": topic.decode(),
        "seq": int.from_bytes(seq, "big"),
        "payload": payload.hex(),
        "decoded": msgpack.unpackb(payload, raw=False),
    }


def http(url: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    method = "POST" if body is not None or url.endswith("/flush_cache") else "GET"
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def wait_ready(process: subprocess.Popen[bytes], base: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"SGLang exited at start-up (status {process.returncode})")
        try:
            if http(f"{base}/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"SGLang did not answer /health within {READY_TIMEOUT_S:.0f} s")


def run_step(base: str, capture: Capture, step: dict[str, Any]) -> dict[str, Any]:
    if step.get("flush_cache"):
        status, text = http(f"{base}/flush_cache")
        record: dict[str, Any] = {"flush_cache": {"status": status, "body": text}}
    else:
        request = step | {"max_tokens": 1}
        body = request | {"model": MODEL, "temperature": 0}
        status, text = http(f"{base}/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"completion failed status={status} body={text}")
        record = request | {"usage": json.loads(text)["usage"]}
    return record | {"frames": capture.frames(FRAME_WAIT_S)}


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the main process only (to the group, SGLang takes its crash path)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def shm_files(group: int) -> set[Path]:
    """The /dev/shm files the processes of session ``group`` have mapped: SGLang names its
    load-snapshot files after a random instance id and leaves them behind."""
    found: set[Path] = set()
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.getpgid(int(proc.name)) != group:
                continue
            maps = (proc / "maps").read_text()
        except OSError:  # gone meanwhile
            continue
        found |= {Path(line.split()[-1]) for line in maps.splitlines() if "/dev/shm/" in line}
    return found


def capture(sglang_python: Path, work: Path) -> dict[str, Any]:
    model = write_tiny_model(work / "model")
    tmp = work / "tmp"
    tmp.mkdir()
    port, events, replay = free_port(), free_port(), free_port()
    flags = sglang_flags(model, port, events, replay)
    env = os.environ | {
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "SGLANG_CACHE_DIR": str(work / "sglang-cache"),
        "TMPDIR": str(tmp),
    }
    context = zmq.Context()
    recorder = Capture(context, events, replay)  # subscribed before SGLang starts
    log = (work / "sglang.log").open("wb")
    command = [str(sglang_python), "-m", "sglang.launch_server", *flags]
    process = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://{HOST}:{port}"
    try:
        wait_ready(process, base)
        started = recorder.frames(1.0)
        steps = [run_step(base, recorder, step) for step in script()]
        replies = recorder.replay(0)
    except BaseException:
        print((work / "sglang.log").read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        leftovers = shm_files(process.pid) if process.poll() is None else set()
        recorder.close()
        context.term()
        stop(process)
        log.close()
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)
    log_lines = (work / "sglang.log").read_text().splitlines()
    pool = next(line for line in log_lines if "max_total_num_tokens=" in line)
    return {
        "_origin": (
            f"Captured {datetime.date.today()} from real SGLang {SGLANG_VERSION} for CPUs "
            "(scripts/install-sglang-cpu.sh) serving fleet/tiny_model.py's model, by "
            "scripts/capture-sglang-frames.py (rerun it to regenerate); token-id prompts, "
            "max_tokens 1, temperature 0, one request at a time."
        ),
        "sglang_version": SGLANG_VERSION,
        "flags": [flag.replace(str(model), "MODEL_DIR") for flag in flags],
        "page_size": PAGE_SIZE,
        "max_total_tokens": MAX_TOTAL_TOKENS,
        "pool_log": pool.partition("] ")[2],  # SGLang's own account of the KV pool
        "started": started,
        "steps": steps,
        "replay": {"start_seq": 0, "replies": replies},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sglang-python",
        type=Path,
        default=Path.home() / ".cache/mooncake/sglang-cpu/bin/python",
        help="the python of SGLang's venv (default: scripts/install-sglang-cpu.sh's)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "tests/fixtures/sglang_frames.json", help="fixture"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sglang-capture-"))
    try:
        result = capture(args.sglang_python, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} steps={len(result['steps'])}")


if __name__ == "__main__":
    main()
