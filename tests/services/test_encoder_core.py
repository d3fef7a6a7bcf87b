"""EncoderCore batches the misses of concurrent calls into shared tower calls (fake model and
producer: a unit test of the batching only; the real tower is in tests/embedcache and e2e)."""

from __future__ import annotations

import io
import threading
import time

import pytest
import torch

pytest.importorskip("PIL")

from pdserve.models.image_processor import ClipImageProcessor, ImageLimits
from services.encoder.core import EncoderCore, ImageInput


def _png(seed: int) -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    Image.fromarray((torch.rand(8, 8, 3, generator=g) * 255).to(torch.uint8).numpy()).save(buf, format="PNG")
    return buf.getvalue()


class _Model:
    num_image_tokens = 2

    def __init__(self, fail: bool = False) -> None:
        self.batch_sizes: list[int] = []
        self.fail = fail
        self.entered = threading.Event()  # a batch is in the tower
        self.release = threading.Event()  # cleared: the first batch stays in the tower until set
        self.release.set()

    def encode_images(self, px: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(px.shape[0])
        self.entered.set()
        self.release.wait(10)
        time.sleep(0.3)  # long enough for the other calls to queue behind this batch
        if self.fail:
            raise RuntimeError("tower failed")
        return px.sum(dim=(1, 2, 3))[:, None, None].expand(-1, 2, 4).clone()  # [k, 2, 4]


class _Producer:
    def __init__(self) -> None:
        self.put_calls: dict[str, torch.Tensor] = {}

    def has(self, key: str) -> bool:
        return key in self.put_calls

    def put(self, key: str, e: torch.Tensor) -> None:
        self.put_calls[key] = e


def _core(model: _Model, producer: _Producer) -> EncoderCore:
    proc = ClipImageProcessor(8, (8, 8), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return EncoderCore(model, proc, producer, ImageLimits())  # type: ignore[arg-type]


def test_concurrent_calls_share_batches_and_get_their_own_rows() -> None:
    model, producer = _Model(), _Producer()
    core = _core(model, producer)
    images = [_png(i) for i in range(5)]
    out: dict[int, list] = {}
    model.release.clear()
    first = threading.Thread(target=lambda: out.__setitem__(0, core.encode([ImageInput(images[0])])))
    first.start()
    assert model.entered.wait(10), "the first batch never reached the tower"
    rest = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, core.encode([ImageInput(images[i])])))
        for i in range(1, 5)
    ]
    for t in rest:
        t.start()
    time.sleep(1.0)  # the four calls queue behind the batch in the tower (a loaded host: not 0.1 s)
    model.release.set()
    for t in [first, *rest]:
        t.join(timeout=10)
    assert model.batch_sizes == [1, 4], "the four calls that waited ran as one batch"
    proc = ClipImageProcessor(8, (8, 8), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    from pdserve.models.image_processor import decode_image

    for i in range(5):
        (item,) = out[i]
        want = proc(decode_image(images[i], ImageLimits())).sum()
        assert torch.allclose(producer.put_calls[item.key], want.expand(2, 4)), f"call {i} got another's rows"
    assert core.metrics.images_encoded._value.get() == 5


def test_a_failed_batch_fails_every_waiting_call_and_the_core_recovers() -> None:
    model, producer = _Model(fail=True), _Producer()
    core = _core(model, producer)
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            core.encode([ImageInput(_png(100 + i))])
        except RuntimeError as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(errors) == 3 and not any(t.is_alive() for t in threads)
    model.fail = False
    assert core.encode([ImageInput(_png(200))])[0].length == 2
