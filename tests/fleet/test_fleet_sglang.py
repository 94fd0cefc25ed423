"""``kind: "sglang"`` engines in a fleet, without SGLang: the command, environment and
registration the plan builds, the fleet file's rules, and how the supervisor stops a
service that must be stopped through its main process and leaves files in /dev/shm."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from fleet.plan import VLLM_SHM_PREFIXES, make_plan
from fleet.service import ServicePlan
from fleet.spec import FleetSpec, load
from fleet.supervisor import ChildProcess

MIXED = {
    "engines": [{"name": "vllm-0", "kind": "vllm"}, {"name": "sglang-0", "kind": "sglang"}],
    "vllm_python": "/opt/vllm/bin/python",
    "sglang_python": "/opt/sglang/bin/python",
}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_an_sglang_engine_runs_on_the_cpu_with_the_fleets_model_and_block_size(
    tmp_path: Path,
) -> None:
    spec = FleetSpec.model_validate(
        MIXED | {"model": {"name": "tiny"}, "engines": MIXED["engines"][1:], "block_size": 16}
    )
    plan = make_plan(spec, tmp_path / "run", model_dir=tmp_path / "model")
    [engine] = plan.engines
    assert engine.argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert _flag(engine.argv, "--model-path") == str(tmp_path / "model")
    assert _flag(engine.argv, "--served-model-name") == "tiny"
    assert _flag(engine.argv, "--page-size") == "16"
    assert _flag(engine.argv, "--max-total-tokens") == "8192"
    assert _flag(engine.argv, "--device") == "cpu"
    assert {"--enable-cache-report", "--skip-server-warmup"} <= set(engine.argv)
    assert _flag(engine.argv, "--host") == "127.0.0.1"
    events = json.loads(_flag(engine.argv, "--kv-events-config"))
    assert events["bind"] is True and events["topic"] == "kv-events"
    assert events["endpoint"] == engine.events_endpoint
    assert events["replay_endpoint"] == engine.replay_endpoint
    for endpoint in (engine.events_endpoint, engine.replay_endpoint):
        assert endpoint.startswith("tcp://127.0.0.1:")
    assert engine.events_endpoint != engine.replay_endpoint
    assert engine.env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert engine.env["HF_HUB_OFFLINE"] == engine.env["TRANSFORMERS_OFFLINE"] == "1"
    run_dir = str(tmp_path / "run")
    assert engine.env["TMPDIR"] == str(engine.tmp_dir) and str(engine.tmp_dir).startswith(run_dir)
    assert str(engine.env["SGLANG_CACHE_DIR"]).startswith(str(engine.tmp_dir))
    assert engine.stop_main_only and engine.shm_prefixes
    assert engine.health_endpoint == f"{engine.url}/health"
    assert engine.socket_path is None  # nothing of it to remove in the run directory


def test_later_engine_args_override_the_fleets_flags(tmp_path: Path) -> None:
    """SGLang's parser keeps a flag's last value, so an engine's ``args`` win."""
    entry = {"name": "small", "kind": "sglang", "args": ["--max-total-tokens", "1024"]}
    spec = FleetSpec.model_validate(MIXED | {"engines": [entry]})
    [engine] = make_plan(spec, tmp_path, model_dir=tmp_path / "model").engines
    assert engine.argv[-2:] == ["--max-total-tokens", "1024"]


def test_a_mixed_fleet_registers_each_engine_as_its_kind_on_its_own_cpus(tmp_path: Path) -> None:
    plan = make_plan(FleetSpec.model_validate(MIXED), tmp_path, model_dir=tmp_path / "model")
    vllm, sglang = plan.engines
    router = json.loads((tmp_path / "router.json").read_text())
    types = {
        instance["instance_id"]: [r["type"] for r in instance["registrations"]]
        for instance in router["prefill"]["instances"]
    }
    assert types == {"vllm-0": ["vLLM"], "sglang-0": ["SGLang"]}
    assert router["tokenizer"] == {"path": str(tmp_path / "model")}
    vllm_cpus = {int(cpu) for cpu in str(vllm.env["VLLM_CPU_OMP_THREADS_BIND"]).split(",")}
    if len(vllm_cpus | set(sglang.cpus)) > 1:  # one CPU alone is shared, round-robin
        assert not vllm_cpus & set(sglang.cpus)
    assert not vllm.stop_main_only and vllm.shm_prefixes == VLLM_SHM_PREFIXES


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"block_size": 16}, "vLLM on CPU needs a block_size multiple of 32, not 16"),
        ({"kv_store": {}}, "kv_store: SGLang engines do not save to a Mooncake store here"),
    ],
)
def test_what_a_fleet_with_sglang_refuses(change: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        FleetSpec.model_validate(MIXED | change)


def test_missing_sglang_names_the_install_script(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    spec = {
        "engines": [{"name": "x", "kind": "sglang"}],
        "sglang_python": str(tmp_path / "none"),
    }
    path.write_text(json.dumps(spec))
    result = subprocess.run(
        [sys.executable, "-m", "fleet", "up", str(path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    assert "no SGLang at" in result.stderr and "scripts/install-sglang-cpu.sh" in result.stderr


# A server shaped like SGLang's: its main process holds a file in /dev/shm and has a child;
# on SIGTERM it stops the child itself, a moment later (SIGUSR1); the child logs the first
# signal it receives.
MAIN_AND_CHILD = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    held = open(sys.argv[1], "w")
    child = subprocess.Popen([sys.executable, "-c", '''
    import signal, sys, time
    def log(signum, frame):
        print("child got", signal.Signals(signum).name, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, log)
    signal.signal(signal.SIGUSR1, log)
    print("child ready", flush=True)
    time.sleep(60)
    '''])
    def stop(signum, frame):
        time.sleep(0.5)
        child.send_signal(signal.SIGUSR1)
        child.wait()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("main_only", [True, False], ids=["main-only", "tree"])
async def test_a_service_stops_through_its_main_process_and_its_shm_files_go(
    tmp_path: Path, main_only: bool
) -> None:
    prefix = f"/dev/shm/mooncake-test-{uuid.uuid4().hex[:8]}-"
    held, unrelated = Path(f"{prefix}held"), Path(f"{prefix}another-process")
    unrelated.write_text("")  # the same prefix, but no process of the service holds it
    plan = ServicePlan(
        name="server",
        kind="sglang",
        argv=[sys.executable, "-c", MAIN_AND_CHILD, str(held)],
        url="http://127.0.0.1:1",
        stop_main_only=main_only,
        shm_prefixes=(prefix,),
    )
    child = ChildProcess(plan, tmp_path)
    try:
        await child.start()
        log = child.log_path
        for _ in range(200):  # 10 s at most
            if "child ready" in log.read_text() and held.exists():
                break
            await asyncio.sleep(0.05)
        await child.stop(timeout=10)
        expected = "child got SIGUSR1" if main_only else "child got SIGTERM"
        assert expected in log.read_text()
        assert not held.exists() and unrelated.exists()
    finally:
        unrelated.unlink(missing_ok=True)
        held.unlink(missing_ok=True)


@pytest.mark.parametrize("name", ["fleet-sglang.json", "fleet-mixed.json"])
def test_the_example_fleet_files_hold(tmp_path: Path, name: str) -> None:
    spec = load(Path(__file__).parents[2] / "config" / name)
    kinds = {engine.kind for engine in spec.engines}
    assert "sglang" in kinds and make_plan(spec, tmp_path, tmp_path / "model").engines
