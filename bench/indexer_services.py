"""KV-cache indexer services under test, one small class each behind ``IndexerService``.

``bench.service_compare`` drives every service the same way: start it empty on a loopback
port, register ``N`` vLLM instances (ZMQ PUB endpoints), ask ``/query`` with the same token
ids, read its resident memory, stop it. What differs between services (command line,
registration body, query body and answer) lives here, and nothing else does:

* ``Ours``: ``python -m conductor``, optionally pinned with ``taskset`` and given extra flags
  or environment (the lead compares one core with two, and a multi-process mode). It is asked
  in JSON and in msgpack (``application/msgpack`` answers in upstream C++'s shape);
* ``Dynamo``: NVIDIA Dynamo's standalone indexer, ``python -m dynamo.indexer`` (Rust; the
  ``index-bench`` extra). It hashes the query's tokens itself (xxh3 per block, chained
  by its radix tree), the same way it hashed each event's ``token_ids``, so the event's
  block hashes only link parents to children;
* ``Cpp``: upstream Mooncake's C++ conductor, msgpack only; it hashes the query's tokens with
  the registered ``hash_profile`` (vLLM's ``sha256_cbor`` chain), so the events must carry
  vLLM's real block hashes (``bench.service_compare`` sends them to every service).

Dynamo and the C++ conductor bind 0.0.0.0: run them only inside a private network namespace
(``in_private_netns``; ``bench.service_compare`` re-executes itself under ``unshare -n``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgpack

from bench.conductor_bench import (
    MODEL,
    MSGPACK_TYPE,
    msgpack_query_body,
    probe_tokens,
    query_body,
    verify_clean,
)
from bench.harness import (
    BLOCK_SIZE,
    JSON_TYPE,
    BenchError,
    Http,
    ServiceProcess,
    deadline_loop,
    metric_sum,
    register_all,
    rss_bytes,
    vllm_registration,
)
from publishers.local import HOST, free_port

QUERY_THREAD_FLAG = "--query-thread"  # ours answers plain queries on a thread of their own
PLACE_ATTEMPTS = 100  # query connections made at most to land one on the query thread

HASH_ALGORITHM = "sha256_cbor"  # vLLM's default prefix-caching hash since 0.11
HASH_SEED = "0"  # PYTHONHASHSEED=0: every engine of a deployment must share it

Answer = dict[str, int]  # instance id -> tokens of the prompt it holds (0s left out)


def in_private_netns(host: str | None = None) -> bool:
    """True when this process's network namespace is not ``host`` (a ``net:[inode]`` link),
    by default the one PID 1 (the host) uses; unknown counts as not private."""
    try:
        own = os.readlink("/proc/self/ns/net")
        # inside a new namespace /proc/1's link is unreadable: the caller passes it then
        return own != (host or os.readlink("/proc/1/ns/net"))
    except OSError:
        return False


# -- processes --------------------------------------------------------------------------
def tree_pids(pid: int) -> list[int]:
    """``pid`` and every descendant: a multi-process service's memory is all of theirs."""
    pids, pending = [], [pid]
    while pending:
        current = pending.pop()
        pids.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                pending += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return pids


def tree_rss_bytes(pid: int) -> int:
    """VmRSS summed over the process tree (shared pages counted in each process)."""
    total = 0
    for member in tree_pids(pid):
        with contextlib.suppress(OSError):  # exited between the listing and the read
            total += rss_bytes(member)
    return total


# -- the common interface ---------------------------------------------------------------
@dataclass(frozen=True)
class QueryMode:
    """One way to ask a service: how a prompt becomes a body, how its answer is read."""

    name: str  # "json" or "msgpack": the column the table shows
    content_type: str
    body: Callable[[list[int]], bytes]
    parse: Callable[[bytes], Answer]


@dataclass(frozen=True)
class Stream:
    """One engine's event stream as a service registers it."""

    instance_id: str  # decimal: Dynamo's worker ids are integers
    endpoint: str


class IndexerService(Protocol):
    """What ``bench.service_compare`` needs of a service under test."""

    modes: tuple[QueryMode, ...]  # the first is the one every check uses

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def client(self) -> Http: ...

    def start(self, run_dir: Path) -> None: ...

    def stop(self) -> None: ...

    def register(self, streams: Sequence[Stream], send_probes: ProbeSender) -> int:
        """Register every stream and return once each is received; returns the blocks
        stored on the way (probes)."""
        ...

    def counters(self, blocks: int, events: int) -> dict[str, float]:
        """The service's own proof that nothing was lost (empty when it has none)."""
        ...

    def describe(self) -> dict[str, Any]:
        """How it was started, for the JSON."""
        ...


ProbeSender = Callable[[Sequence[int]], None]
"""Sends the probe (``probe_tokens``) of each stream listed by position."""


def answer(service: IndexerService, tokens: list[int], mode: QueryMode | None = None) -> Answer:
    """The instances holding a prefix of ``tokens``, from a 200 answer."""
    mode = mode or service.modes[0]
    status, data = service.client.raw("POST", "/query", mode.body(tokens), mode.content_type)
    if status != 200:
        raise BenchError(f"{service.name} /query -> {status}: {data[:300]!r}")
    return mode.parse(data)


def register_by_probe(
    service: IndexerService,
    streams: Sequence[Stream],
    send_probes: ProbeSender,
    timeout: float = 30.0,
) -> int:
    """Resend a one-block probe on each stream until ``/query`` shows it.

    A PUB drops what it sends before the subscriber joined, and a peer without a connection
    state to read can only prove it joined by answering. Returns the blocks stored.
    """
    pending = dict(enumerate(streams))
    for _ in deadline_loop(timeout, f"{service.name} to receive every stream", 0.02):
        send_probes(list(pending))
        pending = {
            n: s
            for n, s in pending.items()
            if answer(service, probe_tokens(n)).get(s.instance_id) != BLOCK_SIZE
        }
        if not pending:
            return len(streams)
    return len(streams)


def _started(service: ServiceProcess | None, name: str) -> ServiceProcess:
    if service is None:
        raise BenchError(f"{name} is not running")
    return service


# -- ours -------------------------------------------------------------------------------
def _ours_json(data: bytes) -> Answer:
    hits = json.loads(data).get("default", {})
    return {k: v["longest_matched"] for k, v in hits.items() if v["longest_matched"]}


def _instances_msgpack(data: bytes) -> Answer:
    hits = msgpack.unpackb(data)["instances"]
    return {str(k): v["longest_matched"] for k, v in hits.items() if v["longest_matched"]}


class _Running:
    """The process and keep-alive client a service class holds once started."""

    _process: ServiceProcess | None
    _client: Http | None

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        return _started(self._process, self.name).process.pid

    @property
    def client(self) -> Http:
        if self._client is None:
            raise BenchError(f"{self.name} is not running")
        return self._client

    def _launch(
        self,
        command: Sequence[str],
        port: int,
        log_path: Path,
        cpus: str | None,
        env: Mapping[str, str],
        ready_path: str,
    ) -> None:
        self._process = ServiceProcess.start(command, port, log_path, cpus, env, self.name)
        self._process.wait_ready(ready_path)
        self._client = Http(port)

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._process is not None:
            self._process.stop()


@dataclass(frozen=True)
class _OursRegistration:
    """The ``/register`` body of a vLLM instance, as ``register_all`` takes it, with the
    C++ service's hash profile if ``profiled``."""

    instance_id: str
    endpoint: str
    profiled: bool

    def registration(self) -> dict[str, Any]:
        extra = {"hash_profile": HASH_PROFILE} if self.profiled else {}
        return vllm_registration(self.endpoint, self.instance_id, MODEL, **extra)


@dataclass
class Ours(_Running):
    """This project's conductor: ``python -m conductor`` with an empty config.

    ``cpus`` pins it (``taskset -c``), ``args`` and ``env`` reach the service unchanged.
    ``profiled`` registers its streams with the C++ service's hash profile, as a user of
    that service would: its index keys vLLM's block hashes and hashes each query's blocks
    as vLLM does, as the C++ service does, instead of the Go prefix hash.
    """

    cpus: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    profiled: bool = False
    name: str = "ours"
    modes: tuple[QueryMode, ...] = (
        QueryMode("json", JSON_TYPE, query_body, _ours_json),
        QueryMode("msgpack", MSGPACK_TYPE, msgpack_query_body, _instances_msgpack),
    )
    _process: ServiceProcess | None = None
    _client: Http | None = None

    def start(self, run_dir: Path) -> None:
        config = run_dir / "conductor_config.json"
        config.write_text("{}")
        port = free_port()
        command = [sys.executable, "-m", "conductor", "--host", HOST, "--port", str(port)]
        command += ["--config", str(config), *self.args]
        self._launch(command, port, run_dir / "ours.log", self.cpus, self.env, "/health")

    def register(self, streams: Sequence[Stream], send_probes: ProbeSender) -> int:
        """``/services`` says when a SUB socket is connected: no probe needed. With the
        query thread, the query connection is then placed on its side."""
        register_all(
            self.client,
            [_OursRegistration(s.instance_id, s.endpoint, self.profiled) for s in streams],
        )
        if QUERY_THREAD_FLAG in self.args:
            self._query_on_the_thread()
        return 0

    def _query_on_the_thread(self) -> None:
        """The kernel spreads connections over the query thread's socket and the loop's:
        the query connection is made again until the thread answers on it (as it would
        for half of a router's pool). It stays there: the thread answers every query of
        the benchmark's context."""
        body = query_body(probe_tokens(0))
        for _ in range(PLACE_ATTEMPTS):
            before = self._thread_queries()
            status, _ = self.client.raw("POST", "/query", body)
            if status != 200:
                raise BenchError(f"ours answered a placing /query with {status}")
            if self._thread_queries() > before:
                return
            self.client.queries.close()  # http.client connects again for the next request
        raise BenchError("no query connection landed on the query thread")

    def _thread_queries(self) -> float:
        status, text = self.client.raw("GET", "/metrics")
        if status != 200:
            raise BenchError(f"ours answered /metrics with {status}")
        return metric_sum(text.decode(), "conductor_query_thread_queries_total")

    def counters(self, blocks: int, events: int) -> dict[str, float]:
        return verify_clean(self.client, blocks, events)

    def describe(self) -> dict[str, Any]:
        described = {"cpus": self.cpus, "args": list(self.args), "env": dict(self.env)}
        return {**described, "hash_profile": HASH_PROFILE if self.profiled else None}


# -- NVIDIA Dynamo ----------------------------------------------------------------------
def dynamo_python() -> str:
    """An interpreter that imports ``dynamo`` (the ``index-bench`` extra): this one, else
    the one this venv was made from (its site-packages may hold it), else ``python3``."""
    if importlib.util.find_spec("dynamo") is not None:
        return sys.executable
    candidates: list[str | None] = [getattr(sys, "_base_executable", None)]
    candidates.append(shutil.which("python3"))
    for candidate in filter(None, candidates):
        if candidate != sys.executable and dynamo_available(candidate) is None:
            return candidate
    return "python3"


@functools.cache  # a process that imports Dynamo: asked once per interpreter
def dynamo_available(python: str) -> str | None:
    """None when ``python -m dynamo.indexer`` can run, else why not."""
    try:
        done = subprocess.run(
            [python, "-c", "import dynamo.indexer"], capture_output=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{python}: {error}"
    if done.returncode != 0:
        return f"{python} cannot import dynamo.indexer (pip install -e '.[index-bench]')"
    return None


def _dynamo_query(tokens: list[int]) -> bytes:
    return json.dumps({"token_ids": tokens, "model_name": MODEL}, separators=(",", ":")).encode()


def _dynamo_answer(data: bytes) -> Answer:
    """``{"scores": {worker: {dp_rank: tokens}}, "instances": {worker: {"longest_matched",
    "gpu", "cpu", "disk", "dp"}}, ...}``: the Mooncake RFC's shape next to Dynamo's own."""
    hits = json.loads(data).get("instances", {})
    return {k: v["longest_matched"] for k, v in hits.items() if v["longest_matched"]}


@dataclass
class Dynamo(_Running):
    """Dynamo's standalone indexer (``ai-dynamo-runtime``): JSON only, integer worker ids.

    ``threads`` > 1 runs its ``ThreadPoolIndexer`` (one radix tree per thread, workers
    sharded across them); 1 the single-threaded ``KvIndexer``.
    """

    threads: int = 2
    python: str = field(default_factory=dynamo_python)
    cpus: str | None = None
    modes: tuple[QueryMode, ...] = (QueryMode("json", JSON_TYPE, _dynamo_query, _dynamo_answer),)
    _process: ServiceProcess | None = None
    _client: Http | None = None

    @property
    def name(self) -> str:
        return f"dynamo-t{self.threads}"

    def start(self, run_dir: Path) -> None:
        port = free_port()
        command = [self.python, "-m", "dynamo.indexer", "--port", str(port)]
        command += ["--threads", str(self.threads)]
        log = run_dir / f"{self.name}.log"
        self._launch(command, port, log, self.cpus, {"DYN_LOG": "warn"}, "/health")

    def register(self, streams: Sequence[Stream], send_probes: ProbeSender) -> int:
        """``POST /register`` answers 201; the first registration of a model sets its
        block size. Its ``/workers`` "active" listener may precede the subscription, so
        probes prove each stream."""
        for stream in streams:
            body = {
                "instance_id": int(stream.instance_id),
                "endpoint": stream.endpoint,
                "model_name": MODEL,
                "block_size": BLOCK_SIZE,
            }
            status, data = self.client.raw("POST", "/register", json.dumps(body).encode())
            if status not in (200, 201):
                raise BenchError(f"{self.name} /register -> {status}: {data[:300]!r}")
        return register_by_probe(self, streams, send_probes)

    def counters(self, blocks: int, events: int) -> dict[str, float]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"cpus": self.cpus, "threads": self.threads, "python": self.python}


# -- upstream Mooncake C++ --------------------------------------------------------------
HASH_PROFILE = {
    "strategy": "vllm_v1",
    "algorithm": HASH_ALGORITHM,
    "python_hash_seed": HASH_SEED,
    "index_projection": "low64_be",
}


@dataclass
class Cpp(_Running):
    """Upstream Mooncake's C++ conductor (``mooncake_conductor``, built from its
    ``dev/conductor`` branch; see bench/README.md): msgpack only, both ways.

    Like the Go service it has no flags: ``CONDUCTOR_CONFIG_PATH`` names a JSON file with
    its port. Its HTTP server runs 4 threads (hard-coded); each registration adds a ZMQ
    thread. It keys blocks by the events' hashes and hashes a query's tokens with the
    registered ``hash_profile``, the vLLM chain the batches carry.
    """

    binary: Path
    cpus: str | None = None
    name: str = "cpp"
    modes: tuple[QueryMode, ...] = (
        QueryMode("msgpack", MSGPACK_TYPE, msgpack_query_body, _instances_msgpack),
    )
    _process: ServiceProcess | None = None
    _client: Http | None = None

    def start(self, run_dir: Path) -> None:
        port = free_port()
        config = run_dir / "cpp_config.json"
        config.write_text(json.dumps({"http_server_port": port, "kvevent_instance": {}}))
        env = {"CONDUCTOR_CONFIG_PATH": str(config), "CONDUCTOR_LOG_LEVEL": "WARN"}
        self._launch([str(self.binary)], port, run_dir / "cpp.log", self.cpus, env, "/services")

    def register(self, streams: Sequence[Stream], send_probes: ProbeSender) -> int:
        """A msgpack ``/register`` with the hash profile; its ZMQ connect is asynchronous
        (200 before the SUB joined), so probes prove each stream."""
        for stream in streams:
            body = vllm_registration(
                stream.endpoint, stream.instance_id, MODEL, hash_profile=HASH_PROFILE
            )
            status, data = self.client.raw("POST", "/register", msgpack.packb(body), MSGPACK_TYPE)
            if status != 200:
                raise BenchError(f"{self.name} /register -> {status}: {data[:300]!r}")
        return register_by_probe(self, streams, send_probes)

    def counters(self, blocks: int, events: int) -> dict[str, float]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"cpus": self.cpus, "binary": str(self.binary)}
