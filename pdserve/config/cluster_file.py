"""Reading and writing the cluster file, the ``pdserve up`` default cluster, and the wording of
its validation errors.

:mod:`pdserve.config.cluster` re-exports the public functions here and imports
:func:`_describe_error` for ``ClusterConfig.from_dict``; so this module imports ``ClusterConfig``
only inside the functions that build one, never at import time (that would be a cycle).
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel

from pdserve.config.kv_events_settings import KVEventsSettings
from pdserve.config.node_settings import NodeConfig
from pdserve.config.router_settings import RouterConfig
from pdserve.errors import ConfigError

if TYPE_CHECKING:
    from pdserve.config.cluster import ClusterConfig

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def load_cluster_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Read a cluster config (``.yaml`` / ``.yml`` / ``.toml``).

    ``${NAME}`` in a string value is replaced by the environment variable ``NAME`` (``env``,
    default ``os.environ``) so secrets such as ``shared_token`` can come from a k8s Secret.
    """
    from pdserve.config.cluster import ClusterConfig  # not at import time: cluster.py imports this module

    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"cluster config {p}: unknown extension {p.suffix!r}; use .yaml, .yml or .toml")
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read cluster config {p}: {e.strerror or e}") from e
    try:
        data = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cluster config {p} is not valid {suffix[1:].upper()}: {e}") from e
    data = _expand_env(data, os.environ if env is None else env, str(p))
    return ClusterConfig.from_dict(data, source=f"cluster config {p}")


def write_cluster_config(cluster: ClusterConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``cluster`` as YAML (for ``pdserve up`` to hand its child processes one file).

    Only fields that were set are written, so derived fields stay derived on reload.
    """
    p = Path(path)
    if p.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError(f"write_cluster_config writes YAML; use a .yaml path, got {p}")
    p.write_text(yaml.safe_dump(cluster.model_dump(mode="json", exclude_unset=True), sort_keys=False))
    return p


def default_local_cluster(
    model_dir: str | os.PathLike[str],
    base_port: int = 8000,
    *,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    encoder_redis_url: str | None = None,
) -> ClusterConfig:
    """The cluster ``pdserve up`` starts: router + one prefill + one decode node on one host, and
    with ``encoder_redis_url`` (a multimodal model) an encoder whose index lives there.

    Ports, from ``base_port``:

        base+0  router HTTP (OpenAI API, /metrics)
        base+1  prefill-0 gRPC      base+2  prefill-0 /metrics
        base+3  decode-0 gRPC       base+4  decode-0 /metrics
        base+5  encoder-0 gRPC      base+6  encoder-0 /metrics   (with an encoder)
    """
    from pdserve.config.cluster import ClusterConfig  # not at import time: cluster.py imports this module

    span = 7 if encoder_redis_url else 5
    if not 1 <= base_port <= 65536 - span:
        raise ConfigError(
            f"base_port must be in [1, {65536 - span}] ({span} ports are used), got {base_port}"
        )
    nodes = [
        {"name": "prefill-0", "role": "prefill", "host": host}
        | {"grpc_port": base_port + 1, "metrics_port": base_port + 2},
        {"name": "decode-0", "role": "decode", "host": host}
        | {"grpc_port": base_port + 3, "metrics_port": base_port + 4},
    ]
    data: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": served_model_name,
        "router": {"host": host, "port": base_port},
        "nodes": nodes,
    }
    if encoder_redis_url:
        nodes.insert(
            0,
            {"name": "encoder-0", "role": "encoder", "host": host}
            | {"grpc_port": base_port + 5, "metrics_port": base_port + 6},
        )
        data["redis_url"] = encoder_redis_url
    return ClusterConfig.from_dict(data, source="default local cluster")


def _expand_env(value: Any, env: Mapping[str, str], source: str) -> Any:
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(1) not in env:
                raise ConfigError(
                    f"cluster config {source} uses ${{{m.group(1)}}}, which is not set; "
                    "set that environment variable or write the value"
                )
            return env[m.group(1)]

        return _ENV_RE.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand_env(v, env, source) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, env, source) for v in value]
    return value


def _describe_error(err: Any, data: Mapping[str, Any], root: type[BaseModel]) -> str:
    """One pydantic error of ``root`` (ClusterConfig) as a line that names the field and the fix."""
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        parent: type[BaseModel] = root
        if loc[0] == "nodes":
            parent = NodeConfig
        elif loc[0] == "router" and len(loc) == 2:
            parent = RouterConfig
        elif loc[0] == "kv_events" and len(loc) == 2:
            parent = KVEventsSettings
        allowed = list(parent.model_fields)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        where = _format_loc(loc[:-1], data) or "top level"
        return f"unknown field {loc[-1]!r} in {where}; {hint}allowed: {', '.join(allowed)}"
    where = _format_loc(loc, data)
    if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), ConfigError):
        msg = str(err["ctx"]["error"])
        return f"{where}: {msg}" if where else msg
    if err["type"] == "missing":
        return f"{where}: required field is missing"
    got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
    return f"{where}: {err['msg']}{got}"


def _format_loc(loc: tuple[Any, ...], data: Mapping[str, Any]) -> str:
    """("nodes", 1, "tp") -> "nodes[1] ('decode-0').tp"."""
    where = ""
    for part in loc:
        where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
        if isinstance(part, int) and loc[0] == "nodes":
            try:
                where += f" ({data['nodes'][part]['name']!r})"
            except (KeyError, IndexError, TypeError):
                pass
    return where
