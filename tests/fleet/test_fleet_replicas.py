"""``router.replicas`` and ``conductor.replicas`` in a fleet file: several routers sharing
the conductors, conductors taking each other's snapshots at start; planned, and run through
``mooncake-fleet up`` over real processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from fleet.plan import make_plan
from fleet.spec import FleetSpec
from tests.support.fleet import FleetProcess

REPLICATED: dict[str, Any] = {
    "model": {"name": "m"},
    "block_size": 16,
    "conductor": {"replicas": 2},
    "router": {"replicas": 2, "policy": "round_robin"},
    "engines": [{"name": "sim-0", "kind": "sim"}, {"name": "sim-1", "kind": "sim"}],
}


def test_replicas_are_planned_with_their_peers_and_the_conductors(tmp_path: Path) -> None:
    plan = make_plan(FleetSpec.model_validate(REPLICATED), tmp_path, None)
    assert [c.name for c in plan.conductors] == ["conductor", "conductor-1"]
    assert [r.name for r in plan.routers] == ["router", "router-1"]
    assert len({service.url for service in plan.services}) == len(plan.services)
    urls = [conductor.url for conductor in plan.conductors]
    for n, name in enumerate(("conductor", "conductor-1")):
        config = json.loads((tmp_path / f"{name}_config.json").read_text())
        assert config["peers"] == [urls[1 - n]]
        assert config["snapshot_path"] == str(tmp_path / f"{name}.snapshot")
    router = json.loads((tmp_path / "router.json").read_text())
    assert router["conductor"]["address"] == urls  # registered with both, failing over
    assert all("router.json" in " ".join(r.argv) for r in plan.routers)


def test_one_conductor_keeps_its_config_as_before(tmp_path: Path) -> None:
    plan = make_plan(FleetSpec.model_validate({**REPLICATED, "conductor": {}}), tmp_path, None)
    config = json.loads((tmp_path / "conductor_config.json").read_text())
    assert "peers" not in config and "snapshot_path" not in config
    assert [c.name for c in plan.conductors] == ["conductor"]


def test_an_engine_cannot_take_a_replicas_name() -> None:
    engines = [{"name": "router-1", "kind": "sim"}]
    with pytest.raises(ValidationError, match="router-1: names of the fleet's own services"):
        FleetSpec.model_validate({**REPLICATED, "engines": engines})


async def test_a_replicated_fleet_serves_through_every_router(tmp_path: Path) -> None:
    fleet = FleetProcess(tmp_path / "run", REPLICATED)
    try:
        services = fleet.wait_ready(timeout=90)
        assert {"conductor", "conductor-1", "router", "router-1"} <= set(services)
        async with aiohttp.ClientSession() as http:
            for name in ("conductor", "conductor-1"):  # every router registered with both
                async with http.get(f"{services[name]['url']}/services") as response:
                    instances = {s["InstanceID"] for s in (await response.json())["services"]}
                assert instances == {"sim-0", "sim-1"}
            for name in ("router", "router-1"):
                body = {"model": "m", "prompt": "hello", "max_tokens": 2}
                url = f"{services[name]['url']}/v1/completions"
                async with http.post(url, json=body) as response:
                    assert response.status == 200, await response.text()
    finally:
        assert fleet.stop() == 0
