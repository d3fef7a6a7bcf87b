"""Mooncake's ports on the node's own address: a preloaded ``bind()`` (``bind_shim.c``).

The installed Mooncake listens on every interface whatever it is told (kvtransfer/exposure.py).
It binds through libc's ``bind()``, so a library preloaded into the node process
(``LD_PRELOAD``) turns a bind to the wildcard (``0.0.0.0``, ``::``) into one to the node's bind
address (``PDSERVE_WILDCARD_BIND``). ``pdserve serve`` re-executes itself with both set for a
Mooncake node whose bind address is an IP literal (``reexec_with_shim``); the node then checks
that none of its own listening sockets is a wildcard (``check_no_wildcard``). Measured with
mooncake-transfer-engine-non-cuda 0.3.13.post1: the handshake port on ``127.0.0.1`` and the
data port on ``[::ffff:127.0.0.1]`` instead of ``0.0.0.0`` / ``*``; two processes still moved
KV byte-exact (tests/kvtransfer/test_mooncake.py under the shim).

The library is built with the host's C compiler on first use (~0.1 s) into the cache directory
of ``cpu_native`` (``$PDSERVE_CACHE_DIR``), named by a hash of its source. Without a compiler the
node starts without it and the rule of exposure.py applies (loopback hosts only, unless
``allow_unauthenticated_kv_ports``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("bind_shim.c")
ENV_ADDRESS = "PDSERVE_WILDCARD_BIND"
_BUILD_TIMEOUT_S = 60


@cache
def _native_build() -> ModuleType:
    """``pdserve/kernels/cpu_native_build.py`` (its cache directory and compiler lookup), loaded
    from its file: importing it through the ``pdserve.kernels`` package imports torch (~1.5 s of
    CPU), in a process that only re-executes itself under the shim. The module needs only the
    standard library."""
    path = Path(__file__).parents[1] / "kernels" / "cpu_native_build.py"
    spec = importlib.util.spec_from_file_location("pdserve_cpu_native_build_for_shim", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build() -> Path | None:
    """The shim's shared library (built now if not cached); None without a working compiler."""
    nb = _native_build()
    code = SOURCE.read_bytes()
    target = nb.cache_dir() / f"bind_shim-{hashlib.sha256(code).hexdigest()[:16]}.so"
    if target.exists():
        return target
    cc = nb._compiler()
    if cc is None:
        logger.warning("no C compiler: Mooncake's ports stay on every interface (bind_shim.py)")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-fPIC", "-shared", "-o", str(tmp), str(SOURCE), "-ldl"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=_BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("building %s failed (%r): Mooncake's ports stay on every interface", SOURCE, e)
        return None
    os.replace(tmp, target)
    return target


def active(bind_host: str) -> bool:
    """This process runs with the shim sending wildcard binds to ``bind_host``."""
    preload = os.environ.get("LD_PRELOAD", "")
    return os.environ.get(ENV_ADDRESS) == bind_host and "bind_shim-" in preload


def reexec_with_shim(bind_host: str) -> None:
    """Re-execute this ``pdserve`` command (the interpreter's own command line, ``sys.orig_argv``)
    with the shim preloaded, sending wildcard binds to ``bind_host``; returns (doing nothing) when
    it is already active or cannot be built."""
    if active(bind_host):
        return
    lib = build()
    if lib is None:
        return
    env = dict(os.environ)
    env[ENV_ADDRESS] = bind_host
    env["LD_PRELOAD"] = " ".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
