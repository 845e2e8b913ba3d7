"""Prompts with images, for vision-language policies (Qwen2.5-VL, Qwen3-VL): the images a prompt row names, read
with PIL, and the prompt's canonical encoding, without torchvision.

A prompt row lists its images under `images`: paths relative to the data file, or inline `data:image/...;base64,`
strings. The prompt text places them with `<image>` markers, one per image in order; a prompt without markers
shows its images first, before its text. The encoding is what the checkpoint's own processor gives (transformers'
Qwen2.5-VL and Qwen3-VL processors, which their tests compare against): the chat (or plain text) with one
`<|vision_start|><|image_pad|><|vision_end|>` per image, tokenized, each image's `<|image_pad|>` expanded to one
token per merged patch (its grid's patches / spatial_merge^2), and transformers' PIL image processor's
`pixel_values` and `image_grid_thw`. transformers' processor classes cannot be built without torchvision (their
video processor needs it); this module needs only the tokenizer and the image processor.

A row whose images cannot be read, or whose markers do not match its images, is a DataError naming the file,
the row and the image; a count of image tokens that does not match the images' patches is never truncated.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from megarl.data.prompts import DataError
from megarl.models.arch import VisionShape

MARKER = "<image>"  # where a prompt places its next image


@dataclass(frozen=True)
class ImagePrompt:
    """One prompt's encoding with its images, as the checkpoint's processor gives it."""

    input_ids: list[int]        # the prompt's tokens, each image's <|image_pad|> expanded to its merged patches
    pixel_values: Tensor        # [patches of all images, channels * temporal_patch * patch * patch] float32
    image_grid_thw: Tensor      # [images, 3] int64: (frames, patch rows, patch columns) of each image
    mm_token_type_ids: list[int]  # 1 at each image token, 0 elsewhere (what get_rope_index reads)


class ImageEncoder:
    """The prompt encoding of a Qwen-VL checkpoint (`model_dir`, its `vision` shape), images included."""

    def __init__(self, model_dir: str | Path, vision: VisionShape, *, tokenizer=None):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.vision = vision
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.placeholder = self.tokenizer.convert_ids_to_tokens(vision.image_token_id)

    def encode(self, prompt: str, images: list, *, chat: bool, where: str) -> ImagePrompt:
        """`prompt` with `images` (PIL images, in the order the prompt shows them; `read_images`), through the chat
        template when `chat`, else as plain text. `where` names the row in errors ("train.jsonl: row 7")."""
        parts = split_at_markers(prompt, len(images), where=where)
        if chat:
            content = [{"type": "image"} if part is None else {"type": "text", "text": part} for part in parts]
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                      add_generation_prompt=True)
        else:
            one = f"<|vision_start|>{self.placeholder}<|vision_end|>"
            text = "".join(one if part is None else part for part in parts)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not images:
            return ImagePrompt(input_ids=ids, pixel_values=torch.zeros(0, self.patch_width),
                               image_grid_thw=torch.zeros(0, 3, dtype=torch.int64), mm_token_type_ids=[0] * len(ids))
        pixels = self.image_processor(images=images, return_tensors="pt")
        grid = pixels["image_grid_thw"]
        per_image = (grid.prod(dim=1) // self.vision.spatial_merge ** 2).tolist()
        expanded = expand_image_tokens(ids, per_image, image_token_id=self.vision.image_token_id, where=where)
        return ImagePrompt(input_ids=expanded, pixel_values=pixels["pixel_values"], image_grid_thw=grid,
                           mm_token_type_ids=[int(t == self.vision.image_token_id) for t in expanded])

    @property
    def patch_width(self) -> int:
        v = self.vision
        return 3 * v.temporal_patch * v.patch * v.patch


def split_at_markers(prompt: str, images: int, *, where: str) -> list[str | None]:
    """The prompt's text pieces with None where each image goes: at its `<image>` markers, one per image in order,
    or all images first when it has none. DataError when markers and images disagree in number."""
    pieces = prompt.split(MARKER)
    markers = len(pieces) - 1
    if markers == 0:
        return [None] * images + [prompt]
    if markers != images:
        raise DataError(f"{where}: the prompt has {markers} {MARKER} markers for {images} images")
    out: list[str | None] = []
    for i, piece in enumerate(pieces):
        if i:
            out.append(None)
        if piece:
            out.append(piece)
    return out


def expand_image_tokens(ids: list[int], per_image: list[int], *, image_token_id: int, where: str) -> list[int]:
    """`ids` with the i-th `image_token_id` repeated per_image[i] times. DataError when the prompt holds another
    number of image placeholders than there are images (an image token typed into the prompt's text, say)."""
    found = sum(t == image_token_id for t in ids)
    if found != len(per_image):
        raise DataError(f"{where}: the prompt holds {found} image tokens for {len(per_image)} images (an image "
                        "token in the prompt's own text?)")
    out, image = [], 0
    for t in ids:
        if t == image_token_id:
            out += [t] * per_image[image]
            image += 1
        else:
            out.append(t)
    return out


_DATA_URI = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.S)


def read_images(sources: list, *, base: Path, where: str) -> list:
    """The row's images (`sources`: paths relative to `base`, the data file's folder, or data:image base64 URIs)
    as RGB PIL images. DataError naming `where` and the image when one is missing or unreadable."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise DataError(f"{where}: 'images' must be a list of paths or data:image base64 strings, got {sources!r}")
    images = []
    for n, source in enumerate(sources):
        inline = _DATA_URI.fullmatch(source)
        what = f"image {n} (inline)" if inline else f"image {n} ({source})"
        try:
            raw = base64.b64decode(inline.group(1), validate=True) if inline else (base / source).read_bytes()
            with Image.open(io.BytesIO(raw)) as image:
                images.append(image.convert("RGB"))
        except FileNotFoundError:
            raise DataError(f"{where}: {what}: no such file under {base}") from None
        except (OSError, UnidentifiedImageError, binascii.Error, ValueError) as e:
            raise DataError(f"{where}: {what} cannot be read as an image: {e}") from None
    return images
