"""An encoder in a child process, driven over a ``multiprocessing`` pipe between our own
processes (tests and bench/epd.py; the served node answers gRPC instead). Commands:

    ("encode", [image bytes, ...])                        -> [(key, length, cache_hit), ...] | ("400", msg)
    ("push", key, peer_session, dst_addr, nbytes, tid)    -> "ok" | ("400", msg)
    ("metrics",)                                          -> {"encoded": n, "hits": n, "misses": n}
    ("quit",)
"""

from __future__ import annotations

from typing import Any


def run_encoder_worker(
    conn: Any,
    model_dir: str,
    redis_url: str,
    lease_s: float,
    max_image_pixels: int,
    buffer_bytes: int = 64 << 20,
) -> None:
    import torch

    from pdserve.embedcache.connector import EmbeddingProducer
    from pdserve.embedcache.index import EmbeddingIndex
    from pdserve.errors import InvalidRequestError
    from pdserve.kvtransfer.backend import MooncakeBackend
    from pdserve.models.image_processor import ClipImageProcessor, ImageLimits
    from pdserve.models.loader import load_model
    from services.encoder.core import EncoderCore, ImageInput

    torch.set_num_threads(1)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    backend = MooncakeBackend(host="127.0.0.1")
    producer = EmbeddingProducer(
        "encoder-0", backend, EmbeddingIndex.from_url(redis_url), buffer_bytes, lease_s
    )
    limits = ImageLimits(max_image_pixels=max_image_pixels)
    core = EncoderCore(model, ClipImageProcessor.from_model_dir(model_dir), producer, limits)  # type: ignore[arg-type]
    conn.send("ready")
    try:
        while (cmd := conn.recv())[0] != "quit":
            try:
                if cmd[0] == "encode":
                    out = core.encode([ImageInput(b) for b in cmd[1]])
                    conn.send([(e.key, e.length, e.cache_hit) for e in out])
                elif cmd[0] == "push":
                    producer.push(*cmd[1:])
                    conn.send("ok")
                elif cmd[0] == "metrics":
                    m = core.metrics
                    conn.send(
                        {
                            "encoded": m.images_encoded._value.get(),
                            "hits": m.cache_hits._value.get(),
                            "misses": m.cache_misses._value.get(),
                        }
                    )
            except InvalidRequestError as e:
                conn.send(("400", str(e)))
    finally:
        producer.close()
        backend.close()
