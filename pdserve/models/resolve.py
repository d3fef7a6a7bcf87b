"""What a ``model`` setting names -> a Hugging Face checkpoint folder the loader reads.

``resolve_model_path`` is the one place every entry point (``LLM(...)``, ``pdserve serve``,
``pdserve up``, the router) turns the setting into a folder:

    a folder              as is
    a ``*.gguf`` file     dequantized once into a folder of the cache (models/gguf_convert.py),
                          keyed by the file's content hash; later starts reuse it
    ``Org/Name``          a Hugging Face id, looked up in the local hub cache only (offline)

Cache root: ``$PDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve``.
Hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub`` (the same order as huggingface_hub).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

from pdserve.errors import ConfigError

# Org/Name (or a bare Name) as the hub spells repository ids.
_HF_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_HASH_CHUNK_BYTES = 8 << 20

# (real path, size, mtime_ns) of a .gguf -> its converted folder: every entry point of one process
# resolves the same setting, and hashing a 100 MB file each time would cost ~0.2 s per call.
_resolved_gguf: dict[tuple[str, int, int], Path] = {}
_lock = threading.Lock()


def pdserve_cache_dir() -> Path:
    """Root of pdserve's caches (converted GGUF checkpoints, downloaded wheels)."""
    if env := os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pdserve"


def hf_hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, read from the environment at call time."""
    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env)
    if env := os.environ.get("HF_HOME"):
        return Path(env) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def looks_like_hf_id(model: str) -> bool:
    """``Org/Name`` that is not a path on this host (a folder or file wins over an id)."""
    return bool(_HF_ID.match(model)) and not Path(model).exists()


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """The checkpoint folder ``model`` names (see the module docstring); ConfigError if none."""
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ConfigError(f"model {text!r}: GGUF file {path} does not exist")
        return _resolve_gguf(path)
    if looks_like_hf_id(text):
        return resolve_hf_id(text)
    raise ConfigError(
        f"model {text!r}: {path} does not exist; name a checkpoint folder, a .gguf file or a "
        "Hugging Face id (Org/Name)"
    )


def _resolve_gguf(path: Path) -> Path:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _lock:  # one conversion per process even if two threads resolve at once
        if key not in _resolved_gguf:
            from pdserve.models.gguf_convert import convert_gguf

            out = pdserve_cache_dir() / "gguf" / f"{path.stem}-{file_sha256(path)[:16]}"
            _resolved_gguf[key] = convert_gguf(path, out)
        return _resolved_gguf[key]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def resolve_hf_id(repo_id: str) -> Path:
    """The snapshot folder of ``repo_id`` in the local hub cache (never the network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hf_hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    # A snapshot without refs/main (copied in by hand): the newest one that holds a config.json.
    snapshots = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    found = (
        sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    )
    if found:
        return found[-1].parent
    raise ConfigError(
        f"model {repo_id!r} is not a folder or file here, and the Hugging Face cache {cache} has no "
        f"snapshot of it (looked in {snapshots}); nothing is downloaded at run time: fetch it with "
        f"`huggingface-cli download {repo_id}` where the hub is reachable, or set HF_HUB_CACHE / HF_HOME"
    )
