"""``mooncake-demo``: the whole stack on one machine, no GPU, no download.

Starts a conductor and N engine simulators that register their KV-event streams with it,
sends a few hundred requests that share long prefixes (documents with questions), first
round-robin and then guided by the conductor's ``/query``, and prints what the conductor
saw and what each way of routing got out of the prefix caches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from conductor.runtime import add_version_flag

from .local import LocalService

MODEL = "demo-model"
BLOCK_SIZE = 16
EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:0",
    "replay_endpoint": "tcp://127.0.0.1:0",
    "topic": "",
}
WORDS = (
    "cache prefix token block engine router latency memory tensor batch request model "
    "attention layer decode prefill index conductor store transfer fleet gpu queue"
).split()


@dataclass
class Stack:
    """The conductor and the engines as subprocesses; logs go to ``log_dir``."""

    log_dir: Path
    services: list[LocalService] = field(default_factory=list)

    async def serve(self, name: str, module: str, *args: str) -> str:
        service = LocalService(self.log_dir, name, module, *args)
        self.services.append(service)
        await asyncio.to_thread(service.wait_ready)  # a signal meanwhile is not held up
        return service.url

    def stop(self) -> None:
        """All at once: each may take up to its shutdown grace."""
        with ThreadPoolExecutor(max(len(self.services), 1)) as pool:
            list(pool.map(LocalService.stop, self.services))


def workload(requests: int, documents: int, seed: int) -> list[str]:
    """Prompts that share long prefixes: a few documents, many questions about each."""
    rng = random.Random(seed)
    docs = [
        f"Document {d}: " + " ".join(rng.choice(WORDS) for _ in range(600))
        for d in range(documents)
    ]
    weights = [1 / (d + 1) for d in range(documents)]  # some documents are popular
    return [
        f"{rng.choices(docs, weights)[0]}\nQuestion {i}: why is the {rng.choice(WORDS)} slow?"
        for i in range(requests)
    ]


async def wait_until(probe, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if await probe():
                return
        except (aiohttp.ClientError, OSError):
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError("the stack did not come up in time (see the logs)")


@dataclass
class PhaseResult:
    name: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    per_instance: Counter = field(default_factory=Counter)

    def line(self) -> str:
        ratio = self.cached_tokens / max(self.prompt_tokens, 1)
        mean = sum(self.ttft_ms) / max(len(self.ttft_ms), 1)
        spread = ", ".join(f"{k}: {v}" for k, v in sorted(self.per_instance.items()))
        return (
            f"  {self.name:<17} prefix-cache hit {ratio:6.1%}   mean TTFT {mean:8.1f} ms"
            f"   requests per instance {{{spread}}}"
        )


class Demo:
    def __init__(self, http: aiohttp.ClientSession, conductor: str, engines: dict[str, str]):
        self.http, self.conductor, self.engines = http, conductor, engines
        self.names = list(engines)

    async def best_instance(self, prompt: str, turn: int) -> str:
        """The mini-router: the instance the conductor says holds the longest prefix."""
        engine = self.engines[self.names[turn % len(self.names)]]
        async with self.http.post(
            f"{engine}/tokenize", json={"model": MODEL, "prompt": prompt}
        ) as response:
            tokens = (await response.json())["tokens"]
        body = {"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": tokens}
        async with self.http.post(f"{self.conductor}/query", json=body) as response:
            hits = (await response.json()).get("default", {})
        best = max((h["longest_matched"] for h in hits.values()), default=0)
        if best == 0:
            return self.names[turn % len(self.names)]
        leaders = sorted(name for name, h in hits.items() if h["longest_matched"] == best)
        return leaders[turn % len(leaders)]

    async def run_phase(self, name: str, prompts: list[str], guided: bool) -> PhaseResult:
        result = PhaseResult(name)
        limit = asyncio.Semaphore(8)

        async def one(turn: int, prompt: str) -> None:
            async with limit:
                if guided:
                    instance = await self.best_instance(prompt, turn)
                else:
                    instance = self.names[turn % len(self.names)]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
                url = f"{self.engines[instance]}/v1/completions"
                async with self.http.post(url, json=body) as response:
                    answer = await response.json()
                    ttft = response.headers.get("x-engine-ttft-ms")
                usage = answer["usage"]
                result.prompt_tokens += usage["prompt_tokens"]
                result.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                result.per_instance[instance] += 1
                if ttft is not None:
                    result.ttft_ms.append(float(ttft))

        await asyncio.gather(*(one(turn, prompt) for turn, prompt in enumerate(prompts)))
        return result

    async def reset_caches(self) -> None:
        for url in self.engines.values():
            async with self.http.post(f"{url}/reset_prefix_cache") as response:
                response.raise_for_status()

    async def conductor_view(self) -> str:
        async with self.http.get(f"{self.conductor}/global_view") as response:
            view = await response.json()
        lines = []
        for context in view["contexts"]:
            blocks = context["blocks"]
            lines.append(
                f"  context {context['model_name']} (block size {context['block_size']}): "
                f"{blocks['GPU']} GPU blocks, {blocks['CPU']} CPU, {blocks['DISK']} DISK, "
                f"instances {sorted(context['instances'])}"
            )
        return "\n".join(lines)


async def run(args: argparse.Namespace, stack: Stack) -> None:
    empty_config = stack.log_dir / "conductor_config.json"
    empty_config.write_text("{}")
    conductor = await stack.serve("conductor", "conductor", "--config", str(empty_config))
    urls = {
        name: await stack.serve(
            name,
            "publishers.engine",
            "--served-model-name",
            MODEL,
            "--block-size",
            str(BLOCK_SIZE),
            "--num-gpu-blocks-override",
            str(args.gpu_blocks),
            "--kv-events-config",
            json.dumps(EVENTS),
            "--sim-kv-bind",
            "--sim-instance-id",
            name,
            "--sim-register-with",
            conductor,
            "--sim-time-scale",
            str(args.time_scale),
        )  # fmt: skip
        for name in (f"engine-{i}" for i in range(args.engines))
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def all_connected() -> bool:
            async with http.get(f"{conductor}/services") as response:
                services = (await response.json())["services"]
            return len(services) == args.engines and all(
                s["State"] == "connected" for s in services
            )

        await wait_until(all_connected)
        await asyncio.sleep(0.2)
        demo = Demo(http, conductor, urls)
        prompts = workload(args.requests, args.documents, args.seed)
        print(f"{args.engines} engines, {len(prompts)} requests over {args.documents} documents")
        round_robin = await demo.run_phase("round robin", prompts, guided=False)
        print("\nwhat the conductor saw after the round-robin phase:")
        print(await demo.conductor_view())
        await demo.reset_caches()
        await asyncio.sleep(0.3)  # the AllBlocksCleared events reach the conductor
        guided = await demo.run_phase("conductor-guided", prompts, guided=True)
        print("\nwhat the conductor saw after the conductor-guided phase:")
        print(await demo.conductor_view())
        sample = prompts[0]
        async with http.post(
            f"{urls['engine-0']}/tokenize", json={"model": MODEL, "prompt": sample}
        ) as response:
            tokens = (await response.json())["tokens"]
        body = {"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": tokens}
        async with http.post(f"{conductor}/query", json=body) as response:
            answer = await response.json()
        print(f"\n/query for request 0 ({len(tokens)} tokens):")
        for name, hit in sorted(answer.get("default", {}).items()):
            print(f"  {name}: longest_matched {hit['longest_matched']}, GPU {hit['GPU']}")
        print("\nresults:")
        print(round_robin.line())
        print(guided.line())


async def run_until_signal(args: argparse.Namespace, stack: Stack) -> bool:
    """Run the demo; SIGINT or SIGTERM stops it at once (even when started with SIGINT
    ignored, as a shell's background job is). Returns False when interrupted."""
    demo = asyncio.current_task()
    assert demo is not None
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, demo.cancel)
    try:
        await run(args, stack)
    except asyncio.CancelledError:
        print("mooncake-demo: interrupted", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mooncake-demo",
        description="A conductor and engine simulators on this machine: the same requests "
        "routed round robin, then by the conductor's /query, and the prefix-cache hits of each.",
    )
    parser.add_argument("--engines", type=int, default=3, help="engine simulators (default 3)")
    parser.add_argument(
        "--requests", type=int, default=300, help="requests in each phase (default 300)"
    )
    parser.add_argument(
        "--documents",
        type=int,
        default=12,
        help="shared documents the prompts ask about, their long common prefixes (default 12)",
    )
    parser.add_argument(
        "--gpu-blocks",
        type=int,
        default=400,
        help="KV blocks per engine, 16 tokens each (default 400)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.01,
        help="the engines' wall seconds per simulated second (default 0.01)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the generated prompts (default 0)"
    )
    add_version_flag(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mooncake-demo-") as log_dir:
        stack = Stack(Path(log_dir))
        try:
            completed = asyncio.run(run_until_signal(args, stack))
        except (TimeoutError, RuntimeError, aiohttp.ClientError) as error:
            print(f"mooncake-demo: {error}", file=sys.stderr)
            for log in sorted(Path(log_dir).glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
            sys.exit(1)
        finally:
            stack.stop()
        if not completed:
            sys.exit(130)


if __name__ == "__main__":
    main()
