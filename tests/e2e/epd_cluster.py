"""Helpers of the image e2e tests: a tiny LLaVA, an encoder -> prefill -> decode cluster config
(with a real redis-server for the embedding-cache index), PNG bytes, and the transformers reference."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import httpx
import torch

from pdserve.config.cluster import ClusterConfig
from services.launcher import pick_base_port
from tests.e2e import cluster as e2e_cluster


def png(seed: int, size: int = 24, fmt: str = "PNG") -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def image_part(data: bytes, mime: str = "png") -> dict[str, Any]:
    return {
        "type": "image_url",
        "image_url": {"url": f"data:image/{mime};base64," + base64.b64encode(data).decode()},
    }


def epd_config(
    model_dir: Path,
    redis_url: str | None,
    *,
    encoder: bool = True,
    lease_s: float = 3.0,
    extra: dict[str, dict[str, Any]] | None = None,  # node name -> more node settings
    **router: Any,
) -> ClusterConfig:
    if e2e_cluster._next_base[0] + 8 > 32000:
        e2e_cluster._next_base[0] = 20000
    base = pick_base_port("127.0.0.1", e2e_cluster._next_base[0], span=8)
    e2e_cluster._next_base[0] = base + 10
    nodes: list[dict[str, Any]] = []
    if encoder:
        nodes.append(
            {"name": "encoder-0", "role": "encoder", "grpc_port": base + 5, "metrics_port": base + 6}
            | {"ec_lease_s": lease_s, "max_image_pixels": 64 * 64, "device": "cpu"}
        )
    nodes += [
        {"name": "prefill-0", "role": "prefill", "grpc_port": base + 1, "metrics_port": base + 2}
        | {"ec_lease_s": lease_s, "device": "cpu", "dtype": "float32"},
        {"name": "decode-0", "role": "decode", "grpc_port": base + 3, "metrics_port": base + 4}
        | {"device": "cpu", "dtype": "float32"},
    ]
    for n in nodes:
        n.update((extra or {}).get(n["name"], {}))
    data: dict[str, Any] = {
        "model": str(model_dir),
        "router": {"host": "127.0.0.1", "port": base, "local_prefill_max_tokens": 0, **router},
        "nodes": nodes,
    }
    if redis_url:
        data["redis_url"] = redis_url
    return ClusterConfig.from_dict(data)


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) at ``url``."""
    text = httpx.get(url, timeout=5).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {"
    )


class LlavaReference:
    """transformers' LlavaForConditionalGeneration.generate on the same checkpoint and prompt."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import LlavaForConditionalGeneration

        from pdserve.models.image_processor import ClipImageProcessor
        from pdserve.models.loader import load_tokenizer
        from pdserve.models.make_model import IMAGE_TOKEN

        self.model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = ClipImageProcessor.from_model_dir(model_dir)
        self.tok = load_tokenizer(model_dir)
        self.image_token = IMAGE_TOKEN
        self.image_id = self.tok.convert_tokens_to_ids(IMAGE_TOKEN)
        self.num_image_tokens = int(self.model.config.image_seq_length)

    def prompt_ids(self, text: str, num_images: int) -> list[int]:
        """The chat prompt the router renders for [images..., text] content parts, expanded."""
        content = "\n".join([self.image_token] * num_images + [text])
        rendered = self.tok.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        ids = self.tok.encode(rendered, add_special_tokens=False)
        out: list[int] = []
        for t in ids:
            out.extend([t] * self.num_image_tokens if t == self.image_id else [t])
        return out

    def greedy(self, text: str, images: list[bytes], n: int) -> list[int]:
        from pdserve.models.image_processor import ImageLimits, decode_image

        ids = self.prompt_ids(text, len(images))
        pixels = torch.stack([self.processor(decode_image(b, ImageLimits())) for b in images])
        with torch.no_grad():
            g = self.model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                pixel_values=pixels,
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        return g[0, len(ids) :].tolist()
