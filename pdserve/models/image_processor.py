"""Image bytes -> pixel values for the CLIP tower, from the checkpoint's ``preprocessor_config.json``.

Decoding is bounded before any pixel is decoded: at most ``max_image_bytes`` of input and
``max_image_pixels`` (width x height, read from the header) per image, formats PNG / JPEG / WebP.
Steps as CLIPImageProcessor: RGB, resize the shortest edge (bicubic), center crop, rescale,
normalize with the checkpoint's mean / std.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.errors import ConfigError, InvalidRequestError

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 4096 * 4096


@dataclass(frozen=True)
class ClipImageProcessor:
    shortest_edge: int
    crop: tuple[int, int]  # (height, width)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float = 1 / 255

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ClipImageProcessor:
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: a LLaVA checkpoint folder needs its image processor config")
        c = json.loads(path.read_text())
        size = c.get("size", {})
        crop = c.get("crop_size", {})
        edge = size.get("shortest_edge") or size.get("height")
        if not edge:
            raise ConfigError(f"{path}: size must have shortest_edge or height, got {size}")
        crop_hw = (int(crop.get("height", edge)), int(crop.get("width", edge)))
        return cls(
            int(edge),
            crop_hw,
            tuple(c["image_mean"]),
            tuple(c["image_std"]),
            float(c.get("rescale_factor", 1 / 255)),
        )  # type: ignore[arg-type]

    def __call__(self, image) -> torch.Tensor:  # PIL.Image -> [3, H, W] fp32
        from PIL import Image

        image = image.convert("RGB")
        w, h = image.size
        scale = self.shortest_edge / min(w, h)
        image = image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC)
        w, h = image.size
        ch, cw = self.crop
        left, top = (w - cw) // 2, (h - ch) // 2
        image = image.crop((left, top, left + cw, top + ch))
        x = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()) * self.rescale_factor  # [H, W, 3]
        x = (x - torch.tensor(self.mean)) / torch.tensor(self.std)
        return x.permute(2, 0, 1).contiguous()  # [3, H, W]


def decode_image(data: bytes, limits: ImageLimits):  # -> PIL.Image
    """Decode ``data`` within ``limits``; InvalidRequestError (a 400) for anything else."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise InvalidRequestError(
            f"image: {len(data)} bytes exceeds max_image_bytes={limits.max_image_bytes}", field="image_url"
        )
    try:
        img = Image.open(io.BytesIO(data), formats=list(ALLOWED_FORMATS))  # reads the header only
    except UnidentifiedImageError as e:
        raise InvalidRequestError(f"image: not a {'/'.join(ALLOWED_FORMATS)} image", field="image_url") from e
    w, h = img.size
    if w * h > limits.max_image_pixels:
        raise InvalidRequestError(
            f"image: {w}x{h} = {w * h} pixels exceeds max_image_pixels={limits.max_image_pixels}",
            field="image_url",
        )
    try:
        img.load()  # the full decode: a truncated file fails here
    except (OSError, SyntaxError, ValueError) as e:
        raise InvalidRequestError(f"image: cannot decode ({e})", field="image_url") from e
    return img
