"""``pdserve up``: a whole local cluster (router + prefill + decode) as child processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from pdserve.config.cluster import ClusterConfig, default_local_cluster, write_cluster_config

DEMO_MODEL_DIR = Path(".models/tiny-llama")
STARTUP_TIMEOUT_S = 300.0


@dataclass
class Child:
    name: str
    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]


def ports_free(host: str, ports: list[int]) -> bool:
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, p))
            except OSError:
                return False
    return True


def pick_base_port(host: str, preferred: int, span: int = 5) -> int:
    for base in [preferred, *range(20000, 60000, 97)]:
        if ports_free(host, list(range(base, base + span))):
            return base
    raise OSError("no free block of ports found")


def ensure_demo_model(model_dir: Path) -> Path:
    if (model_dir / "config.json").exists():
        return model_dir
    from pdserve.models.make_model import make_tiny_model

    print(f"creating the tiny demo model in {model_dir} ...", flush=True)
    return make_tiny_model("llama", model_dir, hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64)


def start_child(cfg_path: Path, role: str, node: str | None, run_dir: Path) -> Child:
    name = node or "router"
    log_path = run_dir / f"{name}.log"
    log = open(log_path, "wb")
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", role, "--config", str(cfg_path)]
    if node:
        cmd += ["--node", node]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Child(name, role, proc, log_path, log)


def tail(path: Path, n: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return ""


def wait_ready(
    cluster: ClusterConfig,
    children: list[Child],
    timeout_s: float = STARTUP_TIMEOUT_S,
    *,
    router: bool = True,
) -> None:
    """Wait for every node's gRPC health and (``router``) the router's /ready; fail fast if a child dies."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from pdserve.rpc.health import is_serving

    pending = {n.name: n.grpc_address for n in cluster.nodes}
    router_url = f"http://{cluster.router.host}:{cluster.router.port}/ready"
    deadline = time.monotonic() + timeout_s
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True
    ) as bar:
        task = bar.add_task("loading models and starting nodes", total=None)
        router_up = not router
        while pending or not router_up:
            for c in children:
                if c.proc.poll() is not None:
                    raise RuntimeError(
                        f"{c.name} exited with code {c.proc.returncode}; its log:\n{tail(c.log_path)}"
                    )
            for name, addr in list(pending.items()):
                if is_serving(addr):
                    del pending[name]
            if not router_up:
                with contextlib.suppress(httpx.HTTPError):
                    router_up = httpx.get(router_url, timeout=1.0).status_code == 200
            waiting = [*pending, *([] if router_up else ["router"])]
            bar.update(task, description=f"waiting for: {', '.join(waiting) or 'nothing'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ready after {timeout_s:.0f}s; still waiting for {waiting}")
            if waiting:
                time.sleep(0.3)


def stop_children(children: list[Child], grace_s: float = 10.0) -> None:
    for c in children:
        if c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
        c.log.close()


def example_request(cluster: ClusterConfig) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=cluster.router_url + "/v1", api_key=cluster.router.api_key or "none")
    assert cluster.model is not None
    model = cluster.served_name(cluster.model)
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello to disaggregated serving."}],
        max_tokens=24,
        temperature=0,
    )
    return resp.choices[0].message.content or ""


def up(
    model: Path | None,
    base_port: int,
    run_dir: Path,
    send_example: bool,
    exit_after_example: bool,
) -> int:
    model_dir = ensure_demo_model(model or DEMO_MODEL_DIR)
    host = "127.0.0.1"
    base = pick_base_port(host, base_port)
    cluster = default_local_cluster(model_dir.resolve(), base, host=host)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = write_cluster_config(cluster, run_dir / "cluster.yaml")
    children: list[Child] = []
    stop = {"flag": False}

    def on_signal(signum: int, _frame: object) -> None:
        stop["flag"] = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for n in cluster.nodes:
            children.append(start_child(cfg_path, n.role, n.name, run_dir))
        children.append(start_child(cfg_path, "router", None, run_dir))
        wait_ready(cluster, children)
        url = cluster.router_url
        assert cluster.model is not None
        name = cluster.served_name(cluster.model)
        print(f"\npdserve is up: router {url}/v1  (model '{name}', logs in {run_dir}/)\n")
        print("try:")
        print(
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], '
            f'"max_tokens": 16}}\''
        )
        if send_example:
            text = example_request(cluster)
            note = " (random demo weights: gibberish is expected)" if model is None else ""
            print(f"\nexample request through router -> prefill -> decode answered{note}: {text!r}")
        if exit_after_example:
            return 0
        print("\nCtrl-C stops everything.")
        while not stop["flag"]:
            for c in children:
                if c.proc.poll() is not None:
                    print(
                        f"{c.name} exited with code {c.proc.returncode}; stopping. Log:\n{tail(c.log_path)}"
                    )
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        print("stopping ...", flush=True)
        # SIGTERM drains each node: leave it its drain timeout before SIGKILL
        drain_s = max((n.drain_timeout_s for n in cluster.nodes), default=0.0)
        stop_children(children, grace_s=max(10.0, drain_s + 5.0))
        for s, h in old.items():
            signal.signal(s, h)
