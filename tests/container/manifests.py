"""deploy/'s manifests read as YAML documents, for the tests that check them
(test_deploy_files.py) and play them (test_deploy.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.container.podman import REPO

yaml = pytest.importorskip("yaml")

DEPLOY = REPO / "deploy"
PROJECT_IMAGE = "mooncake-conductor"  # the manifests' name for the image
WORKLOADS = ("Pod", "Deployment", "StatefulSet")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one document of ``kind`` (named ``name``, if given)."""
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {len(found)} documents"
    return found[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    return spec
