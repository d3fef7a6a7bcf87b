"""Helpers the bench scripts share (they put the repo root on sys.path, so `bench._common` imports)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 1]); NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_logged(cmd: list[str]) -> None:
    """Run an install step, echoing only pip's progress lines; exit on failure."""
    log("$ " + " ".join(cmd))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(("Collecting", "Installing", "Successfully", "ERROR", "Found existing")):
            print("    " + line.rstrip(), flush=True)
    if proc.wait() != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    log(f"  done in {time.monotonic() - t0:.0f} s")


# Printed by every healthy node start (glog / Mooncake on a host without RDMA): not problems.
BENIGN_LOG_LINES = (
    "InitGoogleLogging",
    "Local segment descriptor not found",  # Mooncake, before the first register_memory
    "No RDMA devices found",
    "Using default malloc/free for protocol: tcp",
)


def scan_logs(run_dir: Path, skip: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """WARNING / ERROR / Traceback lines of the node logs in ``run_dir`` (problems worth reporting)."""
    found = {}
    for p in sorted(run_dir.glob("*.log")):
        if p.name in skip:
            continue
        lines = [
            ln.rstrip()
            for ln in p.read_text(errors="replace").splitlines()
            if re.search(r"\b(WARNING|ERROR|CRITICAL|Traceback|Exception)\b|^[EW]\d{4} ", ln)
            and not any(b in ln for b in BENIGN_LOG_LINES)
        ]
        if lines:
            found[p.name] = lines[:50]
    return found
