"""docker-compose.yml and the kustomize output as LocalServices (see local_run for the mapping)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdserve.rpc.health import is_serving
from tests.deploy.local_run import (
    LOOPBACK,
    Endpoints,
    LocalService,
    entrypoint,
    local_argv,
    localize_cluster,
    run_check,
)
from tests.deploy.tools import compose_config, kustomize

CLUSTER_MOUNT = "/etc/pdserve/cluster.yaml"


def _image_entrypoint(image: str) -> list[str]:
    if image.startswith("pdserve"):
        return entrypoint()
    assert image.startswith("redis:"), f"no local stand-in for image {image}"
    return []  # redis' image runs its command as given


def compose_stack(
    run_dir: Path, model_dir: Path, profiles: tuple[str, ...] = ()
) -> tuple[list[LocalService], dict[str, Any], list[str]]:
    """(services, localized cluster file, names left out) from `docker compose config`'s own output
    (with ``profiles`` switched on, as `docker compose --profile NAME up` does)."""
    out = compose_config(*[a for p in profiles for a in ("--profile", p)], "config", "--format", "json")
    assert out.returncode == 0, out.stderr
    services: dict[str, Any] = json.loads(out.stdout)["services"]
    skipped: list[str] = []  # profile services (gpu, multimodal) are not in the default config
    sources = {
        v["target"]: v["source"]
        for s in services.values()
        for v in s.get("volumes") or []
        if v["type"] == "bind"
    }
    (router,) = [n for n, s in services.items() if (s.get("command") or [""])[0] == "router"]
    ep = Endpoints()
    cluster = localize_cluster(
        yaml.safe_load(Path(sources[CLUSTER_MOUNT]).read_text()), router, model_dir, ep
    )
    local_cfg = run_dir / "cluster.yaml"
    local_cfg.write_text(yaml.safe_dump(cluster))
    result = []
    for name, s in services.items():
        if name in skipped:
            continue
        argv = (s.get("entrypoint") or _image_entrypoint(s["image"])) + list(s.get("command") or [])
        argv = [str(local_cfg) if a == CLUSTER_MOUNT else a for a in ep.rewrite_argv(argv, name)]
        env = {k: ep.rewrite(str(v), name) for k, v in (s.get("environment") or {}).items()}
        if s["image"].startswith("pdserve"):
            env.setdefault("PDSERVE_KV_HOST", LOOPBACK)  # the container's own IP
        test = s["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: healthcheck {test} is not exec form"
        check = local_argv(ep.rewrite_argv(test[1:], name))
        deps = [d for d, c in (s.get("depends_on") or {}).items() if c["condition"] == "service_healthy"]
        assert not set(deps) & set(skipped), f"{name} depends on a skipped service"
        result.append(
            LocalService(
                name, argv, env, lambda c=check: run_check(c, 10.0), [d for d in deps if d not in skipped]
            )
        )
    return result, cluster, skipped


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values and args."""
    for k, v in env.items():
        value = value.replace(f"$({k})", v)
    return value


def k8s_stack(
    overlay: str, run_dir: Path, model_dir: Path
) -> tuple[list[LocalService], dict[str, Any], list[str]]:
    docs = [d for d in yaml.safe_load_all(kustomize(overlay)) if d]
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    k8s_services = [d for d in docs if d["kind"] == "Service"]
    deployments = [d for d in docs if d["kind"] == "Deployment"]

    def service_of(dep: dict[str, Any]) -> str:
        labels = dep["spec"]["template"]["metadata"]["labels"]
        (svc,) = [
            s["metadata"]["name"]
            for s in k8s_services
            if all(labels.get(k) == v for k, v in s["spec"]["selector"].items())
        ]
        return svc

    ep = Endpoints()
    # The router's cluster file decides the router port; one ConfigMap holds the cluster file.
    (cm,) = configmaps.values()
    router_dep = [
        d for d in deployments if d["spec"]["template"]["spec"]["containers"][0]["args"][0] == "router"
    ]
    cluster = localize_cluster(
        yaml.safe_load(cm["data"]["cluster.yaml"]), service_of(router_dep[0]), model_dir, ep
    )
    cm_dir = run_dir / "configmap"
    cm_dir.mkdir(exist_ok=True)
    (cm_dir / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    result, skipped = [], []
    for dep in deployments:
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        name, host = dep["metadata"]["name"], service_of(dep)
        if dep["spec"].get("replicas", 1) == 0:
            skipped.append(name)  # Kubernetes runs no pod of it either
            continue
        mounts = {}
        for vm in c.get("volumeMounts") or []:
            (vol,) = [v for v in pod.get("volumes", []) if v["name"] == vm["name"]]
            assert "configMap" in vol, f"{name}: no local stand-in for volume {vol}"
            mounts[vm["mountPath"]] = str(cm_dir)
        env: dict[str, str] = {}
        for e in c.get("env") or []:
            if "valueFrom" in e:
                assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, e
                env[e["name"]] = LOOPBACK
            else:
                env[e["name"]] = ep.rewrite(_expand(e["value"], env), host)
        argv = (c.get("command") or _image_entrypoint(c["image"])) + [
            _expand(a, env) for a in c.get("args") or []
        ]
        for path, local in mounts.items():
            argv = [a.replace(path, local) for a in argv]
        argv = ep.rewrite_argv(argv, host)
        ports = {p["name"]: p["containerPort"] for p in c.get("ports") or []}
        probes = [_probe(c[k], host, ports, ep) for k in ("startupProbe", "readinessProbe") if k in c]
        result.append(LocalService(name, argv, env, lambda ps=probes: all(p() for p in ps)))
    return result, cluster, skipped


def _probe(spec: dict[str, Any], host: str, ports: dict[str, int], ep: Endpoints) -> Any:
    def port(p: int | str) -> int:
        return ep.ports[(host, ports[p] if isinstance(p, str) else p)]

    if "grpc" in spec:
        addr, svc = f"{LOOPBACK}:{port(spec['grpc']['port'])}", spec["grpc"].get("service", "")
        return lambda: is_serving(addr, 2.0, service=svc)
    if "httpGet" in spec:
        url = f"http://{LOOPBACK}:{port(spec['httpGet']['port'])}{spec['httpGet']['path']}"

        def get() -> bool:
            try:
                return 200 <= httpx.get(url, timeout=2.0).status_code < 400
            except httpx.HTTPError:
                return False

        return get
    if "exec" in spec:
        argv = local_argv(ep.rewrite_argv(spec["exec"]["command"], host))
        return lambda: run_check(argv, 10.0)
    raise AssertionError(f"no local stand-in for probe {spec}")
