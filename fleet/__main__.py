"""``mooncake-fleet up FLEET.json``: conductor, engines and router, in one command.

Starts the conductor (and the Mooncake store, when the fleet file has one: its master,
then the store process lending it memory), then every engine (real vLLM or SGLang on CPU,
or the simulator) at once, then the router in front; waits for each to be healthy and for
the conductor to subscribe to every engine's event stream; prints the URLs and waits. Ctrl-C or
SIGTERM stops everything (router, engines, store, conductor, with their child processes).
A process that exits on its own is reported with the last lines of its log and the rest of
the fleet is stopped: a fleet with a hole in it would hide the failure behind the router's
fallbacks.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from conductor.config import one_line
from conductor.runtime import add_version_flag, run

from . import spec as fleet_spec
from .plan import FleetPlan, make_plan, socket_path_problem
from .supervisor import HEALTH_TIMEOUT, STOP_TIMEOUT_S, ChildProcess, wait_until_healthy
from .tiny_model import write_tiny_model
from .watchdog import Watchdog

REGISTRATION_TIMEOUT_S = 30.0
EXIT_CRASHED = 1


class Fleet:
    def __init__(self, plan: FleetPlan, startup_timeout_s: float) -> None:
        self.plan = plan
        self.startup_timeout_s = startup_timeout_s
        log_dir = plan.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children = {s.name: ChildProcess(s, log_dir) for s in plan.services}
        self.watchdog = Watchdog(log_dir / "watchdog.log", STOP_TIMEOUT_S)
        self.started = time.monotonic()
        self.stop_requested = asyncio.Event()
        self.ready = False  # from here on, up() itself stops the fleet on a signal

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)

    def report_crash(self, child: ChildProcess) -> None:
        self.say(
            f"{child.name} exited with code {child.exit_code}; last lines of {child.log_path}:"
        )
        print(child.log_tail(), flush=True)

    async def _start(self, names: list[str], http: aiohttp.ClientSession) -> bool:
        children = [self.children[name] for name in names]
        for child in children:
            await child.start()
            assert child.process is not None
            self.watchdog.watch(child.process.pid)
            self.say(f"starting {child.name} ({child.plan.kind}), log {child.log_path}")
        deadline = self.started + self.startup_timeout_s
        return await wait_until_healthy(children, http, deadline, self.say, self.report_crash)

    async def _subscribed(self, http: aiohttp.ClientSession) -> bool:
        """Until every conductor holds a connected stream for every engine (the routers
        register them with each when they start)."""
        wanted = {engine.name for engine in self.plan.engines}
        missing = {conductor.name: wanted for conductor in self.plan.conductors}
        deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
        while time.monotonic() < deadline:
            for child in self.children.values():
                if child.exit_code is not None:
                    self.report_crash(child)
                    return False
            for conductor in self.plan.conductors:
                missing[conductor.name] = wanted - await self._connected(http, conductor.url)
            if not any(missing.values()):
                return True
            await asyncio.sleep(0.25)
        for name, engines in missing.items():
            if engines:
                self.say(f"the {name} did not subscribe to {sorted(engines)} in time")
        return False

    async def _connected(self, http: aiohttp.ClientSession, conductor: str) -> set[str]:
        """The instances whose streams ``conductor`` has connected (none while it fails)."""
        try:
            async with http.get(f"{conductor}/services", timeout=HEALTH_TIMEOUT) as response:
                services = (await response.json())["services"]
            return {s["InstanceID"] for s in services if s["State"] == "connected"}
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return set()  # a conductor that misbehaves shows as a crash or as this timeout

    async def up(self) -> int:
        """Runs the fleet until a signal (0) or a crash (1)."""
        engines = [engine.name for engine in self.plan.engines]
        store = [[s.master.name], [s.store.name]] if (s := self.plan.store) else []
        conductors = [conductor.name for conductor in self.plan.conductors]
        routers = [router.name for router in self.plan.routers]
        stages = [conductors, *store, engines, routers]  # each waits for the one before
        async with aiohttp.ClientSession() as http:
            try:
                await self.watchdog.start()
                ok = True
                for names in stages:
                    ok = ok and await self._start(names, http)
                ok = ok and await self._subscribed(http)
            except (TimeoutError, OSError) as error:  # OSError: a command that cannot start
                self.say(str(error))
                ok = False
            if not ok:
                await self.stop()
                return EXIT_CRASHED
            self.print_ready()
            self.ready = True
            crashed = await self._watch()
        await self.stop()
        return EXIT_CRASHED if crashed else 0

    async def _watch(self) -> bool:
        """Waits for a stop request (False) or for a child to exit (True)."""
        exits = {
            asyncio.ensure_future(child.process.wait()): child
            for child in self.children.values()
            if child.process is not None
        }
        stop = asyncio.ensure_future(self.stop_requested.wait())
        done, _ = await asyncio.wait([stop, *exits], return_when=asyncio.FIRST_COMPLETED)
        for future in [stop, *exits]:
            future.cancel()
        crashed = [exits[future] for future in done if future in exits]
        for child in crashed:
            self.report_crash(child)
        return bool(crashed)

    def print_ready(self) -> None:
        """Writes ``fleet.json`` (for scripts), then tells the operator."""
        state = {
            child.name: {
                "kind": child.plan.kind,
                "url": child.plan.url,
                "pid": child.process.pid if child.process else None,
                "log": str(child.log_path),
                "events_endpoint": child.plan.events_endpoint,
                "replay_endpoint": child.plan.replay_endpoint,
                **child.plan.details,
            }
            for child in self.children.values()
        }
        partial = self.plan.run_dir / "fleet.json.partial"
        partial.write_text(json.dumps(state, indent=2) + "\n")
        partial.replace(self.plan.run_dir / "fleet.json")  # whole or absent, never half
        self.say(f"fleet ready in {time.monotonic() - self.started:.1f} s")
        for child in self.children.values():
            memory = child.rss_bytes() / 2**20
            print(f"  {child.name:<15} {child.plan.kind:<9} {child.plan.url:<24} {memory:7.0f} MiB")
        if store := self.plan.store:
            print(
                f"  KV store: master {store.address.master}, admin {store.admin_url}, "
                f"{store.segment_mb} MiB in {store.store.name}; engines' config "
                f"{store.config_path}"
            )
        print(f"  logs and configs: {self.plan.run_dir}", flush=True)
        print("  Ctrl-C stops the fleet.", flush=True)

    async def stop(self) -> None:
        """Router first (no new requests), then the engines (at once: SGLang takes seconds to
        stop), the store, the conductor."""
        store = [[s.store.name], [s.master.name]] if (s := self.plan.store) else []
        engines = [engine.name for engine in self.plan.engines]
        conductors = [conductor.name for conductor in self.plan.conductors]
        stages = [[router.name for router in self.plan.routers], engines, *store, conductors]
        running = [
            [self.children[name] for name in stage if self.children[name].process]
            for stage in stages
        ]
        if names := [child.name for stage in running for child in stage]:
            self.say("stopping " + ", ".join(names))
        for stage in running:
            await asyncio.gather(*(child.stop() for child in stage))
            for child in stage:
                assert child.process is not None
                self.watchdog.forget(child.process.pid)
        await self.watchdog.close()
        for engine in self.plan.engines:
            if engine.tmp_dir is not None:
                shutil.rmtree(engine.tmp_dir, ignore_errors=True)  # vLLM's /tmp leftovers
            if engine.socket_path is not None:
                engine.socket_path.unlink(missing_ok=True)
        self.say("fleet stopped")


def model_directory(spec: fleet_spec.FleetSpec) -> Path | None:
    """The tiny model's directory, written on first use, when a model without a ``path`` has
    its directory read (by real engines, or simulators and the router tokenizing with it).
    Says which directories are read, and when it writes."""
    for path in spec.model_paths():
        print(f"model: {path}", flush=True)
    if not spec.needs_tiny_model:
        return None
    directory = Path(fleet_spec.DEFAULT_TINY_MODEL_DIR).expanduser()
    if directory.exists():
        print(f"model: {directory} (the tiny model, written by an earlier run)", flush=True)
    else:
        print(
            f"model: writing the tiny model to {directory} (once: later runs reuse it)", flush=True
        )
        write_tiny_model(directory)
    return directory


@dataclass(frozen=True)
class RunDirectory:
    """Logs, configs and sockets of one run. A directory the fleet made goes when the fleet
    stops cleanly, unless kept; one the user named is theirs and stays; after a crash it
    stays, because its logs say why."""

    path: Path
    made_here: bool
    keep: bool

    @classmethod
    def choose(cls, given: Path | None, keep: bool) -> RunDirectory:
        if given is not None:
            return cls(given.resolve(), made_here=False, keep=True)
        made = Path(tempfile.mkdtemp(prefix="mooncake-fleet-")).resolve()
        return cls(made, made_here=True, keep=keep)

    def announce(self) -> str:
        if not self.made_here:
            fate = "yours: kept"
        elif self.keep:
            fate = "kept: --keep-run-dir"
        else:
            fate = "removed when the fleet stops cleanly; --keep-run-dir keeps it"
        return f"run directory: {self.path} (logs, configs, sockets; {fate})"

    def finish(self, exit_code: int) -> str:
        """Removes the directory after a clean stop when it may; says what became of it."""
        if exit_code != 0:
            return f"run directory kept for its logs: {self.path}"
        if self.keep:
            return f"run directory kept: {self.path}"
        shutil.rmtree(self.path, ignore_errors=True)
        return f"run directory removed: {self.path}"


async def serve(fleet: Fleet) -> int:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, fleet.stop_requested.set)
    up = asyncio.ensure_future(fleet.up())
    stop = asyncio.ensure_future(fleet.stop_requested.wait())
    await asyncio.wait([up, stop], return_when=asyncio.FIRST_COMPLETED)
    if not up.done() and not fleet.ready:  # a signal while starting: stop what is up
        up.cancel()
        await asyncio.gather(up, return_exceptions=True)
        await fleet.stop()
        return 0
    stop.cancel()
    return await up


def missing_engine(spec: fleet_spec.FleetSpec) -> str | None:
    """Why a real engine of the fleet cannot start: its venv is not installed."""
    engines = [
        ("vllm", "vLLM", spec.vllm_interpreter()),
        ("sglang", "SGLang", spec.sglang_interpreter()),
    ]
    for kind, title, interpreter in engines:
        if spec.has_kind(kind) and not interpreter.exists():
            return (
                f"no {title} at {interpreter}: run scripts/install-{kind}-cpu.sh, or set "
                f"{kind.upper()}_PYTHON (or the fleet's {kind}_python)"
            )
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-fleet", description="Run a conductor, engines and a router together."
    )
    add_version_flag(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = commands.add_parser(
        "up",
        help="start the fleet and wait for Ctrl-C",
        description="Start the fleet a fleet file describes (docs/fleet.md) and run it until "
        "Ctrl-C or SIGTERM.",
    )
    up.add_argument(
        "fleet_file", type=Path, help="the fleet file (JSON), e.g. config/fleet-sim.json"
    )
    up.add_argument(
        "--run-dir",
        type=Path,
        help="where logs, configs and sockets go, kept after the fleet stops (default: a new "
        "temporary directory, removed when the fleet stops cleanly)",
    )
    up.add_argument(
        "--keep-run-dir",
        action="store_true",
        help="keep the temporary run directory after a clean stop (it is always kept after "
        "a crash)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        spec = fleet_spec.load(args.fleet_file)
    except (OSError, ValueError) as error:
        sys.exit(f"mooncake-fleet: {args.fleet_file}: {one_line(error)}")
    if missing := missing_engine(spec):
        sys.exit(f"mooncake-fleet: {missing}")
    if spec.kv_store is not None and importlib.util.find_spec("mooncake") is None:
        sys.exit(
            f"mooncake-fleet: {args.fleet_file}: kv_store needs the Mooncake store: "
            "pip install -e '.[store]'"
        )
    try:
        model_dir = model_directory(spec)
    except OSError as error:
        sys.exit(f"mooncake-fleet: cannot write the tiny model: {error}")
    run_dir = RunDirectory.choose(args.run_dir, args.keep_run_dir)
    if problem := socket_path_problem(spec, run_dir.path):
        run_dir.finish(0)  # nothing written to it yet: a directory made here goes
        sys.exit(f"mooncake-fleet: {problem}")
    print(run_dir.announce(), flush=True)
    plan = make_plan(spec, run_dir.path, model_dir)
    exit_code = EXIT_CRASHED  # unless the fleet returns: a traceback's logs are kept too
    try:
        exit_code = run(serve(Fleet(plan, spec.startup_timeout_s)))
    finally:
        print(run_dir.finish(exit_code), flush=True)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
