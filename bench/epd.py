"""Encoder -> prefill image requests: TTFT and throughput, cold vs warm embedding cache, encoder
colocated (in the prefill process) vs separate (own process, embeddings pushed over Mooncake TCP,
index in a real redis-server). CPU, tiny random LLaVA, one request at a time.

    PYTHONPATH=$PWD .venv/bin/python bench/epd.py [--num-images 16] [--output-len 8]
        [--out bench/results/epd.json]

TTFT here = image bytes in hand -> first token out of the engine (encode or cache hit, index
lookup, reservation, push, prefill). The router / gRPC hop is not in it (not wired yet).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing as mp
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import log, pct


def _png(seed: int, size: int = 64) -> bytes:
    import torch
    from PIL import Image

    arr = (torch.rand(size, size, 3, generator=torch.Generator().manual_seed(seed)) * 255).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr.numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-images", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--out", default="bench/results/epd.json")
    args = ap.parse_args()

    import torch

    from pdserve.embedcache.connector import EmbeddingConsumer
    from pdserve.embedcache.index import EmbeddingIndex
    from pdserve.engine.llm import LLM
    from pdserve.engine.request import MultiModalItem
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kvtransfer.backend import MooncakeBackend
    from pdserve.models.image_processor import ClipImageProcessor, ImageLimits, decode_image
    from pdserve.models.llava import expand_image_placeholders
    from pdserve.models.make_model import IMAGE_TOKEN, make_tiny_model
    from services.encoder.pipe_worker import run_encoder_worker

    tmp = Path(tempfile.mkdtemp(prefix="epd-"))
    model_dir = make_tiny_model("llava", tmp / "llava")
    port = _free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""], stdout=subprocess.DEVNULL
    )
    url = f"redis://127.0.0.1:{port}/0"
    time.sleep(0.5)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=run_encoder_worker, args=(child, str(model_dir), url, 60.0, 1 << 22), daemon=True
    )
    proc.start()
    assert parent.poll(120) and parent.recv() == "ready"
    backend = MooncakeBackend(host="127.0.0.1")
    consumer = EmbeddingConsumer(backend, 16 << 20)
    index = EmbeddingIndex.from_url(url)
    llm = LLM(str(model_dir), device="cpu", dtype="float32")
    from pdserve.models.loader import load_model

    local_model, _ = load_model(model_dir, torch.float32, "cpu")  # the colocated encoder
    processor = ClipImageProcessor.from_model_dir(model_dir)
    tok = llm.tokenizer
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    images = [_png(i) for i in range(args.num_images)]
    counter = iter(range(1 << 30))

    def run_one(key: str, emb: torch.Tensor, t0: float, text_seed: int) -> tuple[float, float]:
        ids, offs = expand_image_placeholders(
            tok.encode(f"{IMAGE_TOKEN}\nQuestion {text_seed}?", add_special_tokens=False),
            image_id,
            emb.shape[0],
        )
        rid = f"b{next(counter)}"
        llm.engine.add_request(
            ids, params, rid, mm_items=[MultiModalItem(offs[0], emb.shape[0], key.encode(), emb)]
        )
        ttft = None
        while llm.engine.has_unfinished():
            for d in llm.engine.step():
                if ttft is None and d.token_ids:
                    ttft = time.perf_counter() - t0
        assert ttft is not None
        return ttft, time.perf_counter() - t0

    def separate(img: bytes, i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        parent.send(("encode", [img]))
        ((key, _length, _hit),) = parent.recv()
        entry = index.lookup(key)
        assert entry is not None
        r, dst = consumer.reserve(entry)
        consumer.start_write(r)
        parent.send(("push", key, backend.session_id, dst, entry.nbytes, f"t{i}"))
        ok = parent.recv() == "ok"
        emb = consumer.complete(r, entry, ok)
        assert emb is not None
        return run_one(key, emb, t0, i)

    local_cache: dict[bytes, torch.Tensor] = {}

    def colocated(img: bytes, i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        emb = local_cache.get(img)
        if emb is None:
            with torch.inference_mode():
                emb = local_model.encode_images(processor(decode_image(img, ImageLimits()))[None])[0]
            local_cache[img] = emb
        return run_one("sha256:" + hashlib.sha256(img).hexdigest(), emb, t0, i)

    # Warm-up outside the timings (first-call allocations, thread pools) with an image not reused.
    separate(_png(10_000), 0)
    colocated(_png(10_001), 0)
    rows = []
    for mode, fn in (("separate", separate), ("colocated", colocated)):
        for cache in ("cold", "warm"):
            ttfts, e2e = [], []
            start = time.perf_counter()
            for i, img in enumerate(images):
                # Other text in the warm round: only the embedding cache is warm, not the prefix cache
                # (the image is at position 0, so a new image also misses the prefix cache).
                t, e = fn(img, i if cache == "cold" else 1000 + i)
                ttfts.append(t)
                e2e.append(e)
            wall = time.perf_counter() - start
            rows.append(
                {
                    "encoder": mode,
                    "cache": cache,
                    "requests": len(images),
                    "ttft_p50_ms": 1e3 * pct(ttfts, 0.5),
                    "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
                    "req_per_s": len(images) / wall,
                    "out_tok_per_s": len(images) * args.output_len / wall,
                }
            )
            log(f"{mode} {cache}: done")
    parent.send(("metrics",))
    metrics = parent.recv()
    parent.send(("quit",))
    proc.join(timeout=30)
    backend.close()
    redis.terminate()
    llm.close()

    print(
        f"\n{'encoder':10} {'cache':5} {'reqs':>4} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'req/s':>7} {'tok/s':>7}"
    )
    for r in rows:
        print(
            f"{r['encoder']:10} {r['cache']:5} {r['requests']:>4} {r['ttft_p50_ms']:>12.2f} "
            f"{r['ttft_p99_ms']:>12.2f} {r['req_per_s']:>7.1f} {r['out_tok_per_s']:>7.1f}"
        )
    print(
        f"encoder metrics (separate): {metrics}; bytes received by prefill: {consumer.bytes_received._value.get():.0f}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "encoder_metrics": metrics}, indent=2))


if __name__ == "__main__":
    main()
