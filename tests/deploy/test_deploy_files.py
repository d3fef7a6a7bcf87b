"""The deploy files, checked offline: Compose v2 `config`, `kubectl kustomize` + kubernetes-validate
--strict, and the properties the issue asks for (one image, probes, drain time, RDMA bits)."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.config.cluster import ClusterConfig, load_cluster_config
from tests.deploy.local_run import IMAGE_MODEL_DIR, dockerfile_instructions, entrypoint
from tests.deploy.tools import OVERLAYS, ROOT, compose_config, kubernetes_validate_binary, kustomize

ENGINE_COMPONENTS = {"encoder", "prefill", "decode"}


@pytest.mark.parametrize(
    "profile", [[], ["--profile", "gpu"], ["--profile", "multimodal"]], ids=["default", "gpu", "multimodal"]
)
def test_compose_file_passes_compose_v2_config(profile: list[str]) -> None:
    out = compose_config(*profile, "config", "--quiet")
    assert out.returncode == 0, out.stderr


def compose_services(*profile: str) -> dict[str, Any]:
    out = compose_config(*profile, "config", "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["services"]


def test_compose_shape() -> None:
    svcs = compose_services()
    assert set(svcs) == {"redis", "router", "prefill", "decode"}
    assert set(compose_services("--profile", "gpu")) == set(svcs) | {"prefill-gpu", "decode-gpu"}
    svcs = compose_services("--profile", "multimodal")
    assert set(svcs) == {"redis", "router", "encoder", "prefill", "decode"}
    published = {n: s["ports"] for n, s in svcs.items() if s.get("ports")}
    assert list(published) == ["router"] and published["router"][0]["published"] == "8000"
    for name, s in svcs.items():
        assert s["healthcheck"]["test"][0] == "CMD", name
        if name != "redis":
            assert s["image"] == "pdserve:cpu", "one image for every role"
            assert s["depends_on"]["redis"]["condition"] == "service_healthy", name
    for name in ENGINE_COMPONENTS:
        s = svcs[name]
        assert s["ulimits"]["memlock"] == {"soft": -1, "hard": -1} and s["shm_size"], name
    gpu = compose_services("--profile", "gpu")["decode-gpu"]
    assert gpu["build"]["args"]["FLAVOUR"] == "gpu"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_compose_drain_fits_the_stop_grace_period() -> None:
    svcs = compose_services("--profile", "gpu", "--profile", "multimodal")
    cluster = load_cluster_config(ROOT / "deploy/configs/compose.yaml")
    for s in svcs.values():
        cmd = s.get("command") or []
        if "--node" in cmd:
            node = cluster.node(cmd[cmd.index("--node") + 1])
            assert _seconds(s["stop_grace_period"]) > node.drain_timeout_s, node.name


def _seconds(go_duration: str) -> float:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", go_duration)
    assert m, go_duration
    return int(m.group(1) or 0) * 60 + int(m.group(2) or 0)


def rendered(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(kustomize(overlay)) if d]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_output_passes_kubernetes_validate_strict(overlay: str, tmp_path: Path) -> None:
    f = tmp_path / f"{overlay}.yaml"
    f.write_text(kustomize(overlay))
    out = subprocess.run(
        [str(kubernetes_validate_binary()), "--strict", str(f)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "passed for resource deployment/pdserve-decode" in out.stdout + out.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_pods_probes_drain_and_pod_ip(overlay: str) -> None:
    docs = rendered(overlay)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    cluster = ClusterConfig.from_dict(yaml.safe_load(cm["data"]["cluster.yaml"]))
    deps = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in docs
        if d["kind"] == "Deployment"
    }
    assert ENGINE_COMPONENTS | {"router"} <= set(deps)
    images = {
        d["spec"]["template"]["spec"]["containers"][0]["image"] for c, d in deps.items() if c != "registry"
    }
    assert len(images) == 1, f"one image for every role, got {images}"
    for comp in ENGINE_COMPONENTS | {"router"}:
        pod = deps[comp]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["args"][0] == comp
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c), comp
        assert c["readinessProbe"] != c["livenessProbe"], f"{comp}: readiness and liveness must differ"
        pre_stop_s = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        if comp == "router":
            continue
        node = cluster.node(c["args"][c["args"].index("--node") + 1])
        assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + node.drain_timeout_s, comp
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        for name in ("PDSERVE_KV_HOST", "PDSERVE_ADVERTISE_HOST", "MC_TCP_BIND_ADDRESS"):
            assert env[name]["value"] == "$(POD_IP)", name
        # Liveness asks a service that stays SERVING while draining (services/node_lifecycle.py).
        assert c["livenessProbe"]["grpc"]["service"] == "pdserve.liveness"
    if overlay == "gpu-rdma":
        for comp in ("prefill", "decode"):
            pod = deps[comp]["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            assert c["image"].endswith(":gpu")
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
            shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
            assert shm["emptyDir"]["medium"] == "Memory"
            assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
            assert cluster.node(f"{comp}-0").kv_transport == "rdma"


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the only form our policies use
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_network_policies(overlay: str) -> None:
    """Every pod is covered; only the router's http port is open to the world; the nodes' ports
    are open to pdserve's own pods (Mooncake's ports are picked at start) and, for metrics, to
    the cluster; every named port a policy opens exists on a pod it selects."""
    docs = rendered(overlay)
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    assert {"pdserve-internal", "pdserve-router-http", "pdserve-metrics"} <= set(policies)
    internal = policies["pdserve-internal"]
    (rule,) = internal["ingress"]
    (peer,) = rule["from"]
    for name, tpl in pods.items():
        labels = tpl["metadata"]["labels"]
        assert _selects(internal["podSelector"], labels), f"{name} is not covered by pdserve-internal"
        assert _selects(peer["podSelector"], labels), f"{name} may not reach pdserve's pods"
        assert "ports" not in rule
    for pname, spec in policies.items():
        assert spec["policyTypes"] == ["Ingress"], pname
        selected = [t for t in pods.values() if _selects(spec["podSelector"], t["metadata"]["labels"])]
        assert selected, f"{pname} selects no pod"
        named = {p["name"] for t in selected for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for rule in spec["ingress"]:
            for port in rule.get("ports", []):
                assert port["port"] in named, f"{pname}: no selected pod has a port named {port['port']!r}"
            if "from" not in rule:  # open to every source: the router's API only
                assert [p["port"] for p in rule["ports"]] == ["http"], pname
                comps = {t["metadata"]["labels"]["app.kubernetes.io/component"] for t in selected}
                assert comps == {"router"}, f"{pname} opens {comps} to the world"
            else:
                for peer in rule["from"]:
                    if "namespaceSelector" in peer:  # another namespace: the metrics ports only
                        assert [p["port"] for p in rule["ports"]] == ["metrics"], pname


def test_cluster_files_of_every_deployment_load() -> None:
    for p in [
        "deploy/configs/compose.yaml",
        "deploy/k8s/base/cluster.yaml",
        "deploy/k8s/overlays/gpu-rdma/cluster.yaml",
    ]:
        c = load_cluster_config(ROOT / p)
        assert c.redis_url, p
        assert {n.role for n in c.nodes} >= {"encoder", "prefill", "decode"}, p
    assert load_cluster_config(ROOT / "deploy/configs/compose.yaml").model == IMAGE_MODEL_DIR


def test_dockerfile_one_nonroot_image_and_its_context() -> None:
    froms = dockerfile_instructions("FROM")
    assert [f.split()[-1] for f in froms] == ["build", "runtime"], "multi-stage"
    (base,) = [a for a in dockerfile_instructions("ARG") if a.startswith("PYTHON_IMAGE=")]
    assert re.search(r"PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim", base), f"base image not pinned: {base}"
    assert dockerfile_instructions("USER")[-1].split(":")[0] not in ("0", "root")
    assert entrypoint() == ["pdserve", "serve"]
    assert any("pdserve make-model" in r and IMAGE_MODEL_DIR in r for r in dockerfile_instructions("RUN"))
    assert any('gpu) pip install "torch==2.13.0" ".[gpu]"' in r for r in dockerfile_instructions("RUN"))
    # Every COPY source of the build stage exists and .dockerignore does not drop it.
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for copy in dockerfile_instructions("COPY"):
        if copy.startswith("--from"):
            continue
        for src in copy.split()[:-1]:
            assert (ROOT / src).exists(), src
            assert not any(fnmatch.fnmatch(src, pat) for pat in ignore), f"{src} is in .dockerignore"


def _run_stage_command(
    command: str, flavour: str, python: str = "/opt/pdserve/bin/python"
) -> subprocess.CompletedProcess[str]:
    """A RUN command of the Dockerfile in bash (for its function names) with FLAVOUR set, apt-get and rm replaced by echoes
    and the venv's python by ``python``."""
    command = command.replace("/opt/pdserve/bin/python", python)
    prelude = 'apt-get() { echo "apt-get $*"; }; rm() { :; }; '
    return subprocess.run(
        ["bash", "-c", prelude + command],
        env={"FLAVOUR": flavour, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_gpu_runtime_stage_has_what_triton_compiles_with(tmp_path: Path) -> None:
    """Triton builds each kernel's launcher at its first use: the gpu image's runtime stage has a
    C compiler, Python.h of the venv's interpreter, and a Triton cache its user can write (the
    user's home is /nonexistent)."""
    assert "FLAVOUR=cpu" in dockerfile_instructions("ARG", stage="runtime"), "the stage reads FLAVOUR"
    (apt,) = [r for r in dockerfile_instructions("RUN", stage="runtime") if "apt-get install" in r]
    installed = {}
    for flavour in ("cpu", "gpu"):
        out = _run_stage_command(apt, flavour)
        assert out.returncode == 0, out.stderr
        (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("apt-get install")]
        installed[flavour] = set(line.split()) - {"apt-get", "install", "-y", "--no-install-recommends"}
    assert {"gcc", "libc6-dev", "libibverbs1"} <= installed["gpu"]
    assert "gcc" not in installed["cpu"] and "libibverbs1" in installed["cpu"]

    # The header check runs against the venv's python (here: this interpreter, which has them).
    (check,) = [r for r in dockerfile_instructions("RUN", stage="runtime") if "Python.h" in r]
    assert _run_stage_command(check, "gpu", python=sys.executable).returncode == 0
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho {tmp_path}\n")
    fake.chmod(0o755)
    headless = _run_stage_command(check, "gpu", python=str(fake))
    assert headless.returncode != 0 and f"no {tmp_path}/Python.h" in headless.stderr
    assert _run_stage_command(check, "cpu", python=str(fake)).returncode == 0

    env = dict(kv.split("=", 1) for e in dockerfile_instructions("ENV", stage="runtime") for kv in e.split())
    uid = dockerfile_instructions("USER", stage="runtime")[-1].split(":")[0]
    (useradd,) = [r for r in dockerfile_instructions("RUN", stage="runtime") if "useradd" in r]
    made = re.search(rf"install -d -o {uid} -g {uid} ([^&]+)", useradd)
    assert made, f"no folder made for uid {uid}: {useradd}"
    owned = made.group(1).split()
    for name in ("TRITON_HOME", "TRITON_CACHE_DIR"):
        assert env[name] in owned, f"{name}={env[name]} is not a folder uid {uid} owns ({owned})"
        assert not env[name].startswith("/nonexistent"), name
