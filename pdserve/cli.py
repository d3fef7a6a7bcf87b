"""The ``pdserve`` command."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Disaggregated prefill/decode LLM serving."
)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command("make-model")
def make_model(
    arch: str = typer.Option("llama", help="llama | qwen2 | qwen3"),
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
    model: Path = typer.Option(..., help="Hugging Face checkpoint folder"),
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
    for p, o in zip(prompt, outs, strict=True):
        if as_json:
            typer.echo(
                json.dumps(
                    {"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                )
            )
        else:
            typer.echo(f"{p!r} -> {o.text!r} ({o.finish_reason})")


if __name__ == "__main__":
    app()
