"""Run the containers a deploy file declares as local processes: the same argv (image
ENTRYPOINT + command/args), environment, mounted cluster file and health checks.

What stands in for the container runtime, and nothing else:

    image "pdserve" ENTRYPOINT        -> this Python's `-m services.cli` (the image installs it)
    image "redis"                     -> the local redis-server / redis-cli
    service host:port (compose DNS,   -> 127.0.0.1:<free port>, in the cluster file, argv, env
    k8s Service) and a container's       and health checks alike; the pod IP -> 127.0.0.1
    own 127.0.0.1:port
    the image's /models/tiny-llama    -> a model made by the Dockerfile's own make-model line
    a mounted file                    -> the same content, localized, in a temp folder
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import yaml

from tests.deploy.tools import ROOT

LOOPBACK = "127.0.0.1"
IMAGE_MODEL_DIR = "/models/tiny-llama"
IMAGE_LLAVA_DIR = "/models/tiny-llava"  # the image's multimodal demo model


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def dockerfile_instructions(name: str, stage: str | None = None) -> list[str]:
    """Every instruction ``name`` (RUN, COPY, ...) of the Dockerfile, or of its stage ``stage``
    (``FROM ... AS stage``), continuation lines joined."""
    text = (ROOT / "deploy/docker/Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    found, current = [], None
    for line in text.splitlines():
        if line.startswith("FROM "):
            current = line.split()[-1]
        if line.startswith(name + " ") and stage in (None, current):
            found.append(line.split(None, 1)[1])
    return found


def entrypoint() -> list[str]:
    (ep,) = dockerfile_instructions("ENTRYPOINT")
    return list(yaml.safe_load(ep))


def build_image_model(out: Path, image_dir: str = IMAGE_MODEL_DIR) -> Path:
    """Run the Dockerfile's `pdserve make-model` line for ``image_dir`` with --out redirected to ``out``."""
    lines = [r for r in dockerfile_instructions("RUN") if "pdserve make-model" in r]
    matching = [r for r in lines if f"--out {image_dir} " in r + " "]
    assert len(matching) == 1, f"the image builds no (or several) models at {image_dir}: {lines}"
    argv = shlex.split(matching[0])
    i = argv.index("--out")
    argv[i + 1] = str(out)
    if not (out / "config.json").exists():
        subprocess.run(local_argv(argv), check=True, capture_output=True, timeout=300)
    return out


def local_argv(argv: list[str]) -> list[str]:
    if argv and argv[0] == "pdserve":
        return [sys.executable, "-m", "services.cli", *argv[1:]]
    return list(argv)


@dataclass
class Endpoints:
    """(service host, container port) -> local port; rewrites strings that name them."""

    ports: dict[tuple[str, int], int] = field(default_factory=dict)

    def local(self, host: str, port: int) -> int:
        if (host, port) not in self.ports:
            # The kernel may hand the same ephemeral port out twice once the probe socket is closed
            # (seen in CI: decode-0's gRPC and metrics ports collided), so skip ports already given.
            taken = set(self.ports.values())
            new = free_port()
            while new in taken:
                new = free_port()
            self.ports[(host, port)] = new
        return self.ports[(host, port)]

    def rewrite(self, s: str, own_host: str) -> str:
        for (host, port), local in self.ports.items():
            s = re.sub(rf"\b{re.escape(host)}:{port}\b", f"{LOOPBACK}:{local}", s)
        for port in [p for (h, p) in self.ports if h == own_host]:
            s = re.sub(
                rf"\b(127\.0\.0\.1|localhost):{port}\b", f"{LOOPBACK}:{self.ports[(own_host, port)]}", s
            )
        return s

    def rewrite_argv(self, argv: list[str], own_host: str) -> list[str]:
        out = [self.rewrite(a, own_host) for a in argv]
        for i in range(1, len(out)):
            if out[i - 1] in ("--port", "-p") and out[i].isdigit() and (own_host, int(out[i])) in self.ports:
                out[i] = str(self.ports[(own_host, int(out[i]))])
        return out


def localize_cluster(
    data: dict[str, Any], router_host: str, model_dir: Path, ep: Endpoints
) -> dict[str, Any]:
    """The cluster file with every address on loopback and the image's model replaced."""
    d = yaml.safe_load(yaml.safe_dump(data))
    if d.get("model") == IMAGE_MODEL_DIR:
        d["model"] = str(model_dir)
    d["router"]["port"] = ep.local(router_host, int(d["router"].get("port", 8000)))
    d["router"]["host"] = LOOPBACK
    for n in d["nodes"]:
        n["grpc_port"] = ep.local(n["host"], int(n["grpc_port"]))
        n["metrics_port"] = ep.local(n["host"], int(n["metrics_port"]))
        if n.get("frontend_port"):  # the Steps socket's pinned port
            n["frontend_port"] = ep.local(n["host"], int(n["frontend_port"]))
        n["host"] = LOOPBACK
    if d.get("redis_url"):
        u = urlsplit(d["redis_url"])
        assert u.hostname and u.port, d["redis_url"]
        d["redis_url"] = f"redis://{LOOPBACK}:{ep.local(u.hostname, u.port)}{u.path}"
    return d


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str]
    healthy: Callable[[], bool]  # the declared health check / readiness probe
    depends_on: list[str] = field(default_factory=list)  # wait for these to be healthy first
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    _log: IO[bytes] | None = None


def run_check(argv: list[str], timeout_s: float) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=timeout_s).returncode == 0
    except subprocess.TimeoutExpired:
        return False


class LocalStack:
    def __init__(self, services: list[LocalService], run_dir: Path) -> None:
        self.services = {s.name: s for s in services}
        self.run_dir = run_dir

    def start(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        started: set[str] = set()
        healthy: set[str] = set()
        while len(healthy) < len(self.services):
            for s in self.services.values():
                if s.name not in started and all(d in healthy for d in s.depends_on):
                    self._spawn(s)
                    started.add(s.name)
            for name in sorted(started - healthy):
                s = self.services[name]
                assert s.proc is not None
                if s.proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {s.proc.returncode}:\n{self.log(name)}")
                if s.healthy():
                    healthy.add(name)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"not healthy after {timeout_s}s: {set(self.services) - healthy}\n{self.logs()}"
                )
            time.sleep(0.3)

    def _spawn(self, s: LocalService) -> None:
        s.log_path = self.run_dir / f"{s.name}.log"
        s._log = open(s.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **s.env}
        s.proc = subprocess.Popen(
            local_argv(s.argv), env=env, stdout=s._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop(self, grace_s: float = 30.0) -> dict[str, int]:
        """SIGTERM every process (as `docker compose down` / a pod deletion does); their exit codes."""
        for s in self.services.values():
            if s.proc is not None and s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        codes: dict[str, int] = {}
        for s in self.services.values():
            if s.proc is None:
                continue
            try:
                codes[s.name] = s.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGKILL)
                codes[s.name] = s.proc.wait()
            if s._log is not None:
                s._log.close()
        return codes

    def log(self, name: str) -> str:
        p = self.services[name].log_path
        return p.read_text(errors="replace")[-3000:] if p and p.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)}" for n in self.services)
