"""Prompts with images (megarl.data.images): the encoding equals what the checkpoint's own Qwen-VL processor gives,
token for token and pixel for pixel, for both architectures, one image or several placed by `<image>` markers; images
come from files or inline base64; a row whose images cannot be read or do not match its markers is a DataError
naming the file, the row and the image."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch

from megarl.data.images import ImageEncoder, read_images
from megarl.data.prompts import DataError
from test_architectures_vlm import VLM_ARCHS, an_image, image_processor_inputs

WHERE = "train.jsonl: row 3"


@pytest.fixture(params=VLM_ARCHS)
def vlm_dir(request, arch_dir) -> Path:
    return arch_dir(request.param)


def encoder_of(model_dir: Path) -> ImageEncoder:
    from megarl.models.arch import read_shape

    return ImageEncoder(model_dir, read_shape(str(model_dir)).vision)


def processor_encoding(model_dir: Path, content: list[dict], images: list, monkeypatch) -> dict:
    """transformers' own processor on a user turn of `content` (its text and image parts in order)."""
    processor, _ = image_processor_inputs(model_dir, images[0], monkeypatch)
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    return processor(text=[text], images=images, return_tensors="pt")


def assert_equal_encoding(got, want) -> None:
    assert got.input_ids == want["input_ids"][0].tolist()
    assert torch.equal(got.pixel_values, want["pixel_values"])
    assert torch.equal(got.image_grid_thw, want["image_grid_thw"])
    assert got.mm_token_type_ids == want["mm_token_type_ids"][0].tolist()


def test_one_image_before_the_text_encodes_as_the_checkpoints_processor_does(vlm_dir, monkeypatch):
    image = an_image(61, 90)
    got = encoder_of(vlm_dir).encode("How many squares are in the image?", [image], chat=True, where=WHERE)
    want = processor_encoding(vlm_dir, [{"type": "image"}, {"type": "text", "text": "How many squares are in the image?"}],
                              [image], monkeypatch)
    assert_equal_encoding(got, want)
    assert sum(got.mm_token_type_ids) == int(got.image_grid_thw.prod()) // encoder_of(vlm_dir).vision.spatial_merge ** 2


def test_images_go_where_the_prompts_markers_put_them(vlm_dir, monkeypatch):
    small, large = an_image(40, 40), an_image(70, 100)
    got = encoder_of(vlm_dir).encode("Left: <image> right: <image> Which is larger?", [small, large], chat=True,
                                     where=WHERE)
    want = processor_encoding(vlm_dir, [{"type": "text", "text": "Left: "}, {"type": "image"},
                                        {"type": "text", "text": " right: "}, {"type": "image"},
                                        {"type": "text", "text": " Which is larger?"}], [small, large], monkeypatch)
    assert_equal_encoding(got, want)
    assert got.image_grid_thw.shape == (2, 3)


def test_without_the_chat_template_the_images_precede_the_text(vlm_dir):
    encoder = encoder_of(vlm_dir)
    v = encoder.vision
    got = encoder.encode("2+2=", [an_image(40, 60)], chat=False, where=WHERE)
    tokens = int(got.image_grid_thw.prod()) // v.spatial_merge ** 2
    text = encoder.tokenizer("2+2=", add_special_tokens=False)["input_ids"]
    assert got.input_ids == [v.vision_start_id, *[v.image_token_id] * tokens, v.vision_end_id, *text]


def test_inline_base64_reads_as_the_file_does(tmp_path):
    image = an_image(30, 20)
    image.save(tmp_path / "a.png")
    encoded = base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    from_file, inline = read_images(["a.png", f"data:image/png;base64,{encoded}"], base=tmp_path, where=WHERE)
    assert list(from_file.getdata()) == list(inline.getdata()) == list(image.getdata())


def test_a_bad_row_is_named_with_its_file_row_and_image(vlm_dir, tmp_path):
    (tmp_path / "text.png").write_text("not a picture")
    bad = {
        "missing.png": "train.jsonl: row 3: image 0 (missing.png): no such file under",
        "text.png": "train.jsonl: row 3: image 0 (text.png) cannot be read as an image",
        "data:image/png;base64,@@@": "train.jsonl: row 3: image 0 (inline) cannot be read as an image",
    }
    for source, message in bad.items():
        with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_images([source], base=tmp_path, where=WHERE)
    with pytest.raises(DataError, match="'images' must be a list of paths"):
        read_images("a.png", base=tmp_path, where=WHERE)
    encoder = encoder_of(vlm_dir)
    with pytest.raises(DataError, match=r"train.jsonl: row 3: the prompt has 2 <image> markers for 1 images"):
        encoder.encode("<image> and <image>", [an_image(30, 30)], chat=True, where=WHERE)
    typed = encoder.tokenizer.convert_ids_to_tokens(encoder.vision.image_token_id)
    with pytest.raises(DataError, match=r"train.jsonl: row 3: the prompt holds 2 image tokens for 1 images"):
        encoder.encode(f"what is {typed}?", [an_image(30, 30)], chat=True, where=WHERE)



def test_mrope_positions_are_get_rope_indexs_alone_and_packed(vlm_dir):
    """Each sample's positions equal transformers' get_rope_index for it (one image, two, none before the text's
    end, a response after); a packed row of the three is each one's positions, from 0 each."""
    from transformers import AutoModelForImageTextToText

    from megarl.models.mrope import mrope_positions, packed_mrope_positions

    encoder = encoder_of(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    response = encoder.tokenizer("12 squares", add_special_tokens=False)["input_ids"]
    samples = [encoder.encode("How many?", [an_image(61, 90)], chat=True, where=WHERE),
               encoder.encode("<image> or <image>?", [an_image(40, 40), an_image(100, 30)], chat=True, where=WHERE),
               encoder.encode("<image>", [an_image(30, 120)], chat=False, where=WHERE)]
    packed = []
    for sample in samples:
        ids = sample.input_ids + response
        types = sample.mm_token_type_ids + [0] * len(response)
        want, _ = model.model.get_rope_index(torch.tensor([ids]), torch.tensor([types]),
                                             image_grid_thw=sample.image_grid_thw)
        got = mrope_positions(types, sample.image_grid_thw, spatial_merge=encoder.vision.spatial_merge)
        assert torch.equal(got, want[:, 0]), (got, want[:, 0])
        packed.append((types, sample.image_grid_thw))
    row = packed_mrope_positions(packed, spatial_merge=encoder.vision.spatial_merge)
    lengths = [len(types) for types, _ in packed]
    for piece, (types, grids) in zip(row.split(lengths, dim=1), packed):
        assert torch.equal(piece, mrope_positions(types, grids, spatial_merge=encoder.vision.spatial_merge))
    with pytest.raises(ValueError, match="a run of 3 image tokens for an image of 1 x"):
        mrope_positions([0, 1, 1, 1, 0], samples[0].image_grid_thw, spatial_merge=encoder.vision.spatial_merge)
