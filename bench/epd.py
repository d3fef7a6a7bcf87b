"""Encoder -> prefill image requests: TTFT and throughput, cold vs warm embedding cache, encoder
colocated (in the prefill process) vs separate (own process, embeddings pushed over Mooncake TCP,
index in a real redis-server). CPU, tiny random LLaVA, one request at a time.

    PYTHONPATH=$PWD .venv/bin/python bench/epd.py [--num-images 16] [--output-len 8]
        [--out bench/results/epd.json]
    PYTHONPATH=$PWD .venv/bin/python bench/epd.py --served [--num-images 16] [--concurrency 4]
        [--out bench/results/epd_served.json]

In-process (default): TTFT = image bytes in hand -> first token out of the engine (encode or
cache hit, index lookup, reservation, push, prefill); the router / gRPC hops are not in it.

--served: real processes (router, encoder, prefill, decode, redis-server), the openai client
streaming chat completions with data-URL images; TTFT = request sent -> first content chunk.
Two clusters side by side: "separate" (an encoder node; prefill pulls embeddings over Mooncake,
index in Redis) and "colocated" (no encoder node: prefill runs the vision tower itself). Rounds,
interleaved per repetition: cold (new images), warm (the same images, other text: only the
embedding cache is warm), and precomputed image_embeds sent by the client (no encoder hop;
computed before the clock starts).
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
from typing import Any

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
    ap.add_argument("--out", default=None)
    ap.add_argument("--served", action="store_true", help="through the router and real node processes")
    ap.add_argument("--concurrency", type=int, default=4, help="--served: requests in flight")
    ap.add_argument("--reps", type=int, default=3, help="--served: interleaved repetitions")
    args = ap.parse_args()
    if args.served:
        served(args)
        return
    args.out = args.out or "bench/results/epd.json"

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


def served(args: argparse.Namespace) -> None:
    import base64
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai
    import torch
    from safetensors.torch import save

    from pdserve.config.cluster import ClusterConfig, write_cluster_config
    from pdserve.models.image_processor import ClipImageProcessor, ImageLimits, decode_image
    from pdserve.models.loader import load_model
    from pdserve.models.make_model import make_tiny_model
    from services.launcher import pick_base_port, start_child, stop_children, wait_ready

    tmp = Path(tempfile.mkdtemp(prefix="epd-served-"))
    model_dir = make_tiny_model("llava", tmp / "llava")
    rport = _free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", ""], stdout=subprocess.DEVNULL
    )
    node = {"device": "cpu", "dtype": "float32"}

    def cluster_of(name: str, base: int, encoder: bool) -> ClusterConfig:
        nodes = [
            {"name": "prefill-0", "role": "prefill", "grpc_port": base + 1, "metrics_port": base + 2} | node,
            {"name": "decode-0", "role": "decode", "grpc_port": base + 3, "metrics_port": base + 4} | node,
        ]
        extra: dict[str, Any] = {}
        if encoder:
            nodes.append(
                {"name": "encoder-0", "role": "encoder", "grpc_port": base + 5, "metrics_port": base + 6}
                | node
            )
            extra["redis_url"] = f"redis://127.0.0.1:{rport}/0"
        return ClusterConfig.from_dict(
            {
                "model": str(model_dir),
                "router": {"host": "127.0.0.1", "port": base, "local_prefill_max_tokens": 0},
                "nodes": nodes,
                **extra,
            }
        )

    b1 = pick_base_port("127.0.0.1", 23000, span=8)
    b2 = pick_base_port("127.0.0.1", b1 + 10, span=8)
    clusters = {"separate": cluster_of("separate", b1, True), "colocated": cluster_of("colocated", b2, False)}
    # where the images are encoded, per cluster (the encoder node, or prefill itself)
    enc_metrics = {
        "separate": f"http://127.0.0.1:{b1 + 6}/metrics",
        "colocated": f"http://127.0.0.1:{b2 + 2}/metrics",
    }
    children = []
    for name, c in clusters.items():
        (tmp / name).mkdir()
        cfg = write_cluster_config(c, tmp / name / "cluster.yaml")
        children += [start_child(cfg, n.role, n.name, tmp / name) for n in c.nodes]
        children.append(start_child(cfg, "router", None, tmp / name))

    def metric(mode: str, name: str) -> float:
        text = httpx.get(enc_metrics[mode], timeout=5).text
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + " "))

    def url(img: bytes) -> dict:
        return {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(img).decode()},
        }

    # Client-side embeddings for the precomputed round (the same tower, before the clock).
    local_model, _ = load_model(model_dir, torch.float32, "cpu")
    processor = ClipImageProcessor.from_model_dir(model_dir)

    def embeds_part(img: bytes) -> dict:
        with torch.inference_mode():
            e = local_model.encode_images(processor(decode_image(img, ImageLimits()))[None])[0]  # type: ignore[operator]
        return {
            "type": "image_embeds",
            "image_embeds": base64.b64encode(save({"e": e.contiguous()})).decode(),
        }

    clients = {
        m: openai.OpenAI(base_url=c.router_url + "/v1", api_key="none", max_retries=0, timeout=120)
        for m, c in clusters.items()
    }

    def one(mode: str, part: dict, text: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        ttft = None
        stream = clients[mode].chat.completions.create(
            model=clusters[mode].served_name(str(model_dir)),
            messages=[{"role": "user", "content": [part, {"type": "text", "text": text}]}],
            max_tokens=args.output_len,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - t0
        assert ttft is not None
        return ttft, time.perf_counter() - t0

    rows = []
    try:
        for c in clusters.values():
            wait_ready(c, children, timeout_s=300)
        for mode in clusters:
            for i in range(3):  # warm-up: first-call allocations, channels, thread pools
                one(mode, url(_png(50_000 + i)), "warm-up")
        # Interleaved repetitions (a shared host's load drifts): each repetition has new images
        # for its cold rounds, the same ones for its warm rounds, and their client-side embeddings.
        acc: dict[tuple[str, str], dict[str, Any]] = {}
        for rep in range(args.reps):
            images = [_png(1000 * rep + i) for i in range(args.num_images)]
            rounds = []
            for mode in clusters:
                rounds += [
                    (mode, "cold", [url(im) for im in images], "Question {}?"),
                    (mode, "warm", [url(im) for im in images], "Another question {}?"),
                ]
            rounds.append(
                ("separate", "client embeds", [embeds_part(im) for im in images], "Third question {}?")
            )
            for mode, cache, parts, text in rounds:
                enc0 = metric(mode, "pdserve:encoder_images_encoded_total")
                hit0 = metric(mode, "pdserve:ec_cache_hits_total")
                start = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    res = list(
                        pool.map(lambda ip, t=text, m=mode: one(m, ip[1], t.format(ip[0])), enumerate(parts))
                    )
                a = acc.setdefault((mode, cache), {"ttfts": [], "wall": 0.0, "n": 0, "enc": 0.0, "hits": 0.0})
                a["ttfts"] += [t for t, _ in res]
                a["wall"] += time.perf_counter() - start
                a["n"] += len(parts)
                a["enc"] += metric(mode, "pdserve:encoder_images_encoded_total") - enc0
                a["hits"] += metric(mode, "pdserve:ec_cache_hits_total") - hit0
            log(f"repetition {rep + 1}/{args.reps}: done")
        for (mode, cache), a in acc.items():
            rows.append(
                {
                    "encoder": mode,
                    "cache": cache,
                    "requests": a["n"],
                    "concurrency": args.concurrency,
                    "ttft_p50_ms": 1e3 * pct(a["ttfts"], 0.5),
                    "ttft_p99_ms": 1e3 * pct(a["ttfts"], 0.99),
                    "req_per_s": a["n"] / a["wall"],
                    "out_tok_per_s": a["n"] * args.output_len / a["wall"],
                    "encoded": a["enc"],
                    "cache_hits": a["hits"],
                }
            )
    finally:
        stop_children(children)
        redis.terminate()
    print(
        f"\n{'encoder':10} {'cache':13} {'reqs':>4} {'conc':>4} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
        f"{'req/s':>7} {'tok/s':>7} {'encoded':>7} {'hits':>5}"
    )
    for r in rows:
        print(
            f"{r['encoder']:10} {r['cache']:13} {r['requests']:>4} {r['concurrency']:>4} "
            f"{r['ttft_p50_ms']:>12.1f} {r['ttft_p99_ms']:>12.1f} {r['req_per_s']:>7.1f} "
            f"{r['out_tok_per_s']:>7.1f} {r['encoded']:>7.0f} {r['cache_hits']:>5.0f}"
        )
    cold = rows[0]
    for r in rows[1:]:
        print(
            f"{r['encoder']} {r['cache']} vs separate cold: TTFT p50 x{r['ttft_p50_ms'] / cold['ttft_p50_ms']:.2f}, "
            f"req/s x{r['req_per_s'] / cold['req_per_s']:.2f}"
        )
    out = Path(args.out or "bench/results/epd_served.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
