"""Vision-language checkpoints: what megarl reads of them, before it trains them.

- tools/make_tiny_model.py's qwen2_5_vl and qwen3_vl checkpoints load in transformers with their tokenizer and
  image processor, offline and without torchvision; the Qwen-VL processor turns a chat with one image into as many
  <|image_pad|> tokens as the image has merged patches, with pixel_values and image_grid_thw that the model's
  forward takes (finite logits) and its mRoPE positions (`get_rope_index`) laid out over the image's grid;
- `read_shape` records the text model from text_config and the tower in `ModelShape.vision`, also from the flat
  config.json layout released Qwen2.5-VL checkpoints have;
- every other multimodal architecture is refused naming the file, the architecture and vision_config;
- a run whose model.path is a vision-language model stops at `Job.of`, naming the key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conftest import REPO, _tiny_model_tool

VLM_ARCHS = ("qwen2_5_vl", "qwen3_vl")


@pytest.fixture(params=VLM_ARCHS)
def vlm_dir(request, arch_dir) -> Path:
    return arch_dir(request.param)


def image_processor_inputs(model_dir: Path, image, monkeypatch):
    """transformers' own Qwen-VL processor of `model_dir` (tokenizer, image processor, chat template) and its
    encoding of a one-image chat. transformers 5.24's Qwen2_5_VLProcessor and Qwen3VLProcessor demand a video
    processor, and every video processor needs torchvision; a chat without videos never calls it, so the class
    check of that one argument is skipped and the processor built with none."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg))
    arch = AutoConfig.from_pretrained(model_dir).model_type
    cls = transformers.Qwen2_5_VLProcessor if arch == "qwen2_5_vl" else transformers.Qwen3VLProcessor
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = cls(image_processor=AutoImageProcessor.from_pretrained(model_dir), tokenizer=tokenizer,
                    video_processor=None, chat_template=tokenizer.chat_template)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many squares?"}]}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return processor, processor(text=[text], images=[image], return_tensors="pt")


def an_image(height: int, width: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_the_tiny_checkpoint_loads_offline_without_torchvision(vlm_dir):
    import importlib.util

    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLImageProcessorPil

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: this test is about the install without it")
    config = json.loads((vlm_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir, local_files_only=True)
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    assert ids == [config["vision_start_token_id"], config["vision_end_token_id"], config["image_token_id"],
                   config["video_token_id"]]
    assert isinstance(AutoImageProcessor.from_pretrained(vlm_dir, local_files_only=True), Qwen2VLImageProcessorPil)
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == \
        "<|im_start|>user\nLook: <|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"


def test_a_chat_with_an_image_runs_through_the_model(vlm_dir, monkeypatch):
    import torch
    from transformers import AutoModelForImageTextToText

    config = json.loads((vlm_dir / "config.json").read_text())
    vision = config["vision_config"]
    patch, merge = vision["patch_size"], vision["spatial_merge_size"]
    # 3 x 4 merged patches' worth of pixels, give or take a few: the processor rounds each side to whole ones
    image = an_image(3 * patch * merge + 5, 4 * patch * merge - 3)
    processor, inputs = image_processor_inputs(vlm_dir, image, monkeypatch)

    assert inputs["image_grid_thw"].tolist() == [[1, 3 * merge, 4 * merge]]  # (frames, patch rows, patch columns)
    ids = inputs["input_ids"][0]
    image_tokens = (ids == config["image_token_id"]).nonzero().flatten()
    assert len(image_tokens) == 3 * 4  # one per merged patch
    assert image_tokens.tolist() == list(range(image_tokens[0], image_tokens[0] + 12))
    assert ids[image_tokens[0] - 1] == config["vision_start_token_id"]
    assert ids[image_tokens[-1] + 1] == config["vision_end_token_id"]
    # one row per patch: 3 channels x temporal_patch_size frames x patch x patch pixels
    assert inputs["pixel_values"].shape == (3 * merge * 4 * merge, 3 * vision["temporal_patch_size"] * patch * patch)
    assert inputs["mm_token_type_ids"][0].tolist() == (ids == config["image_token_id"]).int().tolist()

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**inputs).logits
        text_only = model(input_ids=inputs["input_ids"]).logits  # the image tokens' own embeddings, 1-D positions
    assert logits.shape == (1, len(ids), config["text_config"]["vocab_size"]) and torch.isfinite(logits).all()
    first = int(image_tokens[0])
    # before the image, the same tokens at the same positions: equal up to float32 rounding of one forward pass
    torch.testing.assert_close(logits[0, :first], text_only[0, :first], rtol=0, atol=1e-5)
    assert (logits[0, first:] - text_only[0, first:]).abs().max() > 1e-3  # the image's features are used

    positions, deltas = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   image_grid_thw=inputs["image_grid_thw"])
    assert positions.shape == (3, 1, len(ids))
    t, h, w = positions[:, 0, image_tokens]
    assert (t == first).all()  # one frame: every image token at the time position the image starts at
    assert h.tolist() == [first + r for r in range(3) for _ in range(4)]
    assert w.tolist() == [first + c for _ in range(3) for c in range(4)]
    # the text after the image continues from the image's largest side (4 merged patches), not its token count
    after = int(image_tokens[-1]) + 1
    assert positions[:, 0, after].tolist() == [first + 4] * 3
    assert deltas.item() == positions.max() + 1 - len(ids)


def test_read_shape_records_the_text_model_and_the_tower(arch_dir):
    from megarl.models.arch import read_shape

    qwen25, qwen3 = read_shape(arch_dir("qwen2_5_vl")), read_shape(arch_dir("qwen3_vl"))
    for shape in (qwen25, qwen3):
        text = (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn)
        assert text == (64, 2, 4, 2, 16, 128)
        assert shape.vision.out_hidden == shape.hidden and shape.vision.spatial_merge == 2
        assert (shape.vision.depth, shape.vision.hidden, shape.vision.heads) == (2, 32, 2)
        assert sum(shape.vision.mrope_section) == shape.head_dim // 2
    assert (qwen25.qkv_bias, qwen25.qk_norm, qwen25.tied_embeddings) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.tied_embeddings) == (False, True, True)
    assert (qwen25.vision.patch, qwen25.vision.window, qwen25.vision.full_blocks, qwen25.vision.mrope_interleaved) == \
        (14, 56, (1,), False)
    assert (qwen3.vision.patch, qwen3.vision.position_embeddings, qwen3.vision.deepstack_blocks,
            qwen3.vision.mrope_interleaved) == (16, 64, (0,), True)


def test_read_shape_reads_the_released_flat_qwen2_5_vl_layout(arch_dir, tmp_path):
    """Released Qwen2.5-VL config.json files keep the text model's keys at the top level, with rope_scaling of
    type mrope; transformers reads them as text_config. The shape is the same."""
    from megarl.models.arch import read_shape

    nested = json.loads((arch_dir("qwen2_5_vl") / "config.json").read_text())
    text = nested.pop("text_config")
    text.pop("model_type")
    rope = text.pop("rope_parameters")
    flat = nested | text | {"rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
                            "rope_theta": rope["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert read_shape(tmp_path) == read_shape(arch_dir("qwen2_5_vl"))


@pytest.mark.parametrize("model_type, architecture", [
    ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    ("llava", "LlavaForConditionalGeneration"),
    ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
])
def test_other_vision_language_models_are_refused_by_name(model_type, architecture, arch_dir, tmp_path):
    from megarl.models.arch import read_shape

    config = json.loads((arch_dir("qwen2_5_vl") / "config.json").read_text())
    config |= {"model_type": model_type, "architectures": [architecture]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        read_shape(tmp_path)
    message = str(refused.value)
    assert str(tmp_path / "config.json") in message and architecture in message and "vision_config" in message


def test_a_bad_mrope_section_is_refused_by_key(arch_dir, tmp_path):
    from megarl.models.arch import read_shape

    config = json.loads((arch_dir("qwen3_vl") / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [4, 4, 4]  # 12 of the head's 8 frequencies
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mrope_section"):
        read_shape(tmp_path)


def test_training_a_vision_language_model_is_refused_at_launch(arch_dir):
    from megarl.config import RecipeError, load_config
    from megarl.job import Job

    model = arch_dir("qwen3_vl")
    cfg = load_config(REPO / "recipes" / "grpo_tiny.yaml", check_paths=False)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model)))
    with pytest.raises(RecipeError, match=r"^model\.path: .*vision-language training is not available yet"):
        Job.of(cfg, world=1, ranks_per_node=1)


def test_the_tool_writes_the_same_bytes_for_the_same_seed(tmp_path):
    tool = _tiny_model_tool()
    one = tool.make_tiny_model(tmp_path / "one", arch="qwen2_5_vl", seed=4)
    two = tool.make_tiny_model(tmp_path / "two", arch="qwen2_5_vl", seed=4)
    for name in ("model.safetensors", "config.json", "preprocessor_config.json", "tokenizer.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
