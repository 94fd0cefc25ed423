"""deploy/'s Kubernetes manifests played with `podman kube play`, end to end: the conductor's
Deployment, two engine pods of the simulated engines' StatefulSet (deploy/sim/engine.yaml:
the simulator plus the registrar sidecar) and the router's Deployment. A request sent twice
through the router lands the second time on the engine holding its prefix, the conductor
sees that engine's blocks, and an engine pod deleted leaves the conductor's /services (its
registrar unregistered it at SIGTERM).

What is played is the files users apply, read here, with only what one host without a
cluster needs changed (`for_podman` and the `*_config` functions):

* the ConfigMaps' values: every address 127.0.0.1 and every port a free one (the pods share
  the host's network, so no two may bind the same port, and nothing may listen beyond
  loopback), the conductor's register_allow the engines' 127.0.0.1;
* each workload's pod spec: ``hostNetwork: true`` (so no container ``ports``: podman would
  map them, and refuses to on the host's network), the image this tree built, never pulled;
* the StatefulSet, which podman 4.3 cannot play: its pod template played as the pods the
  StatefulSet would make, engine-0 and engine-1, each with its own ConfigMap values.

Services are in the played files too; podman skips them (they are a cluster's)."""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from publishers.local import HOST, free_port
from tests.container.manifests import (
    DEPLOY,
    PROJECT_IMAGE,
    WORKLOADS,
    documents,
    one,
    pod_spec,
    yaml,
)
from tests.container.podman import IMAGE, podman

pytestmark = pytest.mark.needs("podman")

PROMPT = "The conductor indexes every engine's KV blocks. " * 12


def for_podman(docs: list[dict[str, Any]], configmaps: dict[str, dict[str, str]]) -> list[Any]:
    """The documents as this host plays them: each named ConfigMap's values replaced (only
    keys it already has: a key the manifests lost fails here), each pod on the host's
    network with this tree's image."""
    played = copy.deepcopy(docs)
    for doc in played:
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] in configmaps:
            values = configmaps[doc["metadata"]["name"]]
            unknown = set(values) - set(doc["data"])
            assert not unknown, f"ConfigMap {doc['metadata']['name']} has no {sorted(unknown)}"
            doc["data"].update(values)
        if doc["kind"] in WORKLOADS:
            spec = pod_spec(doc)
            spec["hostNetwork"] = True
            for container in spec["containers"]:
                # with the host's network podman would map them, and refuses to
                container.pop("ports", None)
                if container["image"].split(":")[0] == PROJECT_IMAGE:
                    container["image"] = IMAGE
                    container["imagePullPolicy"] = "Never"
    return played


def named_volumes(docs: list[dict[str, Any]]) -> set[str]:
    """The volumes `podman kube play` makes of these documents and `kube down` leaves: one
    per PersistentVolumeClaim, and one per ConfigMap a pod mounts, by its name."""
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            for volume in pod_spec(doc).get("volumes", []):
                if "configMap" in volume:
                    names.add(volume["configMap"]["name"])
    return names


def statefulset_pod(statefulset: dict[str, Any], ordinal: int) -> dict[str, Any]:
    """The pod a StatefulSet makes: its template, named <set>-<ordinal> (its hostname too)."""
    template = copy.deepcopy(statefulset["spec"]["template"])
    name = f"{statefulset['metadata']['name']}-{ordinal}"
    metadata = {**template.get("metadata", {}), "name": name}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def _http(
    method: str, url: str, body: Any = None, timeout: float = 5
) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()
    except OSError:
        return 0, {}, b""


def _json(method: str, url: str, body: Any = None) -> Any:
    status, _, raw = _http(method, url, body)
    return json.loads(raw) if status == 200 else None


class Played:
    """The kube files one test played, each taken down (and its volumes removed) at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[str, Path] = {}
        self.volumes: set[str] = set()
        self.timings: dict[str, float] = {}

    def play(self, name: str, docs: list[Any]) -> float:
        path = self.folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        self.files[name] = path
        for volume in named_volumes(docs):  # podman's, left by kube down
            self.volumes.add(volume)
            podman("volume", "rm", "--force", volume, check=False)
        started = time.monotonic()
        podman("kube", "play", str(path), timeout=120)
        self.timings[f"play {name}"] = took = time.monotonic() - started
        return took

    def delete_pod(self, name: str) -> float:
        """As Kubernetes deletes a pod: SIGTERM to its containers, SIGKILL after the grace
        period (podman's stop timeout, 10 s), then removal. podman 4.3's `kube down` alone
        removes the pod without letting its containers handle a SIGTERM."""
        started = time.monotonic()
        podman("pod", "stop", name, timeout=60)
        podman("kube", "down", str(self.files.pop(name)), timeout=60)
        self.timings[f"delete {name}"] = took = time.monotonic() - started
        return took

    def logs(self) -> str:
        listed = podman("ps", "--all", "--format", "{{.Names}}", check=False).stdout.split()
        ours = [n for n in listed if any(n.startswith(f"{f}-") for f in self.files)]
        parts = []
        for name in ours:
            result = podman("logs", "--tail", "30", name, check=False)
            parts.append(f"--- {name}\n{result.stdout}{result.stderr}")
        return "\n".join(parts)

    def remove_all(self) -> None:
        for name in list(self.files):
            podman("kube", "down", str(self.files.pop(name)), timeout=60, check=False)
        for volume in self.volumes:
            podman("volume", "rm", "--force", volume, check=False)


@pytest.fixture
def played(tmp_path: Path) -> Iterator[Played]:
    made = Played(tmp_path)
    yield made
    print("kube timings (s):", {k: round(v, 2) for k, v in made.timings.items()})
    made.remove_all()


def wait_for(what: str, ready: Callable[[], Any], played: Played, timeout: float) -> Any:
    """Until ``ready()`` is truthy; fails with the pods' logs after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s\n{played.logs()}")
        time.sleep(0.3)
    return value


# -- each ConfigMap as this host needs it -------------------------------------------------


def conductor_config(shipped: dict[str, Any], port: int) -> dict[str, str]:
    config = json.loads(shipped["data"]["conductor_config.json"])
    assert config["register_allow"], "the conductor must be told which engines may register"
    # the engines' address here; the shipped list (the pod network's CIDRs) would refuse it
    config.update(host=HOST, http_server_port=port, register_allow=[HOST])
    return {"conductor_config.json": json.dumps(config)}


def engine_config(shipped: dict[str, Any], conductor: int, ports: dict[str, int]) -> dict[str, str]:
    events = json.loads(shipped["data"]["KV_EVENTS_CONFIG"])
    events["endpoint"] = f"tcp://{HOST}:{ports['events']}"
    events["replay_endpoint"] = f"tcp://{HOST}:{ports['replay']}"
    return {
        "ENGINE_HOST": HOST,
        "ENGINE_PORT": str(ports["http"]),
        "KV_EVENTS_CONFIG": json.dumps(events),
        "REGISTRAR_CONDUCTOR": f"http://{HOST}:{conductor}",
        "REGISTRAR_ENGINE_URL": f"http://{HOST}:{ports['http']}",
        "REGISTRAR_HEALTH_HOST": HOST,
        "REGISTRAR_HEALTH_PORT": str(ports["registrar"]),
    }


def router_config(
    shipped: dict[str, Any], port: int, conductor: int, engines: dict[str, int]
) -> dict[str, str]:
    config = json.loads(shipped["data"]["router.json"])
    config["conductor"]["address"] = f"http://{HOST}:{conductor}"
    (model,) = config["models"]
    listed = {instance["instance_id"] for instance in model["instances"]}
    assert listed == set(engines), f"the router lists {listed}, the StatefulSet makes {engines}"
    for instance in model["instances"]:
        instance["http_endpoint"] = f"http://{HOST}:{engines[instance['instance_id']]}"
    return {"host": HOST, "port": str(port), "router.json": json.dumps(config)}


# -- the test -----------------------------------------------------------------------------


def test_manifests_route_by_prefix_and_an_engine_pod_deleted_leaves_the_index(
    played: Played,
) -> None:
    conductor_docs = documents(DEPLOY / "base/conductor.yaml")
    router_docs = documents(DEPLOY / "base/router.yaml")
    engine_docs = documents(DEPLOY / "sim/engine.yaml")
    statefulset = one(engine_docs, "StatefulSet", "engine")
    replicas = statefulset["spec"]["replicas"]
    assert replicas == 2
    model = one(engine_docs, "ConfigMap", "engine")["data"]["ENGINE_MODEL"]
    block_size = int(one(engine_docs, "ConfigMap", "engine")["data"]["ENGINE_BLOCK_SIZE"])

    conductor_port = free_port()
    conductor = f"http://{HOST}:{conductor_port}"
    played.play("conductor", for_podman(conductor_docs, {
        "conductor": conductor_config(one(conductor_docs, "ConfigMap", "conductor"), conductor_port)
    }))  # fmt: skip
    wait_for("the conductor's /health", lambda: _json("GET", f"{conductor}/health"), played, 60)

    engines = [f"engine-{i}" for i in range(replicas)]
    engine_ports: dict[str, int] = {}
    for ordinal, name in enumerate(engines):
        ports = {key: free_port() for key in ("http", "events", "replay", "registrar")}
        engine_ports[name] = ports["http"]
        docs = [
            d if d["kind"] != "StatefulSet" else statefulset_pod(d, ordinal) for d in engine_docs
        ]
        values = engine_config(one(engine_docs, "ConfigMap", "engine"), conductor_port, ports)
        played.play(name, for_podman(docs, {"engine": values}))

    def services() -> dict[str, dict[str, Any]]:
        answer = _json("GET", f"{conductor}/services") or {"services": []}
        return {s["InstanceID"]: s for s in answer["services"]}

    def all_connected() -> bool:
        found = services()
        return all(found.get(n, {}).get("State") == "connected" for n in engines)

    # the registrars waited for their engines' health, then registered both streams
    wait_for("both engines registered and connected", all_connected, played, 90)
    registered = services()
    for name in engines:
        assert registered[name]["ModelName"] == model, registered[name]
        assert registered[name]["BlockSize"] == block_size, registered[name]
    # the registrations persisted on the state volume (the image's user can write it)
    state = podman("exec", "conductor-pod-0-conductor", "cat", "/var/lib/conductor/state.json")
    assert all(name in state.stdout for name in engines), state.stdout

    router_port = free_port()
    router = f"http://{HOST}:{router_port}"
    played.play("router", for_podman(router_docs, {
        "router": router_config(
            one(router_docs, "ConfigMap", "router"), router_port, conductor_port, engine_ports
        )
    }))  # fmt: skip

    def router_ready() -> bool:
        health = _json("GET", f"{router}/health")
        return health is not None and health["status"] == "ok"

    wait_for("the router's /health ok", router_ready, played, 60)

    def complete() -> dict[str, str]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4}
        status, headers, raw = _http("POST", f"{router}/v1/completions", body, timeout=30)
        assert status == 200, (status, raw[:500], played.logs())
        assert json.loads(raw)["choices"][0]["text"]
        return {k.lower(): v for k, v in headers.items()}

    first = complete()
    first_done = time.monotonic()
    holder = first["x-conductor-prefill-instance"]
    assert holder in engines, first
    tokens = _json("POST", f"{router}/tokenize", {"model": model, "prompt": PROMPT})["tokens"]
    query = {"model": model, "block_size": block_size, "token_ids": tokens}

    def matched() -> dict[str, int]:
        answer = _json("POST", f"{conductor}/query", query) or {}
        found = answer.get("default", {})
        return {
            name: hit["longest_matched"] for name, hit in found.items() if hit["longest_matched"]
        }

    # the holder's KV events reached the conductor: its blocks, and no one else's
    hits = wait_for("the conductor indexing the holder's blocks", matched, played, 20)
    assert set(hits) == {holder}, hits
    assert hits[holder] >= block_size * (len(tokens) // block_size) - block_size, (hits, tokens)

    # past the router's own memory of prompts in flight (2 s): the index decides
    time.sleep(max(0.0, first_done + 2.5 - time.monotonic()))
    second = complete()
    assert second["x-conductor-prefill-instance"] == holder, second
    assert int(second["x-conductor-cached-tokens"]) > 0, second
    assert "x-conductor-fallback" not in second, second

    # the holder's pod deleted: its registrar unregistered it at SIGTERM, so the conductor
    # lists it no more and answers for its blocks no more (a lost publisher alone keeps the
    # registration: it would still be listed)
    other = next(name for name in engines if name != holder)
    took = played.delete_pod(holder)
    assert took < 30, f"deleting the pod took {took:.1f} s"
    wait_for(f"{holder} gone from /services", lambda: holder not in services(), played, 15)
    assert services()[other]["State"] == "connected"
    assert holder not in matched()
