"""deploy/k8s, checked offline: every resource against the Kubernetes schemas (strict, a
pinned recent release), and against forkd itself: every flag and environment variable
the manifests pass exists, the gateway finds the nodes' headless Service, KVM nodes get
/dev/kvm and TCG nodes do not. No control plane can run here (docs/scale-out.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import typer
import yaml

from forkd.cli import app

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES = "1.35.0"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in _docs(p)}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_resource_is_valid_kubernetes(path: Path) -> None:
    for doc in _docs(path):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in MANIFESTS]


def _command(name: str) -> Any:
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def test_every_flag_and_variable_the_manifests_pass_exists() -> None:
    for doc in _all().values():
        if doc["kind"] not in ("DaemonSet", "Deployment"):
            continue
        container = _container(doc)
        verb, *args = container["args"]
        params = _command(verb).params
        flags = {o for p in params for o in p.opts}
        envvars = {e for p in params for e in (getattr(p, "envvar", None) or []) if e}
        envvars |= {p.envvar for p in params if isinstance(getattr(p, "envvar", None), str)}
        assert not [a for a in args if a.startswith("--") and a not in flags], verb
        for env in container.get("env", []):
            assert env["name"] in envvars | {"FORKD_CACHE_DIR"}, env["name"]


def test_the_gateway_finds_the_nodes_service() -> None:
    found = _all()
    service = found[("Service", "forkd-nodes")]
    assert service["spec"]["clusterIP"] == "None"  # headless: one record per pod
    args = _container(found[("Deployment", "forkd-gateway")])["args"]
    name = args[args.index("--nodes-dns") + 1]
    assert name == f"forkd-nodes.{service['metadata']['namespace']}.svc.cluster.local"
    assert args[args.index("--node-port") + 1] == str(service["spec"]["ports"][0]["port"])
    for kind, ds in found.items():
        if kind[0] == "DaemonSet":
            labels = ds["spec"]["template"]["metadata"]["labels"]
            assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


@pytest.mark.parametrize("accel", ["kvm", "tcg"])
def test_kvm_nodes_get_dev_kvm_and_tcg_nodes_do_not(accel: str) -> None:
    ds = _all()[("DaemonSet", f"forkd-node-{accel}")]
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"forkd.dev/accel": accel}
    args = _container(ds)["args"]
    assert args[args.index("--accel") + 1] == accel
    kvm = [v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == "/dev/kvm"]
    assert (kvm == [{"name": "kvm", "hostPath": {"path": "/dev/kvm", "type": "CharDevice"}}]) == (
        accel == "kvm"
    )
    state = next(v for v in spec["volumes"] if v["name"] == "state")
    assert state["hostPath"]["path"] == "/var/lib/forkd"  # snapshots outlive the pod
