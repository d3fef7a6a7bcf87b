"""Building, caching and loading ``cpu_native.c`` (``cpu_native`` holds the one load; the
wrappers are in ``cpu_native_rowwise`` and ``cpu_native_attention``).

The library is cached under ``$PDSERVE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/pdserve`` or
``~/.cache/pdserve``), named by a hash of the source, the flags, Python's headers and (for
``-march=native``) the CPU, so a changed source or another host builds anew; a build takes ~1 s.
Built with ``-march=native`` where a compiler is at hand; a portable build already in the cache
(``python -m pdserve.kernels.cpu_native --portable``, as the container image does at build time)
serves a host without one. Always ``-ffp-contract=off``. ``cpu_attention.c``'s AVX2 + FMA attention
is in every x86-64 build (its functions carry their own target attribute) and runs where cpuid
says the CPU has both, so the portable build uses it too without needing them.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
# Compiled with SOURCE into the one module (its header too: all of them name the cached build).
EXTRA_SOURCES = tuple(
    Path(__file__).with_name(f) for f in ("cpu_gemm.c", "cpu_attention.c", "cpu_activation.c")
)
HEADERS = tuple(
    Path(__file__).with_name(f) for f in ("cpu_gemm.h", "cpu_attention.h", "cpu_activation.h", "cpu_simd.h")
)
ABI_VERSION = 8  # the C side's ABI_VERSION: a module of another is not loaded
_BASE_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
_BUILD_TIMEOUT_S = 120


def cache_dir() -> Path:
    from pdserve.models.resolve import pdserve_cache_dir

    return pdserve_cache_dir()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _compile(cc: str, flags: list[str], out: Path) -> str | None:
    """Compile SOURCE to ``out`` (atomically); None on success, else the compiler's complaint."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    include = sysconfig.get_paths()["include"]
    try:
        proc = subprocess.run(
            [cc, *flags, f"-I{include}", f"-I{SOURCE.parent}", "-o", tmp, str(SOURCE)]
            + [str(p) for p in EXTRA_SOURCES]
            + ["-lm"],
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            return (proc.stderr or proc.stdout).strip()[-2000:] or f"exit status {proc.returncode}"
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_NATIVE_FLAGS = ["-march=native", *_BASE_FLAGS]


def _module_path(flags: list[str]) -> Path:
    """Where the module built with ``flags`` lives in the cache: named by the source, the flags,
    this Python's headers and, for ``-march=native``, the CPU."""
    include = sysconfig.get_paths()["include"]
    sources = [p.read_bytes() for p in (SOURCE, *EXTRA_SOURCES, *HEADERS)]
    parts = [*sources, " ".join(flags).encode(), include.encode()]
    if "-march=native" in flags:
        parts.append(_cpu_id().encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cache_dir() / f"cpu_native-{key}{suffix}"


def _build(portable_only: bool = False) -> Path:
    """The cached module's path, building it if needed; raises RuntimeError with the reason.

    A module for this CPU (``-march=native``) is preferred; one of portable flags is taken when
    it is already in the cache (an image built it, ``build_portable``) or this CPU's will not
    build. No compiler is needed when the cache holds either."""
    candidates = [_BASE_FLAGS] if portable_only else [_NATIVE_FLAGS, _BASE_FLAGS]
    paths = [_module_path(flags) for flags in candidates]  # hashes the source (and cpuinfo) once
    for path in paths:
        if path.exists():
            return path
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang on PATH, or $CC)")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise RuntimeError(f"no Python.h under {include} (Python's development headers)")
    errors = []
    for flags, path in zip(candidates, paths, strict=True):
        error = _compile(cc, flags, path)
        if error is None:
            logger.info("built the native CPU kernels: %s", path)
            return path
        errors.append(f"{' '.join(flags)}: {error}")
    raise RuntimeError(f"{cc} could not build {SOURCE.name}: " + " | ".join(errors))


def load() -> ModuleType:
    """The module for this host, built first if the cache lacks it; raises RuntimeError,
    OSError or ImportError with the reason."""
    return _open(_build())


def build_portable() -> Path:
    """Build the portable module into the cache (a container image does this at build time, so a
    runtime without a compiler still has the kernels); returns its path."""
    path = _build(portable_only=True)
    _open(path)  # it must import
    return path


def _open(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("pdserve_cpu_native", str(path))
    spec = importlib.util.spec_from_file_location("pdserve_cpu_native", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    got = getattr(module, "ABI_VERSION", None)
    if got != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {got}, this pdserve wants {ABI_VERSION}")
    return module


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--portable"]:
        sys.exit(
            "usage: python -m pdserve.kernels.cpu_native_build --portable  (build into $PDSERVE_CACHE_DIR)"
        )
    print(build_portable())
