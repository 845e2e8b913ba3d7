"""Write a tiny HuggingFace causal-LM checkpoint, built entirely on this machine.

    python tools/make_tiny_model.py --out DIR [--arch qwen2|llama] [--seed N]
                                    [--hidden 64 --layers 2 --heads 4 --kv-heads 2 --ffn 128]

The directory holds config.json, model.safetensors, generation_config.json and tokenizer files that
`transformers.AutoModelForCausalLM` and `AutoTokenizer` load with no network access. The tokenizer is
byte-level BPE without merges (every printable ASCII character is one token) plus three special tokens,
which keeps arithmetic prompts short and the vocabulary small enough for CPU tests.

qwen2 models have a bias on q/k/v and tied embeddings; llama models have no bias and an untied output
layer, so the two between them cover every weight layout the loaders must handle.
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


def byte_symbols() -> dict[int, str]:
    """The byte -> printable-character table of byte-level BPE (GPT-2, Llama 3, Qwen2 tokenizers)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges: every character of CHAR_BYTES is one token.

    Byte-level BPE is what Qwen2 and Llama 3 ship, so `AutoTokenizer` (which re-creates Qwen2 tokenizers
    from their vocabulary) and SGLang read it the same way. Id 0 is <|endoftext|>: EOS and padding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = byte_symbols()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [symbols[b] for b in CHAR_BYTES])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_config(arch: str, *, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int):
    from transformers import LlamaConfig, Qwen2Config

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
    raise ValueError(f"--arch must be qwen2 or llama, got {arch!r}")


def make_tiny_model(out: str | Path, *, arch: str = "qwen2", seed: int = 0, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, ffn: int = 128, init_std: float = 0.02) -> Path:
    """Create the checkpoint directory `out` and return its path. Same seed, same bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    tok = build_tokenizer()
    # Round the vocabulary up to a multiple of 64 so it divides any tensor-parallel size up to 64.
    vocab_size = -(-len(tok) // 64) * 64
    config = build_config(arch, vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads,
                          kv_heads=kv_heads, ffn=ffn)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":
        # HF initialises biases to zero; random ones make the qkv-bias path observable in parity tests.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, init_std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "megarl_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}) + "\n")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=128)
    args = parser.parse_args(argv)
    out = make_tiny_model(args.out, arch=args.arch, seed=args.seed, hidden=args.hidden, layers=args.layers,
                          heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn)
    print(f"wrote {args.arch} tiny model to {out}")


if __name__ == "__main__":
    main()
