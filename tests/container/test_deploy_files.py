"""deploy/'s files read without running them (test_deploy.py plays the manifests with podman;
no Kubernetes cluster and no Compose runs here): each kustomization lists every manifest and
renders them unchanged but for the image (when kubectl is installed), the ConfigMaps hold
configurations the commands accept and addresses that point at each other's Services, every
shell command line expands to arguments the command's own parser takes, nothing uses what
podman 4.3 cannot play, the shutdown order holds, and the compose file is checked the same
way against its services' names (no Compose runs here: a structural check)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from conductor import __main__ as conductor_main
from conductor.config import load_config
from fleet.registrar.settings import Settings, parse_settings
from publishers.engine import __main__ as engine_sim
from router import __main__ as router_main
from router import config as router_config
from tests.container.manifests import (
    DEPLOY,
    PROJECT_IMAGE,
    WORKLOADS,
    documents,
    one,
    pod_spec,
    yaml,
)
from tests.container.podman import REPO
from tests.support.parts import VLLM_PYTHON

OVERLAYS = ("sim", "vllm")
# the conductor's settings the Dockerfile's ENV sets (CONDUCTOR_CONFIG_PATH among them)
IMAGE_ENV = dict(re.findall(r"(CONDUCTOR_\w+)=(\S+)", (REPO / "Dockerfile").read_text()))


def manifests(overlay: str) -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/<overlay>` applies, from the plain files."""
    return [
        doc
        for path in (DEPLOY / "base/conductor.yaml", DEPLOY / "base/router.yaml",
                     DEPLOY / overlay / "engine.yaml")
        for doc in documents(path)
    ]  # fmt: skip


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec(doc)["containers"] if c["name"] == name]
    return found


def environment(docs: list[dict[str, Any]], spec: dict[str, Any], pod_name: str) -> dict[str, str]:
    """A container's environment as the kubelet gives it (envFrom, then env)."""
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in spec.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "configMapKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = one(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[item["name"]] = pod_name
    return env


def argv(spec: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The arguments a container's `sh -c "exec CMD ..."` runs CMD with, expanded by sh."""
    command = spec["command"]
    if command[:2] != ["sh", "-c"]:
        return [*command[1:], *spec.get("args", [])]
    script = command[2]
    assert script.startswith("exec "), script
    program, rest = script.removeprefix("exec ").split(" ", 1)
    result = subprocess.run(
        ["sh", "-c", f"printf '%s\\0' {rest}"], env=env, capture_output=True, text=True,
        timeout=10, check=True,
    )  # fmt: skip
    return result.stdout.split("\0")[:-1]


def service_url(docs: list[dict[str, Any]], name: str) -> str:
    (port,) = one(docs, "Service", name)["spec"]["ports"]
    return f"http://{name}:{port['port']}"


def sim_args(args: list[str]) -> Any:
    parser = engine_sim.build_parser()
    parsed = parser.parse_args(args)
    engine_sim.check(parsed, parser)
    return parsed


# -- Kubernetes -----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_kustomization_lists_every_manifest(overlay: str) -> None:
    base = yaml.safe_load((DEPLOY / "base/kustomization.yaml").read_text())
    assert sorted(base["resources"]) == sorted(
        p.name for p in (DEPLOY / "base").glob("*.yaml") if p.name != "kustomization.yaml"
    )
    top = yaml.safe_load((DEPLOY / overlay / "kustomization.yaml").read_text())
    assert top["resources"] == ["../base", "engine.yaml"]
    assert [image["name"] for image in top["images"]] == [PROJECT_IMAGE]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_renders_the_plain_files_with_the_image_set(overlay: str) -> None:
    """The files podman plays (test_deploy.py) are what kustomize applies, the image name
    aside: no patch, prefix or generator changes them on the way."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its kustomize renders deploy/ offline)")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / overlay)], capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout  # fmt: skip
    (image,) = yaml.safe_load((DEPLOY / overlay / "kustomization.yaml").read_text())["images"]
    plain = manifests(overlay)
    for doc in workloads(plain):
        for spec in pod_spec(doc)["containers"]:
            if spec["image"] == PROJECT_IMAGE:
                spec["image"] = f"{image['newName']}:{image['newTag']}"
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(rendered), key=key) == sorted(plain, key=key)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_what_podman_4_3_cannot_play_is_not_used(overlay: str) -> None:
    """podman kube play (CI's) expands no $(VAR), has no status.podIP and mangles exec
    probes: the manifests use none of them, so the files it plays are the users'."""
    for doc in workloads(manifests(overlay)):
        for spec in pod_spec(doc)["containers"]:
            text = json.dumps({k: spec.get(k) for k in ("command", "args", "env")})
            assert "$(" not in text, (doc["metadata"]["name"], spec["name"])
            for item in spec.get("env", []):
                field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                assert field in (None, "metadata.name"), (spec["name"], field)
            ports = {p["containerPort"] for p in spec.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in spec:
                    assert set(spec[probe]) - {"httpGet"} <= {
                        "periodSeconds", "timeoutSeconds", "failureThreshold", "initialDelaySeconds"
                    }, spec[probe]  # fmt: skip
                    assert spec[probe]["httpGet"]["port"] in ports, (spec["name"], probe)


def test_the_conductor_accepts_its_config_and_keeps_state_on_its_volume(tmp_path: Path) -> None:
    docs = manifests("sim")
    text = one(docs, "ConfigMap", "conductor")["data"]["conductor_config.json"]
    (tmp_path / "conductor_config.json").write_text(text)
    config = load_config(tmp_path / "conductor_config.json")
    settings = config.settings
    assert (
        settings["http_server_port"]
        == one(docs, "Service", "conductor")["spec"]["ports"][0]["port"]
    )
    # pod addresses, not only loopback (the default), may register
    assert settings["register_allow"] and "127.0.0.1" not in settings["register_allow"]
    deployment = one(docs, "Deployment", "conductor")
    mounts = {m["mountPath"]: m["name"] for m in container(deployment, "conductor")["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    state = volumes[mounts["/var/lib/conductor"]]  # the image's CONDUCTOR_STATE_FILE is there
    assert state["persistentVolumeClaim"]["claimName"] == "conductor-state"
    assert settings["snapshot_path"].startswith("/var/lib/conductor/")
    assert volumes[mounts["/etc/mooncake"]]["configMap"]["name"] == "conductor"
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # one writer of the volume


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_names_the_conductor_service_and_every_engine_pod(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = manifests(overlay)
    router = one(docs, "Deployment", "router")
    spec = container(router, "router")
    env = environment(docs, spec, "router-0")
    for name in ("ROUTER_HOST", "ROUTER_PORT"):  # the listen address: env, not flags
        monkeypatch.setenv(name, env[name])
    parsed = router_main.build_parser().parse_args(argv(spec, env))
    assert parsed.config == Path("/etc/mooncake/router.json")
    address = one(docs, "ConfigMap", "router")["data"]
    assert (parsed.host, parsed.port) == (address["host"], int(address["port"]))
    config = router_config.RouterConfig.model_validate(
        json.loads(one(docs, "ConfigMap", "router")["data"]["router.json"])
    )
    assert config.conductor.urls() == [service_url(docs, "conductor")]
    engines = one(docs, "StatefulSet", "engine")
    engine_env = one(docs, "ConfigMap", "engine")["data"]
    (model,) = config.served_models()
    assert model.modelname == engine_env["ENGINE_MODEL"]
    assert model.block_size == int(engine_env["ENGINE_BLOCK_SIZE"])
    service = engines["spec"]["serviceName"]
    assert one(docs, "Service", service)["spec"]["clusterIP"] == "None"  # per-pod DNS names
    expected = [
        (f"engine-{i}", f"http://engine-{i}.{service}:{engine_env['ENGINE_PORT']}")
        for i in range(engines["spec"]["replicas"])
    ]
    assert [(i.instance_id, i.http_endpoint) for i in model.instances] == expected


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_registrar_registers_the_engine_with_the_conductor_service(overlay: str) -> None:
    docs = manifests(overlay)
    engines = one(docs, "StatefulSet", "engine")
    env = environment(docs, container(engines, "registrar"), "engine-1")
    settings = parse_settings([], env)
    assert settings.conductor == [service_url(docs, "conductor")]
    assert settings.instance_id == "engine-1"  # the router's instance id for the pod
    assert settings.engine_url == f"http://127.0.0.1:{env['ENGINE_PORT']}"
    assert settings.health_host == "0.0.0.0"  # the kubelet probes the pod's address
    assert settings.advertise_host is None  # the pod's address (its hostname's)
    probe = container(engines, "registrar")["readinessProbe"]["httpGet"]
    assert probe["port"] == settings.health_port
    # the engine publishes where the registrar registers, on the ports the Service names
    events = settings.kv_events_config
    assert events is not None and events.endpoint == "tcp://*:5557"
    assert events.replay_endpoint == "tcp://*:5558"
    ports = {p["name"]: p["port"] for p in one(docs, "Service", "engine")["spec"]["ports"]}
    assert (ports["kv-events"], ports["kv-replay"], ports["http"]) == (
        5557,
        5558,
        int(env["ENGINE_PORT"]),
    )
    engine = container(engines, "engine")
    args = argv(engine, environment(docs, engine, "engine-1"))
    assert args[args.index("--kv-events-config") + 1] == env["KV_EVENTS_CONFIG"]
    assert args[args.index("--block-size") + 1] == str(settings.block_size)
    if overlay == "sim":
        parsed = sim_args(args)
        assert (parsed.host, parsed.port) == ("0.0.0.0", int(env["ENGINE_PORT"]))
        assert parsed.kv_events_config.endpoint == events.endpoint
    else:
        assert args[:2] == ["serve", env["ENGINE_MODEL"]], args
        assert "--enable-prefix-caching" in args
        assert json.loads(env["KV_EVENTS_CONFIG"])["enable_kv_cache_events"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_registrar_unregisters_before_the_engine_stops(overlay: str) -> None:
    """At a pod's deletion the registrar (no preStop hook) gets SIGTERM at once and
    unregisters within its timeout, while the engine's preStop sleep keeps it serving; the
    grace period covers both (docs/registrar.md, Shutdown order)."""
    engines = one(manifests(overlay), "StatefulSet", "engine")
    engine, registrar = container(engines, "engine"), container(engines, "registrar")
    command = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    sleep = float(command[1])
    assert "lifecycle" not in registrar
    unregister = Settings.model_fields["unregister_timeout_s"].default
    assert unregister < sleep < pod_spec(engines)["terminationGracePeriodSeconds"]
    assert "initContainers" not in pod_spec(engines)  # not a native sidecar: stopped last


# -- Compose --------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return data


def test_the_compose_file_is_well_formed() -> None:
    data = compose()
    services = data["services"]
    allowed = {"image", "build", "entrypoint", "command", "environment", "volumes", "ports",
               "depends_on", "restart", "network_mode"}  # fmt: skip
    for name, service in services.items():
        assert set(service) <= allowed, (name, set(service) - allowed)
        assert service["image"] == PROJECT_IMAGE, name
        for dependency in service.get("depends_on", []):
            assert dependency in services, (name, dependency)
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in data["volumes"], (name, volume)
        mode = service.get("network_mode", "service:")
        assert mode.startswith("service:") and mode.split(":")[1] in services | {"": 0}
        assert all(isinstance(v, str) for v in service.get("environment", {}).values()), name
    assert services["conductor"]["build"]["context"] == ".."  # the repository, its Dockerfile
    assert (DEPLOY / services["conductor"]["build"]["context"] / "Dockerfile").exists()


def test_compose_containers_reach_each_other_by_service_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every address that crosses containers names a service; 127.0.0.1 only inside the
    network namespace a registrar shares with its engine."""
    data = compose()
    services = data["services"]
    # the conductor's settings as it reads them in its container: the image's env, then
    # the service's, with the image's empty config file where the image holds it
    monkeypatch.setenv("HOME", str(tmp_path))
    for key, value in {**IMAGE_ENV, **services["conductor"]["environment"]}.items():
        monkeypatch.setenv(key, value)
    in_image = os.environ["CONDUCTOR_CONFIG_PATH"]
    assert f"echo '{{}}' > {in_image}" in (REPO / "Dockerfile").read_text()
    (tmp_path / "conductor_config.json").write_text("{}")
    monkeypatch.setenv("CONDUCTOR_CONFIG_PATH", str(tmp_path / "conductor_config.json"))
    settings_, _, _, _ = conductor_main.parse_settings([])
    allow = settings_.register_allow
    assert settings_.snapshot_path.startswith("/var/lib/conductor/")
    registrars = {n: s for n, s in services.items() if s.get("entrypoint") == ["mooncake-register"]}
    engines = {n: s for n, s in services.items() if s.get("entrypoint") == ["mooncake-engine-sim"]}
    assert len(engines) == len(registrars) == 2
    for name, service in registrars.items():
        engine = service["network_mode"].removeprefix("service:")
        assert engine in engines and engine in service["depends_on"], name
        settings = parse_settings([], service["environment"])
        assert settings.instance_id == settings.advertise_host == engine
        assert settings.advertise_host in allow  # the conductor lets the engine register
        assert settings.conductor == ["http://conductor:13333"]
        assert urlsplit(settings.engine_url).hostname == "127.0.0.1"  # the engine's namespace
        parsed = sim_args(engines[engine]["command"])
        assert parsed.kv_events_config.endpoint == settings.kv_events_config.endpoint  # type: ignore[union-attr]
        assert parsed.block_size == settings.block_size
        assert parsed.port == urlsplit(settings.engine_url).port
        assert parsed.host == "0.0.0.0"
    router = services["router"]
    args = router_main.build_parser().parse_args(router["command"])
    config = router_config.load(args, {})
    assert config.conductor.urls() == ["http://conductor:13333"]
    (model,) = config.served_models()
    assert [(i.instance_id, urlsplit(i.http_endpoint).hostname) for i in model.instances] == [
        (name, name) for name in engines
    ]
    for name in engines:
        engine_args = sim_args(engines[name]["command"])
        assert engine_args.model == model.modelname
        assert engine_args.block_size == model.block_size


# -- the README and docs/deploy.md ---------------------------------------------------------


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped,
    spaces as '-'."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def test_the_readme_deploy_section_and_docs_deploy_md_point_at_what_exists() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Deploy\n", 1)[1].split("\n## ", 1)[0]
    guide = (DEPLOY.parent / "docs/deploy.md").read_text()
    commands = section.split("```bash", 1)[1].split("```", 1)[0]
    assert re.search(r"docker build -t \S+ \.", commands), commands  # this Dockerfile
    assert "127.0.0.1" not in commands  # containers reach each other by name
    named = re.findall(r"`((?:deploy|docs)/[\w./-]+)`", section)
    named += re.findall(r"(deploy/[\w./-]+\.ya?ml)", section)
    assert "deploy/compose.yaml" in named and "deploy/vllm/kustomization.yaml" in named
    for path in named:
        assert (REPO / path).exists(), f"{path} is not in the repository"
    for target in re.findall(r"kubectl apply -k (\S+?)`?\s", section + guide):
        assert (REPO / target / "kustomization.yaml").is_file(), target
    for target in re.findall(r"docker compose -f (\S+)", section + guide):
        assert (REPO / target).is_file(), target
    model = one(manifests("sim"), "ConfigMap", "engine")["data"]["ENGINE_MODEL"]
    for body in re.findall(r"-d '(\{\"model\".*?\})'", section + guide):
        assert json.loads(body)["model"] == model
    links = [(REPO, link) for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", section)]
    links += [(REPO / "docs", link) for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", guide)]
    for folder, link in links:
        assert (folder / link).exists(), link
    anchors = re.findall(r"\]\(([^)#]+\.md)#([^)]+)\)", section)
    anchors += [(f"docs/{p}", a) for p, a in re.findall(r"\]\(([^)#]+\.md)#([^)]+)\)", guide)]
    for path, anchor in anchors:
        headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), flags=re.M)
        assert anchor in {_anchor(h) for h in headings}, f"{path}#{anchor}"


@pytest.mark.needs("vllm")
def test_vllm_accepts_the_engine_command_line_of_its_manifest() -> None:
    """deploy/vllm/engine.yaml's `vllm serve` line, as sh expands it from the ConfigMap,
    parsed by vLLM's own `serve` parser (the real vLLM engine pod itself does not run in
    CI: no vLLM image can be pulled there)."""
    docs = manifests("vllm")
    engine = container(one(docs, "StatefulSet", "engine"), "engine")
    env = environment(docs, engine, "engine-0")
    args = argv(engine, env)
    assert args[0] == "serve", args
    script = (
        "import json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "print(json.dumps({'model': a.model_tag, 'host': a.host, 'port': a.port,\n"
        "    'block_size': a.block_size, 'prefix': a.enable_prefix_caching,\n"
        "    'events': a.kv_events_config.endpoint, 'replay': a.kv_events_config.replay_endpoint,\n"
        "    'on': a.kv_events_config.enable_kv_cache_events}))\n"
    )
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, *args[1:]], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    events = json.loads(env["KV_EVENTS_CONFIG"])
    assert parsed == {
        "model": env["ENGINE_MODEL"], "host": env["ENGINE_HOST"], "port": int(env["ENGINE_PORT"]),
        "block_size": int(env["ENGINE_BLOCK_SIZE"]), "prefix": True,
        "events": events["endpoint"], "replay": events["replay_endpoint"], "on": True,
    }  # fmt: skip
