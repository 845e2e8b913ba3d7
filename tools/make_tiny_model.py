"""Write a tiny HuggingFace causal-LM checkpoint, built entirely on this machine.

    python tools/make_tiny_model.py --out DIR [--arch ARCH] [--seed N] [--tool-chat]
                                    [--hidden 64 --layers 2 --heads 4 --kv-heads 2 --ffn 128]
                                    [--experts 4 --topk 2 --moe-ffn 32 --shared-ffn 48]

ARCH is one of qwen2, llama, qwen3, mistral, gemma3 (dense) or mixtral, qwen2_moe, qwen3_moe, glm4_moe,
deepseek_v3, gpt_oss (mixture of experts).

The directory holds config.json, model.safetensors, generation_config.json and tokenizer files that
`transformers.AutoModelForCausalLM` and `AutoTokenizer` load with no network access. The tokenizer is
byte-level BPE without merges (every printable ASCII character is one token) plus three special tokens,
which keeps arithmetic prompts short and the vocabulary small enough for CPU tests.

--tool-chat makes a chat model for tool-using agents instead, as Qwen2.5-Instruct is set up: the tool markup
<tool_call>, </tool_call>, <tool_response>, </tool_response> are added (non-special) tokens, the chat
template renders tool messages as Qwen2.5 does, and the end of an assistant turn, <|im_end|>, is EOS. Without
it the output is unchanged, byte for byte.

qwen2 models have a bias on q/k/v and tied embeddings; llama models have no bias and an untied output
layer. qwen3 adds per-head q/k RMSNorm; mistral is llama-shaped with a sliding window longer than any
tiny sequence. The MoE models route each token to --topk of --experts experts: mixtral renormalizes the
top-k router probabilities (expert width --ffn), qwen2_moe does not and adds a sigmoid-gated shared
expert (--shared-ffn) and qkv bias, qwen3_moe renormalizes and has q/k norm (expert width --moe-ffn).
glm4_moe and deepseek_v3 route by sigmoid scores with a random load-balancing bias, in 2 groups of experts
(top-1 group), scale the routed weights by 2.5, add one shared expert of width --moe-ffn and keep layer 0
dense; glm4_moe has partial RoPE, qkv bias and q/k norm, deepseek_v3 multi-latent attention with YaRN RoPE.
gpt_oss has attention sinks, a sliding window of 8 tokens on every other layer, biases everywhere, YaRN RoPE and
a SwiGLU clamp (0.1) the tiny activations reach.
gemma3 is Gemma 3's text model (model_type gemma3_text): layers alternate local attention over a window of 8
tokens (shorter than the test sequences) and global attention with linear RoPE scaling, the attention scale is
set by a query_pre_attn_scalar other than the head dim, and the final logits are softcapped at 2 (small enough
to change a tiny model's logits measurably).

qwen2_5_vl and qwen3_vl are vision-language models (Qwen2_5_VLForConditionalGeneration,
Qwen3VLForConditionalGeneration): the text model of the sizes above under a vision tower of depth 2, width 32 and
2 heads whose 2 x 2 merged patches (14 px for qwen2_5_vl, 16 px for qwen3_vl, as released) become one image token
each. qwen2_5_vl's tower attends within windows of 2 x 2 merged patches in its first block and over the whole image
in its second (as Qwen2.5-VL's windowed and full blocks); qwen3_vl's has learned position embeddings and feeds
its first block's merged features into the first text layer (DeepStack). The tokenizer adds <|vision_start|>,
<|vision_end|>, <|image_pad|> and <|video_pad|>, its chat template renders a content part {"type": "image"} as
<|vision_start|><|image_pad|><|vision_end|>, and preprocessor_config.json configures the Qwen2-VL image processor
(transformers' PIL one loads without torchvision), resizing images to 4..16 image tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAR_BYTES = [10] + list(range(32, 127))  # newline and printable ASCII: one token each
# Qwen-style chat markup; the quickstart uses raw prompts, chat recipes use this.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen-VL's image markup: an image is <|vision_start|>, one <|image_pad|> per merged patch, <|vision_end|>.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# The chat template with images: a message's content is text, or a list of {"type": "text", "text": ...} and
# {"type": "image"} parts in order, each image rendered as Qwen2.5-VL renders it (one <|image_pad|>, which the
# processor expands to the image's token count).
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5's rendering of tool results: consecutive tool messages share one user turn, each in its own
# <tool_response> block. The tools' schemas are not listed in a system turn (Qwen2.5 does): a tiny model
# learns its one tool from demonstrations, and the prompt stays short.
TOOL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ message['content'] }}{{ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_symbols() -> dict[int, str]:
    """The byte -> printable-character table of byte-level BPE (GPT-2, Llama 3, Qwen2 tokenizers)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


def build_tokenizer(*, tool_chat: bool = False, vision: bool = False):
    """A byte-level BPE tokenizer with no merges: every character of CHAR_BYTES is one token.

    Byte-level BPE is what Qwen2 and Llama 3 ship, so `AutoTokenizer` (which re-creates Qwen2 tokenizers
    from their vocabulary) and SGLang read it the same way. Id 0 is <|endoftext|>: EOS and padding; with
    `tool_chat`, EOS is <|im_end|> and the tool markup tokens follow the characters (see the module docstring);
    with `vision`, the special VISION_TOKENS follow the characters and the chat template renders images.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = byte_symbols()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [symbols[b] for b in CHAR_BYTES])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS + (VISION_TOKENS if vision else []))
    if tool_chat:
        core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=SPECIAL_TOKENS[2] if tool_chat else SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
        additional_special_tokens=SPECIAL_TOKENS[1:] + (VISION_TOKENS if vision else []),
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = TOOL_CHAT_TEMPLATE if tool_chat else VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    return tok


ARCHS = ("qwen2", "llama", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3",
         "gpt_oss", "gemma3")
# Sigmoid-routed in 2 groups of experts, top-1 group: 8 experts make 4 a group, so the group choice and the top-2
# inside it both matter.
GROUPED_ARCHS = ("glm4_moe", "deepseek_v3")
# Vision-language models: a vision tower whose image features replace the prompt's <|image_pad|> tokens.
VLM_ARCHS = ("qwen2_5_vl", "qwen3_vl")


def build_config(arch: str, *, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                 experts: int = 4, topk: int = 2, moe_ffn: int = 32, shared_ffn: int = 48):
    from transformers import (DeepseekV3Config, Glm4MoeConfig, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        torch_dtype="float32",
    )
    match arch:
        case "qwen2":
            return Qwen2Config(tie_word_embeddings=True, use_sliding_window=False, **common)
        case "llama":
            return LlamaConfig(tie_word_embeddings=False, attention_bias=False, mlp_bias=False, **common)
        case "qwen3":
            return Qwen3Config(tie_word_embeddings=True, use_sliding_window=False, head_dim=hidden // heads, **common)
        case "mistral":
            # A window longer than every test sequence: transformers then attends fully causally.
            return MistralConfig(tie_word_embeddings=False, sliding_window=256, **common)
        case "mixtral":
            return MixtralConfig(tie_word_embeddings=False, num_local_experts=experts, num_experts_per_tok=topk,
                                 router_aux_loss_coef=0.02, **common)
        case "qwen2_moe":
            return Qwen2MoeConfig(tie_word_embeddings=False, use_sliding_window=False, num_experts=experts,
                                  num_experts_per_tok=topk, moe_intermediate_size=moe_ffn,
                                  shared_expert_intermediate_size=shared_ffn, norm_topk_prob=False,
                                  decoder_sparse_step=1, router_aux_loss_coef=0.001, **common)
        case "qwen3_moe":
            return Qwen3MoeConfig(tie_word_embeddings=False, use_sliding_window=False, head_dim=hidden // heads,
                                  num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=moe_ffn,
                                  norm_topk_prob=True, decoder_sparse_step=1, router_aux_loss_coef=0.001,
                                  **common)
        case "glm4_moe":
            # layer 0 dense, the others MoE; half of each head's dims rotary; qkv bias and q/k norm as in GLM-4.5
            return Glm4MoeConfig(tie_word_embeddings=False, head_dim=hidden // heads, partial_rotary_factor=0.5,
                                 attention_bias=True, use_qk_norm=True, n_routed_experts=experts,
                                 num_experts_per_tok=topk, moe_intermediate_size=moe_ffn, n_shared_experts=1,
                                 n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                 norm_topk_prob=True, num_nextn_predict_layers=0, **common)
        case "deepseek_v3":
            # multi-latent attention with a query bottleneck and YaRN-scaled interleaved RoPE, as DeepSeek-V3
            return DeepseekV3Config(tie_word_embeddings=False, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=experts,
                                    num_experts_per_tok=topk, moe_intermediate_size=moe_ffn, n_shared_experts=1,
                                    n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                    norm_topk_prob=True, rope_interleave=True, num_nextn_predict_layers=0,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                                    num_key_value_heads=heads,  # every head has its own key and value
                                    **{k: v for k, v in common.items() if k not in ("rope_theta",
                                                                                    "num_key_value_heads")})
        case "gpt_oss":
            from transformers import GptOssConfig

            # A window of 8 tokens on the first of each two layers, shorter than the test sequences; YaRN
            # stretching a 128-token original context 4x (untruncated band, as gpt-oss ships); a SwiGLU clamp
            # small enough that the tiny model's activations reach it. No load-balancing loss: it counts a
            # micro-batch's tokens, which packing regroups, and packed layouts are compared with padded ones.
            rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                        truncate=False, original_max_position_embeddings=128)
            return GptOssConfig(**{k: v for k, v in common.items() if k != "rope_theta"} | dict(
                intermediate_size=moe_ffn, head_dim=hidden // heads, tie_word_embeddings=False,
                num_local_experts=experts, num_experts_per_tok=topk, sliding_window=8,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                rope_parameters=rope, swiglu_limit=0.1, router_aux_loss_coef=0.0, attention_bias=True))
        case "gemma3":
            from transformers import Gemma3TextConfig

            common.pop("rope_theta")
            rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}}
            return Gemma3TextConfig(tie_word_embeddings=True, head_dim=hidden // heads, query_pre_attn_scalar=24,
                                    sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                    + ["sliding_attention"] * (layers % 2), rope_parameters=rope,
                                    final_logit_softcapping=2.0, hidden_activation="gelu_pytorch_tanh", **common)
    raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")


def build_vlm_config(arch: str, *, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                     token_ids: dict[str, int]):
    """The config of a tiny vision-language model (see the module docstring); `token_ids` maps each of
    VISION_TOKENS to its id."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    half = hidden // heads // 2  # rotary frequencies per head, split between time, height and width (mRoPE)
    # The released models' proportions: Qwen2.5-VL [16, 24, 24] and Qwen3-VL [24, 20, 20] of 64 frequencies.
    spatial = half * 3 // 8 if arch == "qwen2_5_vl" else half * 5 // 16
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * spatial, spatial, spatial]}
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0, dtype="float32")
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=hidden)
    ids = dict(image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
               vision_start_token_id=token_ids["<|vision_start|>"], vision_end_token_id=token_ids["<|vision_end|>"])
    if arch == "qwen2_5_vl":
        # Untied, as Qwen2.5-VL-7B; windows of 56 px (2 x 2 merged patches) in block 0, the whole image in block 1.
        return Qwen2_5_VLConfig(
            text_config=text | dict(rope_parameters=rope, tie_word_embeddings=False, use_sliding_window=False),
            vision_config=vision | dict(patch_size=14, window_size=56, fullatt_block_indexes=[1], hidden_act="silu",
                                        tokens_per_second=2),
            tie_word_embeddings=False, **ids)
    if arch == "qwen3_vl":
        # Tied, as Qwen3-VL-4B; learned positions on an 8 x 8 grid (interpolated to each image's); block 0's
        # merged features added to the output of text layer 0.
        return Qwen3VLConfig(
            text_config=text | dict(rope_parameters=rope | {"mrope_interleaved": True}, head_dim=hidden // heads,
                                    tie_word_embeddings=True),
            vision_config=vision | dict(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0],
                                        hidden_act="gelu_pytorch_tanh"),
            tie_word_embeddings=True, **ids)
    raise ValueError(f"--arch must be one of {', '.join(VLM_ARCHS)} for a vision-language model, got {arch!r}")


def build_image_processor(arch: str):
    """The Qwen2-VL image processor as the released model configures it (Qwen3-VL: 16 px patches, mean and std
    0.5), with pixel bounds that make an image 4 to 16 image tokens (2 x 2 to 4 x 4 merged patches). Saved, it
    loads as transformers' PIL image processor wherever torchvision is not installed."""
    from transformers import Qwen2VLImageProcessorPil

    patch = 14 if arch == "qwen2_5_vl" else 16
    merged = (patch * 2) ** 2  # pixels of one image token
    norm = {} if arch == "qwen2_5_vl" else dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 4 * merged, "longest_edge": 16 * merged}, **norm)


def make_tiny_model(out: str | Path, *, arch: str = "qwen2", seed: int = 0, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 128, experts: int | None = None, topk: int = 2,
                    moe_ffn: int = 32, shared_ffn: int = 48, init_std: float = 0.02, tool_chat: bool = False) -> Path:
    """Create the checkpoint directory `out` and return its path. Same seed, same bytes. `experts`: 8 for the
    group-routed architectures, else 4, unless given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    experts = experts or (8 if arch in GROUPED_ARCHS else 4)
    out = Path(out)
    vlm = arch in VLM_ARCHS
    tok = build_tokenizer(tool_chat=tool_chat, vision=vlm)
    # Round the vocabulary up to a multiple of 64 so it divides any tensor-parallel size up to 64.
    vocab_size = -(-len(tok) // 64) * 64
    if vlm:
        token_ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(VISION_TOKENS)))
        config = build_vlm_config(arch, vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads,
                                  kv_heads=kv_heads, ffn=ffn, token_ids=token_ids)
    else:
        config = build_config(arch, vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads,
                              kv_heads=kv_heads, ffn=ffn, experts=experts, topk=topk, moe_ffn=moe_ffn,
                              shared_ffn=shared_ffn)
    config.initializer_range = init_std
    if vlm:  # each part of a vision-language model initialises from its own config
        config.text_config.initializer_range = config.vision_config.initializer_range = init_std
    if arch == "deepseek_v3":
        # keys DeepSeek-V3's own config.json has and SGLang's model reads, which transformers' config class drops
        config.moe_layer_freq, config.topk_method, config.scoring_func = 1, "noaux_tc", "sigmoid"
    if tool_chat:
        config.eos_token_id = tok.eos_token_id  # generation ends with the assistant turn
    torch.manual_seed(seed)
    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF initialises biases to zero, norms to one and the Qwen MoE routers to zero (every token would
            # go to the same experts); random ones make each of those paths observable in parity tests.
            # qwen2 and llama keep their original bytes (only qwen2's qkv bias is drawn), so seeds stay stable.
            if name.endswith("bias"):
                param.normal_(0.0, init_std)
            elif arch not in ("qwen2", "llama") and name.endswith(("norm.weight", "norm1.weight", "norm2.weight",
                                                                   "ln_q.weight")):  # the last three: vision towers
                param.normal_(1.0, 0.1)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param.normal_(0.0, 0.1)
            elif name.endswith("self_attn.sinks"):  # gpt-oss: sinks that take a visible share of attention
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the load-balancing bias that picks experts
                buffer.normal_(0.0, 0.05)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if vlm:
        build_image_processor(arch).save_pretrained(out)
    (out / "megarl_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}) + "\n")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", default="qwen2", choices=ARCHS + VLM_ARCHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=128, help="dense MLP width (mixtral: each expert's width)")
    parser.add_argument("--experts", type=int, default=None,
                        help="MoE: routed experts per layer (default 8 for glm4_moe and deepseek_v3, else 4)")
    parser.add_argument("--topk", type=int, default=2, help="MoE: experts per token")
    parser.add_argument("--moe-ffn", type=int, default=32,
                        help="qwen2_moe/qwen3_moe/glm4_moe/deepseek_v3/gpt_oss: each expert's width")
    parser.add_argument("--shared-ffn", type=int, default=48, help="qwen2_moe: shared expert width")
    parser.add_argument("--tool-chat", action="store_true",
                        help="a chat model for tool use: Qwen2.5 tool markup and template, EOS <|im_end|>")
    args = parser.parse_args(argv)
    out = make_tiny_model(args.out, arch=args.arch, seed=args.seed, hidden=args.hidden, layers=args.layers,
                          heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn, experts=args.experts,
                          topk=args.topk, moe_ffn=args.moe_ffn, shared_ffn=args.shared_ffn,
                          tool_chat=args.tool_chat)
    print(f"wrote {args.arch} tiny model to {out}")


if __name__ == "__main__":
    main()
