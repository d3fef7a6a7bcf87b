"""Encoder (its own process: EncoderCore + EmbeddingProducer on a real Mooncake TE, TCP) ->
prefill-side EmbeddingConsumer in this process, index in a real redis-server; the received
embeddings drive the engine to transformers' greedy tokens."""

from __future__ import annotations

import io
import multiprocessing as mp
import time

import pytest

pytest.importorskip("mooncake.engine")
torch = pytest.importorskip("torch")
PIL = pytest.importorskip("PIL")

pytestmark = pytest.mark.slow

LEASE_S = 1.5


def _png(seed: int, size: int = 24, fmt: str = "PNG") -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory):
    from pdserve.models.make_model import make_tiny_model

    return make_tiny_model("llava", tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def encoder(llava_dir, redis_url):
    """(process, pipe) of one encoder worker for the module (a spawn costs ~5-8 s on 2 cores);
    the last test kills it."""
    from services.encoder.pipe_worker import run_encoder_worker

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=run_encoder_worker, args=(child, str(llava_dir), redis_url, LEASE_S, 256 * 256), daemon=True
    )
    proc.start()
    try:
        assert parent.poll(120) and parent.recv() == "ready"
        yield proc, parent
    finally:
        if proc.is_alive():
            parent.send(("quit",))
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def test_encoder_cache_transfer_and_parity(llava_dir, redis_url, encoder, make_llm) -> None:
    from pdserve.embedcache.connector import EmbeddingConsumer
    from pdserve.embedcache.index import EmbeddingIndex
    from pdserve.engine.request import MultiModalItem
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kvtransfer.backend import MooncakeBackend
    from pdserve.models.image_processor import ClipImageProcessor, ImageLimits, decode_image
    from pdserve.models.llava import expand_image_placeholders
    from pdserve.models.make_model import IMAGE_TOKEN

    _proc, parent = encoder
    backend = MooncakeBackend(host="127.0.0.1")
    try:
        index = EmbeddingIndex.from_url(redis_url)
        consumer = EmbeddingConsumer(backend, 1 << 20, lease_s=LEASE_S)
        imgs = [_png(1), _png(2, fmt="JPEG"), _png(3, fmt="WEBP"), _png(1)]  # the last repeats the first
        parent.send(("encode", imgs))
        items = parent.recv()
        assert items[0][0] == items[3][0] and len({k for k, _, _ in items}) == 3
        parent.send(("metrics",))
        assert parent.recv() == {"encoded": 3.0, "hits": 0.0, "misses": 3.0}, (
            "the repeated image is encoded once"
        )
        parent.send(("encode", [imgs[0]]))
        assert parent.recv()[0][2] is True, "a later request with the same image is a cache hit"
        parent.send(("metrics",))
        assert parent.recv() == {"encoded": 3.0, "hits": 1.0, "misses": 3.0}

        received = []
        for key, length, _hit in items[:3]:
            entry = index.lookup(key)
            assert entry is not None and entry.shape[0] == length
            r, dst = consumer.reserve(entry)
            consumer.start_write(r)
            parent.send(("push", key, backend.session_id, dst, entry.nbytes, "t-" + key[:8]))
            assert parent.recv() == "ok"
            got = consumer.complete(r, entry, ok=True)
            assert got is not None
            received.append((key, got))
        assert consumer.table.num_reserved == 0, "nothing stays reserved on prefill"
        assert consumer.bytes_received._value.get() == sum(e.numel() * e.element_size() for _, e in received)

        # The pushed bytes are the vision tower's output for the decoded image.
        from transformers import LlavaForConditionalGeneration

        proc_cfg = ClipImageProcessor.from_model_dir(llava_dir)
        ref = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
        pixels = [proc_cfg(decode_image(b, ImageLimits())) for b in imgs[:3]]
        llm = make_llm(llava_dir, device="cpu", dtype="float32")
        tok = llm.tokenizer
        image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i, ((key, emb), px) in enumerate(zip(received, pixels, strict=True)):
            ids, offs = expand_image_placeholders(
                tok.encode(f"{IMAGE_TOKEN}\nWhat is this?", add_special_tokens=False), image_id, emb.shape[0]
            )
            llm.engine.add_request(
                ids, params, f"r{i}", mm_items=[MultiModalItem(offs[0], emb.shape[0], key.encode(), emb)]
            )
            toks: list[int] = []
            while llm.engine.has_unfinished():
                for d in llm.engine.step():
                    toks.extend(d.token_ids)
            with torch.no_grad():
                g = ref.generate(
                    input_ids=torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    pixel_values=px[None],
                    max_new_tokens=8,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            assert toks == g[0, len(ids) :].tolist(), f"image {i}"

        # Malformed images: a 400 each, nothing encoded, nothing new in the index.
        before = set(index.keys())
        png = _png(7)
        for bad in (png[: len(png) // 2], b"not an image at all", _png(8, size=300)):
            parent.send(("encode", [bad]))
            reply = parent.recv()
            assert isinstance(reply, tuple) and reply[0] == "400", reply
        assert set(index.keys()) == before
        time.sleep(LEASE_S + 0.5)
        assert index.keys() == [], "entries expire with their lease when nobody refreshes them"
    finally:
        backend.close()


def test_killing_the_encoder_mid_request_leaves_nothing_reserved(redis_url, encoder) -> None:
    """Last in the module: it kills the module's encoder worker."""
    from pdserve.embedcache.connector import EmbeddingConsumer
    from pdserve.embedcache.index import EmbeddingIndex
    from pdserve.kvtransfer.backend import MooncakeBackend

    proc, parent = encoder
    backend = MooncakeBackend(host="127.0.0.1")
    try:
        consumer = EmbeddingConsumer(backend, 1 << 20, lease_s=LEASE_S)
        parent.send(("encode", [_png(42)]))
        ((key, _length, _hit),) = parent.recv()
        entry = EmbeddingIndex.from_url(redis_url).lookup(key)
        assert entry is not None
        r, _dst = consumer.reserve(entry)
        consumer.start_write(r)
        proc.kill()  # the encoder dies before it pushes
        proc.join(timeout=10)
        t0 = time.monotonic()
        try:
            alive = parent.poll(2.0) and parent.recv() == "ok"
        except (EOFError, ConnectionResetError):
            alive = False
        assert not alive and time.monotonic() - t0 < 3.0, "a clean error within the wait's timeout"
        assert consumer.complete(r, entry, ok=False) is None
        assert consumer.table.num_reserved == 0, "nothing stays reserved on prefill"
        time.sleep(LEASE_S + 0.5)
        assert EmbeddingIndex.from_url(redis_url).lookup(key) is None, "the dead encoder's entry expired"
    finally:
        if proc.is_alive():
            proc.kill()
        backend.close()
