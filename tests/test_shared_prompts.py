"""Prompts held once per group (train.share_prompts): a group's prompt once in a packed row, then each sample's
own tokens at the positions that follow it, attending to the prompt and to themselves only. Every output and
gradient must be the one of each sample run alone.

Tolerance 1e-6 (fp32): a shared row runs each sample's attention over the same keys as the sample alone, with
the same masked softmax, but in a longer row and other matmul shapes, so sums may run in another order:
observed differences are 0 to ~5e-7 on logprobs of magnitude ~5.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import typing
import warnings
import zipfile
from functools import partial
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import REPO, SUBPROCESS_TIMEOUT_S, needs_cuda
from test_multi_turn import tool_chat_dir  # noqa: F401 - the fixture

from megarl.packing import PromptGroups, pack_shared, prompt_units, shared_row, unit_tokens, unpack_shared

pytestmark = pytest.mark.timeout(180)

TOL = 1e-6
N_TOKENS = 98  # real tokens of the tiny tokenizer


def grouped_batch(seed: int = 5):
    """[B, T] tokens of three groups (prompts of 5, 3 and 6 tokens; 4, 3 and 1 samples) with ragged responses
    (one empty), response masks, advantages of both signs, prompt groups and sample lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [(5, [6, 1, 9, 4]), (3, [7, 2, 5]), (6, [8])]
    rows, group_ids, prompt_lens, lengths = [], [], [], []
    for g, (p, responses) in enumerate(prompts):
        prompt = torch.randint(3, N_TOKENS, (p,), generator=gen)
        for r in responses:
            rows.append(torch.cat([prompt, torch.randint(3, N_TOKENS, (r,), generator=gen)]))
            group_ids.append(g), prompt_lens.append(p), lengths.append(p + r)
    width = max(lengths) + 2
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    cols = torch.arange(width)[None]
    lengths, prompt_lens = torch.tensor(lengths), torch.tensor(prompt_lens)
    mask = ((cols >= prompt_lens[:, None]) & (cols < lengths[:, None])).float()
    advantages = torch.linspace(-1.0, 1.0, len(rows))[:, None] * mask
    return tokens, mask, advantages, PromptGroups(torch.tensor(group_ids), prompt_lens), lengths


# ---- the layout -------------------------------------------------------------------------------------------------
def test_units_hold_a_groups_equal_prompts_and_fit_the_budget():
    tokens, _, _, groups, lengths = grouped_batch()
    units = prompt_units(tokens, lengths, groups, max_tokens=64)
    assert units == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert [unit_tokens(u, lengths, groups.prompt_lens) for u in units] == [5 + 20, 3 + 14, 14]
    # a budget of 15: 5 + 6 + 1 fits, + 9 does not; 5 + 9, + 4 does not; 3 + 7 + 2 fits, + 5 does not
    assert prompt_units(tokens, lengths, groups, max_tokens=15) == [[0, 1], [2], [3], [4, 5], [6], [7]]
    # a sample whose prompt differs from its group's shares nothing
    tokens[1, 0] += 1
    assert prompt_units(tokens, lengths, groups, max_tokens=64)[:2] == [[0, 2, 3], [1]]


def test_shared_row_mask_and_outputs_by_hand():
    from megarl.engine.local_attention import block_causal_mask

    # one group: prompt of 2, responses of 2 and 1 tokens; a sequence alone of 2 tokens; padding to 9
    lengths, prompt_lens = torch.tensor([4, 3, 2]), torch.tensor([2, 2, 1])
    row = shared_row([[0, 1], [2]], lengths, prompt_lens, row_len=9)
    assert row.cu_seqlens.tolist() == [0, 2, 4, 5, 7, 9]
    assert row.shared.prefix_of.tolist() == [-1, 0, 0, -1, -1]
    allowed = (~block_causal_mask(row.cu_seqlens, 9, device="cpu", prefix_of=row.shared.prefix_of)[0, 0]).int()
    assert allowed[:5, :5].tolist() == [[1, 0, 0, 0, 0],
                                        [1, 1, 0, 0, 0],
                                        [1, 1, 1, 0, 0],   # response 1 sees the prompt and itself
                                        [1, 1, 1, 1, 0],
                                        [1, 1, 0, 0, 1]]   # response 2 sees the prompt, not response 1
    assert allowed[5:7, :7].tolist() == [[0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1, 1]]
    # predictions: row positions 0..8, then each sequence's first own token from the prompt's end (10 + k)
    predictions = torch.arange(12.0) + 10
    out = unpack_shared(predictions, row, width=5)
    assert out.tolist() == [[0, 10, 19, 12, 0],    # token 2 (first own) from slot 9 + 0, token 3 from position 2
                            [0, 10, 20, 0, 0],     # first own token from slot 9 + 1
                            [0, 15, 0, 0, 0]]      # alone: token 1 from its position 5


# ---- Transformer Engine's packed attention, as TE 2.11 defines it ------------------------------------------------
# TE installs only beside CUDA, but the mask builders of its unfused backend are pure Python, in the
# framework-agnostic wheel that carries the PyTorch module's Python source.
TE_WHEEL = "transformer_engine-2.11.0-py3-none-any.whl"
TE_WHEEL_SHA256 = "7ee1eae8fa6b0cb471c6066aa3555304fda8537174e5019929dc0c8655071df3"
TE_MASKS_PY = "transformer_engine/pytorch/attention/dot_product_attention/utils.py"


@pytest.fixture(scope="session")
def te_masks():
    """Transformer Engine 2.11's own `get_padding_mask`, `get_full_mask` and `check_set_window_size`, on the
    CPU. Its wheel is fetched once with pip into the user's cache (~/.cache/megarl, or under XDG_CACHE_HOME),
    checked against its sha256, and the three functions are taken from the file by name, their device "cuda"
    read as "cpu"; nothing else of TE runs. Without the package index this fails: the check needs TE's code."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megarl" / "transformer_engine"
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / TE_WHEEL
    sha256 = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()  # noqa: E731
    with open(cache / "download.lock", "w") as lock:  # another test process or run may be fetching it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not wheel.exists() or sha256(wheel) != TE_WHEEL_SHA256:
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                                      "--dest", tmp, "transformer_engine==2.11.0"],
                                     capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)
                got = Path(tmp) / TE_WHEEL
                if pip.returncode != 0 or not got.exists():
                    pytest.fail(f"could not download {TE_WHEEL} with pip into {cache} (the test checks megarl's "
                                f"shared rows against Transformer Engine's own mask code):\n{pip.stderr[-3000:]}")
                if sha256(got) != TE_WHEEL_SHA256:
                    pytest.fail(f"{TE_WHEEL} from the package index has sha256 {sha256(got)}, not the pinned "
                                f"{TE_WHEEL_SHA256}")
                os.replace(got, wheel)
    with zipfile.ZipFile(wheel) as archive:
        tree = ast.parse(archive.read(TE_MASKS_PY))
    names = {"get_padding_mask", "get_full_mask", "check_set_window_size"}
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {f.name for f in functions} == names, f"{TE_MASKS_PY} of {TE_WHEEL} lacks one of {names}"

    class OnCpu(ast.NodeTransformer):
        def visit_Constant(self, node):
            return ast.copy_location(ast.Constant("cpu"), node) if node.value == "cuda" else node

    code = compile(ast.fix_missing_locations(OnCpu().visit(ast.Module(body=functions, type_ignores=[]))),
                   f"{wheel}/{TE_MASKS_PY}", "exec")
    scope = {"torch": torch, "Tuple": typing.Tuple, "Union": typing.Union, "warnings": warnings}  # what they use
    exec(code, scope)  # noqa: S102 - TE's published code, pinned by hash
    return SimpleNamespace(**{name: scope[name] for name in names})


def te_attention_on_a_stand_in(monkeypatch):
    """megarl.engine.te_attention's SharedPromptTEAttention, over a stand-in of TE's DotProductAttention (and
    Megatron's TEDotProductAttention) that records each call it gets: what megarl hands TE's forward, and the
    attention type TE's unfused backend has during the call. Megatron builds the layer as self-attention."""

    class RecordingDotProductAttention(torch.nn.Module):
        attention_type = "self"

        def __init__(self):
            super().__init__()
            self.unfused_attention = SimpleNamespace(attention_type="self")
            self.config = SimpleNamespace(qk_clip=False, log_max_attention_logit=False)
            self.num_splits = None
            self.calls = []

        def forward(self, query, key, value, attention_mask, **kwargs):
            self.calls.append(dict(kwargs, query=query, key=key, value=value, attention_mask=attention_mask,
                                   unfused_attention_type=self.unfused_attention.attention_type))
            return query.flatten(1)

    te, extension = ModuleType("transformer_engine.pytorch"), ModuleType("megatron.core.extensions.transformer_engine")
    te.DotProductAttention = extension.TEDotProductAttention = RecordingDotProductAttention
    monkeypatch.setitem(sys.modules, "transformer_engine", ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine", extension)
    spec = importlib.util.spec_from_file_location("te_attention_on_a_stand_in", REPO / "megarl/engine/te_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SharedPromptTEAttention()


def te_unfused_attention(q, k, v, call: dict, te_masks, *, attention_type: str):
    """TE 2.11's UnfusedDotProductAttention on a "thd" `call` (the arguments of TE's forward): each segment a
    padded row of max_seqlen_q queries and max_seqlen_kv keys, under the mask TE's own `get_padding_mask` and
    `get_full_mask` build for `attention_type` (True: masked); scores filled with -10000 there before the
    softmax and probabilities with 0 after, as that backend does. q [t, heads, d], k and v [t_kv, groups, d]
    -> [t, heads, d]."""
    cu_q, cu_kv, mask_type = call["cu_seqlens_q"], call["cu_seqlens_kv"], call["attn_mask_type"]
    sq, skv, batch = call["max_seqlen_q"], call["max_seqlen_kv"], len(cu_q) - 1
    padding = te_masks.get_padding_mask(batch, cu_q, cu_kv, sq, skv, attention_type)
    _, masked, _, _ = te_masks.get_full_mask(sq, skv, attn_mask_type=mask_type, attention_mask=padding,
                                             window_size=te_masks.check_set_window_size(mask_type, None),
                                             attention_type=attention_type)  # [segments, 1, sq, skv]

    def rows(x, cu, s):  # [t, h, d] -> [segments, h, s, d] (zero past a segment's end), and the valid [segments, s]
        cols = torch.arange(s)
        valid = cols[None, :] < (cu[1:] - cu[:-1]).long()[:, None]
        index = (cu[:-1].long()[:, None] + cols).clamp(max=len(x) - 1)
        return (x[index] * valid[..., None, None]).transpose(1, 2), valid

    (qs, valid), (ks, _), (vs, _) = rows(q, cu_q, sq), rows(k, cu_kv, skv), rows(v, cu_kv, skv)
    ks, vs = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (ks, vs))
    scores = (qs @ ks.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(masked, -10000.0)
    out = torch.softmax(scores, dim=-1).masked_fill(masked, 0.0) @ vs  # [segments, heads, sq, d]
    return out.transpose(1, 2)[valid]


def bottom_right_causal_thd(q, k, v, cu_q, cu_kv):
    """flash-attn's `flash_attn_varlen_func(..., causal=True)` as it defines it (>= 2.1): segment s's queries
    q[cu_q[s]:cu_q[s+1]] against its keys k[cu_kv[s]:cu_kv[s+1]], the causal mask aligned to the bottom right
    (query i masked from key j when j > i + keys - queries). q [t, heads, d], k and v [t_kv, groups, d]."""
    out = []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]], k[cu_kv[s]:cu_kv[s + 1]], v[cu_kv[s]:cu_kv[s + 1]]
        nq, nk = len(qs), len(ks)
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=allowed,
            enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("budget", [64, 20])
def test_transformer_engine_keys_give_each_sample_its_prompt_and_own_earlier_tokens(budget, te_masks, monkeypatch):
    """What megarl.engine.te_attention hands Transformer Engine for a shared row (keys and values gathered
    segment by segment), run as each backend TE 2.11 can pick for it computes it, is the row's attention
    under its shared-prompt block mask: outputs and the gradients of query, key and value within 1e-6 (fp32;
    the same scores, summed in another order). The row: three groups with padding (budget 64, one row), or
    the first group cut over units (budget 20).

    - flash-attn 2 or 3 (fp16/bf16): both cu_seqlens, causal aligned bottom-right per segment;
    - cuDNN fused attention (fp16/bf16): both cu_seqlens and `padding_causal_bottom_right`, which TE defines
      by the mask its own `get_full_mask` builds from both (cross-attention padding masks), the reference TE's
      tests hold that backend to;
    - the unfused backend (fp32, or where neither applies): TE's own masks for the attention type the
      backend has during megarl's call. Under Megatron's "self" (the type before the fix) an own token sees
      the prompt's first tokens instead: that fails, and so does a row whose keys are out of order."""
    from megarl.engine.local_attention import SharedPromptParams, block_causal_mask
    from megarl.packing import shared_keys

    attention = te_attention_on_a_stand_in(monkeypatch)
    tokens, _, _, groups, lengths = grouped_batch()
    units = prompt_units(tokens, lengths, groups, max_tokens=budget)
    rows = [units] if budget == 64 else [units[:2], units[2:]]
    gen = torch.Generator().manual_seed(3)
    for row_units in rows:
        row = shared_row(row_units, lengths, groups.prompt_lens,
                         row_len=sum(unit_tokens(u, lengths, groups.prompt_lens) for u in row_units) + 3)
        t = row.row_len
        params = SharedPromptParams(qkv_format="thd", cu_seqlens_q=row.cu_seqlens, cu_seqlens_kv=row.cu_seqlens,
                                    max_seqlen_q=row.max_seqlen, max_seqlen_kv=row.max_seqlen,
                                    prefix_of=row.shared.prefix_of,
                                    keys=shared_keys(row.cu_seqlens, row.shared.prefix_of))
        q = torch.randn(t, 4, 8, generator=gen, requires_grad=True)
        k, v = (torch.randn(t, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
        attention(q, k, v, None, None, packed_seq_params=params)
        call = attention.calls[-1]
        assert attention.unfused_attention.attention_type == "self"  # set back after the call
        # TE's forward asserts these for "thd"; no padded cu_seqlens (no padding between sequences), no
        # num_splits, and no top-left causal mask, which would rule out flash-attn where keys outnumber queries
        cu_q, cu_kv = call["cu_seqlens_q"], call["cu_seqlens_kv"]
        assert call["qkv_format"] == "thd" and call["attn_mask_type"] == "padding_causal_bottom_right"
        assert cu_q.dtype == cu_kv.dtype == torch.int32 and cu_q.shape == cu_kv.shape
        assert call["query"] is q and call["attention_mask"] is None
        assert not {"cu_seqlens_q_padded", "cu_seqlens_kv_padded", "num_splits"} & call.keys()
        # cuDNN's bottom-right "thd" needs max_seqlen_q <= max_seqlen_kv; TE's unfused "self" masks need them equal
        assert call["max_seqlen_q"] == call["max_seqlen_kv"] == int(cu_kv.diff().max())
        key, value = call["key"], call["value"]
        allowed = ~block_causal_mask(row.cu_seqlens, t, device="cpu", prefix_of=row.shared.prefix_of)[0]
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, enable_gqa=True
        ).transpose(0, 1)
        backends = {
            "flash-attn": bottom_right_causal_thd(q, key, value, cu_q.tolist(), cu_kv.tolist()),
            "cuDNN fused": te_unfused_attention(q, key, value, call, te_masks, attention_type="cross"),
            "unfused": te_unfused_attention(q, key, value, call, te_masks,
                                            attention_type=call["unfused_attention_type"]),
        }
        weights = torch.randn(want.shape, generator=gen)
        want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
        for backend, got in backends.items():
            assert (got - want).abs().max() <= TOL, backend
            # (the outputs share the gather of megarl's keys: its graph is kept for the next)
            for g, w in zip(torch.autograd.grad((got * weights).sum(), (q, k, v), retain_graph=True), want_grads):
                assert (g - w).abs().max() <= TOL, backend
        as_self = te_unfused_attention(q, key, value, call, te_masks, attention_type="self")
        assert (as_self - want).abs().max() > 1e-2
        # a prompt's keys gathered after a sample's own would be a different attention: the check can fail
        keys = params.keys
        swapped = torch.cat([torch.cat([keys.index[a:b][-(b - a) // 2:], keys.index[a:b][:-(b - a) // 2]])
                             for a, b in zip(keys.cu_seqlens[:-1].tolist(), keys.cu_seqlens[1:].tolist())])
        wrong = te_unfused_attention(q, k[swapped], v[swapped], call, te_masks, attention_type="cross")
        assert (wrong - want).abs().max() > 1e-2


# ---- the engine -----------------------------------------------------------------------------------------------------
def make_engine(model_dir, groups, *, train: bool, value_head: bool = False, dtype: str = "float32",
                megatron: dict | None = None):
    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    optim = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0, distributed=True) if train else None
    return TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype=dtype, megatron=megatron or {}, groups=groups, optim=optim,
                       value_head=value_head)


def valid(lengths, width):
    return torch.arange(width)[None] < lengths[:, None]


def test_shared_logprobs_equal_each_sample_alone(qwen2_dir, groups):
    import megarl.engine.local_attention as local_attention

    engine = make_engine(qwen2_dir, groups, train=False)
    tokens, _, _, prompt_groups, lengths = grouped_batch()
    ok = valid(lengths, tokens.shape[1])
    padded = engine.logprobs(tokens, temperature=0.7, micro_batch_size=8)
    for budget in (64, 20):  # all in one row; several rows, the first group cut in two
        shared = engine.logprobs(tokens, temperature=0.7, micro_batch_size=8, lengths=lengths,
                                 micro_batch_tokens=budget, prompt_groups=prompt_groups)
        assert (shared - padded)[ok].abs().max() <= TOL, budget
        assert torch.equal(shared[~ok], torch.zeros(int((~ok).sum())))
    # the same through one t x t block mask over the row, the attention the split into prompt and response
    # batches (`shared_rows`) stands for
    split = local_attention.shared_rows
    try:
        local_attention.shared_rows = lambda *args: None
        masked = engine.logprobs(tokens, temperature=0.7, micro_batch_size=8, lengths=lengths,
                                 micro_batch_tokens=64, prompt_groups=prompt_groups)
    finally:
        local_attention.shared_rows = split
    assert (masked - padded)[ok].abs().max() <= TOL


class TorchCalls(TorchFunctionMode):
    """The names of the torch functions and tensor methods called inside it (`.item()`, `.tolist()`, `bool()`
    and `int()` of a tensor among them: each a host sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


HOST_SYNCS = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__"}


def test_shared_rows_are_rotated_in_one_op_with_megatrons_numbers(qwen2_dir, groups, monkeypatch):
    """A shared row's queries and keys are rotated at their position ids in one op over the row
    (local_attention.rotate_shared_row, fed by rope_at_position_ids): bit for bit what Megatron's packed RoPE
    computes from the same frequencies per token, which reads each segment's start on the host (an `.item()`
    per segment, for queries and for keys, in every layer). The op makes no host sync and as many calls for
    a row of 11 segments as for one of 5; the engine's shared rows never reach Megatron's packed RoPE, and its
    logprobs with it put back are the same, bit for bit."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.engine import local_attention

    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # context parallelism, which sharing refuses
    per_segment = rope_utils._apply_rotary_pos_emb_thd

    def megatron_rope(query, key, params, config):  # what Megatron's attention did with a shared row
        return tuple(per_segment(t, params.cu_seqlens_q, params.freqs, rotary_interleaved=config.rotary_interleaved,
                                 multi_latent_attention=config.multi_latent_attention, cp_group=one_rank)
                     for t in (query, key))

    tokens, _, _, prompt_groups, lengths = grouped_batch()
    units = prompt_units(tokens, lengths, prompt_groups, max_tokens=64)
    config = SimpleNamespace(rotary_interleaved=False, multi_latent_attention=False)
    gen = torch.Generator().manual_seed(4)
    counts = {}
    for row_units in (units, units[1:2]):  # 11 segments; 5
        row = shared_row(row_units, lengths, prompt_groups.prompt_lens,
                         row_len=sum(unit_tokens(u, lengths, prompt_groups.prompt_lens) for u in row_units) + 3)
        _, positions = pack_shared(tokens, row)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
        table = torch.outer(torch.arange(float(row.max_seqlen)), inv_freq).repeat(1, 2)[:, None, None]  # [max, 1, 1, 8]
        params = local_attention.SharedPromptParams(qkv_format="thd", cu_seqlens_q=row.cu_seqlens,
                                                    freqs=table[positions[0]])
        query, key = torch.randn(row.row_len, 4, 8, generator=gen), torch.randn(row.row_len, 2, 8, generator=gen)
        with TorchCalls() as ours:
            rotated = local_attention.rotate_shared_row(query, key, params, config)
        with TorchCalls() as megatrons:
            before = megatron_rope(query, key, params, config)
        assert all(torch.equal(a, b) for a, b in zip(rotated, before))
        segments = len(row.cu_seqlens) - 1
        assert not HOST_SYNCS & set(ours.names) and megatrons.names.count("item") == 2 * segments
        counts[segments] = len(ours.names)
    assert list(counts) == [11, 5] and counts[11] == counts[5]

    engine = make_engine(qwen2_dir, groups, train=False)
    shared = dict(micro_batch_size=8, micro_batch_tokens=20, lengths=lengths, prompt_groups=prompt_groups)

    def refuse(*args, **kwargs):
        raise AssertionError("a shared row reached Megatron's per-segment RoPE")

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", refuse)
    one_op = engine.logprobs(tokens, temperature=0.7, **shared)
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", per_segment)
    monkeypatch.setattr(local_attention, "rotate_shared_row", megatron_rope)
    assert torch.equal(engine.logprobs(tokens, temperature=0.7, **shared), one_op)


def pass_outputs(engine, tokens, extras, loss_fn, **micro):
    """One forward and backward of `loss_fn` (no update): (outputs [B, T] the loss saw, its statistics, the
    gradient of every parameter by name); the gradients are cleared after."""
    out, stats = engine.schedule.run(tokens, extras, loss_fn, temperature=1.0, forward_only=False,
                                     entropy=not engine.value_head, keep_outputs=True, **micro)
    grads = {name: p.main_grad.detach().clone() for name, p in engine.stage.named_parameters()}
    for model in engine.models:
        model.zero_grad_buffer()
    return out, stats, grads


def recording(loss_fn, seen: dict):
    """A loss function that also keeps the entropy it saw, by row id."""
    def wrapped(logprobs, mb, **kwargs):
        for k, row in enumerate(mb["row_id"][:, 0].long().tolist()):
            seen[row] = kwargs["entropy"][k].detach().clone()
        return loss_fn(logprobs, mb, **kwargs)
    return wrapped


LAYOUTS = {"padded": dict(micro_batch_size=3),
           "packed": dict(micro_batch_size=8, micro_batch_tokens=40),
           "shared in one row": dict(micro_batch_size=8, micro_batch_tokens=64, share=True),
           "shared over rows": dict(micro_batch_size=8, micro_batch_tokens=20, share=True)}


def layout_kwargs(name, lengths, prompt_groups):
    micro = dict(LAYOUTS[name])
    share = micro.pop("share", False)
    if "micro_batch_tokens" in micro:
        micro["lengths"] = lengths
    return micro | ({"prompt_groups": prompt_groups} if share else {})


@pytest.mark.parametrize("algo", [dict(name="grpo", kl_coef=0.1, entropy_coef=0.05),
                                  dict(name="dr_grpo", loss_agg="seq-mean-token-sum-norm"),
                                  dict(name="gspo", clip_low=3e-4, clip_high=4e-4)])
def test_shared_loss_entropy_and_gradients_equal_unshared(qwen2_dir, groups, algo):
    """GRPO (with KL and entropy terms), Dr. GRPO (a constant divisor) and GSPO (sequence-level ratios): the
    loss, its statistics, the entropy per token and every parameter's gradient, padded, packed and shared."""
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    engine = make_engine(qwen2_dir, groups, train=True)
    tokens, mask, advantages, prompt_groups, lengths = grouped_batch()
    ok = valid(lengths, tokens.shape[1])
    base = engine.logprobs(tokens, temperature=1.0, micro_batch_size=8)
    gen = torch.Generator().manual_seed(7)
    old, ref = (base + 0.3 * torch.randn(tokens.shape, generator=gen) for _ in range(2))
    extras = {"response_mask": mask, "old_logprobs": old * mask, "ref_logprobs": ref * mask,
              "advantages": advantages, "row_id": torch.arange(float(len(tokens)))[:, None].expand_as(mask)}
    norm = global_loss_norm(mask)
    loss_fn = partial(policy_objective(AlgoConfig(**algo)), norm=norm.__class__(**{**vars(norm), "max_len": 16}))
    runs = policy_passes(engine, tokens, extras, loss_fn,
                         {name: layout_kwargs(name, lengths, prompt_groups) for name in LAYOUTS})
    assert runs["padded"][1]["clipfrac"] > 0  # the clip is exercised
    assert_same_passes(runs, ok)


@pytest.mark.gpu
@needs_cuda
def test_gpu_transformer_engine_attention_trains_shared_rows_as_each_sample_alone(qwen2_dir, groups):
    """On Transformer Engine's layers (megarl's GPU image), shared rows go through TE's packed attention with
    bottom-right causal masks (megarl.engine.te_attention), RoPE unfused. In fp32, which of TE's backends only
    the unfused one takes (every call runs there; the shared rows' with its cross-attention masks, the fix of
    megarl.engine.te_attention; the same math as the padded layout's in another order): GRPO's outputs,
    entropy, statistics and gradients within 1e-5, padded, packed and shared (1e-6 on CPU; TF32 is off in both,
    and a GPU's kernels split sums differently). In bf16 (flash or cuDNN attention, what runs train on): the
    shared layout's logprobs differ from the padded layout's by no more than twice what the plain packed
    layout's do, plus 1e-3: a layout change's rounding."""
    pytest.importorskip("transformer_engine")
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.engine.model import uses_transformer_engine
    from megarl.engine.te_attention import SharedPromptTEAttention
    from megarl.objective import policy_objective

    assert uses_transformer_engine()
    tokens, mask, advantages, prompt_groups, lengths = grouped_batch()
    ok = valid(lengths, tokens.shape[1])
    engine = make_engine(qwen2_dir, groups, train=True, megatron={"apply_rope_fusion": False})
    layers = [m for m in engine.stage.modules() if isinstance(m, SharedPromptTEAttention)]
    assert layers
    backends = []  # per TE attention call: the backend that ran it, and the unfused backend's attention type
    for layer in layers:
        for name in ("flash_attention", "fused_attention", "unfused_attention"):
            getattr(layer, name).register_forward_pre_hook(
                lambda _module, _args, name=name, layer=layer: backends.append(
                    (name, layer.unfused_attention.attention_type)))
    extras = {"response_mask": mask, "advantages": advantages,
              "row_id": torch.arange(float(len(tokens)))[:, None].expand_as(mask)}
    loss_fn = partial(policy_objective(AlgoConfig(name="grpo", entropy_coef=0.05), on_policy=True),
                      norm=global_loss_norm(mask))
    runs = policy_passes(engine, tokens, extras, loss_fn,
                         {name: layout_kwargs(name, lengths, prompt_groups) for name in LAYOUTS})
    assert {name for name, _ in backends} == {"unfused_attention"} and ("unfused_attention", "cross") in backends
    out_p, stats_p, grads_p, entropy_p = runs["padded"]
    for name, (out, stats, grads, entropy) in runs.items():
        assert (out - out_p)[ok].abs().max() <= 1e-5 and (entropy - entropy_p)[ok].abs().max() <= 1e-5, name
        for key, want in stats_p.items():
            assert float(stats[key]) == pytest.approx(float(want), abs=1e-5), (name, key)
        for param, want in grads_p.items():
            assert (grads[param] - want).abs().max() <= 1e-5, (name, param)
    bf16 = make_engine(qwen2_dir, groups, train=False, dtype="bfloat16", megatron={"apply_rope_fusion": False})
    logprobs = {name: bf16.logprobs(tokens, temperature=1.0, **layout_kwargs(name, lengths, prompt_groups))
                for name in LAYOUTS}
    packed = (logprobs["packed"] - logprobs["padded"])[ok].abs().max()
    for name in ("shared in one row", "shared over rows"):
        assert (logprobs[name] - logprobs["padded"])[ok].abs().max() <= 2 * packed + 1e-3, name
    with pytest.raises(ValueError, match="model.megatron.apply_rope_fusion: false"):
        fused = make_engine(qwen2_dir, groups, train=False, dtype="bfloat16", megatron={"apply_rope_fusion": True})
        fused.logprobs(tokens, temperature=1.0, **layout_kwargs("shared in one row", lengths, prompt_groups))


def policy_passes(engine, tokens, extras, loss_fn, layouts: dict[str, dict]) -> dict[str, tuple]:
    """Per layout name: (outputs, statistics, gradients, entropy [B, T]) of one pass of `loss_fn`."""
    runs = {}
    for name, micro in layouts.items():
        seen = {}
        out, stats, grads = pass_outputs(engine, tokens, extras, recording(loss_fn, seen), **micro)
        runs[name] = out, stats, grads, torch.stack([seen[r] for r in range(len(tokens))])
    return runs


def assert_same_passes(runs: dict[str, tuple], ok) -> None:
    """Every layout's outputs and entropy on the real tokens `ok`, statistics and gradients are the padded
    layout's (TOL), and the gradients are not all ~0."""
    out_p, stats_p, grads_p, entropy_p = runs["padded"]
    for name, (out, stats, grads, entropy) in runs.items():
        assert (out - out_p)[ok].abs().max() <= TOL, name
        assert (entropy - entropy_p)[ok].abs().max() <= TOL, name
        for key, want in stats_p.items():
            assert float(stats[key]) == pytest.approx(float(want), abs=TOL), (name, key)
        for param, want in grads_p.items():
            assert (grads[param] - want).abs().max() <= TOL, (name, param)
    assert max(g.abs().max() for g in grads_p.values()) > 1e-2


def test_shared_critic_values_and_gradients_equal_unshared(qwen2_dir, groups):
    """A critic's values per token (the prompt's last position gives every sample's first response value) and
    the value loss's gradients."""
    from megarl.algo.aggregate import global_loss_norm
    from megarl.objective import CriticObjective

    critic = make_engine(qwen2_dir, groups, train=True, value_head=True)
    # a nonzero head, so values differ between positions; small, so values are O(1) like the logprobs and fp32
    # order noise is ~1e-7 of them
    critic.module.output_layer.weight.data.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    tokens, mask, advantages, prompt_groups, lengths = grouped_batch()
    ok = valid(lengths, tokens.shape[1])
    padded = critic.values(tokens, micro_batch_size=8)
    shared = critic.values(tokens, micro_batch_size=8, lengths=lengths, micro_batch_tokens=20,
                           prompt_groups=prompt_groups)
    assert padded[ok].abs().max() > 0.1 and (shared - padded)[ok].abs().max() <= TOL
    extras = {"response_mask": mask, "values": padded * mask, "returns": advantages}
    loss_fn = partial(CriticObjective(value_clip=0.5), norm=global_loss_norm(mask))
    _, stats_p, grads_p = pass_outputs(critic, tokens, extras, loss_fn, micro_batch_size=8)
    _, stats_s, grads_s = pass_outputs(critic, tokens, extras, loss_fn,
                                       **layout_kwargs("shared over rows", lengths, prompt_groups))
    assert float(stats_s["critic/loss"]) == pytest.approx(float(stats_p["critic/loss"]), abs=TOL)
    assert max(g.abs().max() for g in grads_p.values()) > 1e-2
    for param, want in grads_p.items():
        assert (grads_s[param] - want).abs().max() <= TOL, param


# ---- the RL loop --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_the_quickstart_with_shared_prompts_computes_what_it_computes_without(quickstart_out, tmp_path):
    """The quickstart's GRPO from its warm start, 10 packed steps with train.share_prompts off and on.

    Sharing changes only the order of fp32 sums in the trainer's passes (logprobs ~1e-7 apart, as above), so
    each update differs by that much, which never flipped a sampled token in 10 steps here: rewards, lengths,
    clip fractions, the held-out reward, every count are the same numbers. What is computed from the trainer's
    float sums may differ by its noise: loss and pg_loss (means of ~1e-3) by 1e-7 absolute (observed 4.5e-9),
    grad_norm by 1e-5 relative (observed 3.8e-7), and rollout/logprob_diff_*, which measure that noise itself
    (trainer vs rollout engine, ~1e-6), the mean by 1e-5 absolute (observed 3.2e-6) and the max, the largest
    single-token difference, by 1e-4 (observed 3.2e-6 on one CPU, 1.6e-5 on another; honest runs' largest
    single token is 1.8e-5, docs/rollouts.md "Weight hand-off and engine faults"). The shared run trains fewer tokens
    (timing/train_s: 0.10 s against 0.21 s a step, measured; not asserted, timings depend on the machine's load).
    """
    import json

    from conftest import REPO, from_warm_start, run_python

    runs = {}
    for share in ("false", "true"):
        run_dir = tmp_path / f"share_{share}"
        proc = run_python(["-m", "megarl", "train", *from_warm_start(quickstart_out, run_dir, steps=10),
                           "train.micro_batch_tokens=1024", f"train.share_prompts={share}"], cwd=REPO, timeout_s=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[share] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    off, on = runs["false"], runs["true"]
    assert len(off) == len(on) == 10
    noisy = {"loss": (0.0, 1e-7), "pg_loss": (0.0, 1e-7), "grad_norm": (1e-5, 0.0),
             "rollout/logprob_diff_mean": (0.0, 1e-5), "rollout/logprob_diff_max": (0.0, 1e-4)}
    for m, n in zip(on, off):
        assert m.keys() == n.keys()
        for key, want in n.items():
            if key.startswith(("timing/", "throughput/")):
                continue
            rel, abs_ = noisy.get(key, (0.0, 0.0))
            assert m[key] == pytest.approx(want, rel=rel, abs=abs_), (m["step"], key)
    assert "eval/reward_mean" in on[-1]


# ---- what is refused ---------------------------------------------------------------------------------------------
def test_share_prompts_is_refused_where_it_cannot_share_or_is_not_exact(tmp_path, monkeypatch, qwen2_dir, groups,
                                                                         arch_dir):
    from megarl.config import RecipeError, load_config
    from megarl.dataclass_yaml import ConfigError
    from megarl.job import Job

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    recipe = tmp_path / "q.yaml"
    recipe.write_text("model:\n  path: model\ndata:\n  train_path: train.jsonl\n")
    on = ["train.share_prompts=true", "train.micro_batch_tokens=512"]
    cases = {"needs sequence packing": ["train.share_prompts=true"],
             "rollout.n_samples = 1 draws one sample per prompt": [*on, "rollout.n_samples=1", "algo.name=reinforce_pp"],
             "cannot be combined with parallel.cp = 2": [*on, "parallel.cp=2"]}
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message) as info:
            load_config(recipe, overrides)
        assert "share_prompts" in str(info.value)
    load_config(recipe, on)  # GRPO, 4 samples a prompt: fine
    # MoE: whatever counts a micro-batch's tokens per expert would count a shared prompt once (the tiny Mixtral's
    # router_aux_loss_coef is 0.02)
    def check_share_prompts(model, megatron: dict) -> None:  # the run megarl.job resolves
        settings = [f"model.megatron.{key}={json.dumps(value)}" for key, value in megatron.items()]
        Job.of(load_config(recipe, [*on, f"model.path={model}", *settings]), world=1, ranks_per_node=1)

    mixtral = arch_dir("mixtral")
    moe_cases = {"load-balancing loss": {}, "router z-loss": {"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 1e-3},
                 "expert capacity": {"moe_aux_loss_coeff": 0.0, "moe_expert_capacity_factor": 1.0},
                 "expert bias": {"moe_aux_loss_coeff": 0.0, "moe_router_enable_expert_bias": True}}
    for message, megatron in moe_cases.items():
        with pytest.raises(RecipeError, match=f"train.share_prompts on a mixture-of-experts model .*{message}"):
            check_share_prompts(mixtral, megatron)
    check_share_prompts(mixtral, {"moe_aux_loss_coeff": 0.0})
    check_share_prompts(mixtral, {"moe_router_load_balancing_type": "none"})
    check_share_prompts(qwen2_dir, {})
    # the engine refuses a shared layout without packing, naming the key
    engine = make_engine(qwen2_dir, groups, train=False)
    tokens, _, _, prompt_groups, lengths = grouped_batch()
    with pytest.raises(ValueError, match=r"needs sequence packing \(set train.micro_batch_tokens\)"):
        engine.logprobs(tokens, temperature=1.0, micro_batch_size=8, prompt_groups=prompt_groups)


def test_plan_counts_each_prompt_once_with_shared_prompts(capsys):
    """`megarl plan` of the 7B GRPO recipe (64 prompts x 8 samples, DP 4 on one node): at --prompt-tokens 1000
    and rollout.max_new_tokens 500, 64 * 8 * 1500 / 4 = 192000 tokens a rank without sharing and
    64 * (1000 + 8 * 500) / 4 = 80000 with it: the issue's 2.4x."""
    import json

    from test_plan import megarl, plan_args

    lines = {}
    for share in ("false", "true"):
        code, out, err = megarl(plan_args("qwen2.5-7b-grpo-gsm8k", "qwen2.5-7b", 1, "rollout.max_new_tokens=500",
                                          "train.micro_batch_tokens=16384", f"train.share_prompts={share}",
                                          "--prompt-tokens", "1000", "--json"), capsys)
        assert code == 0, err
        [lines[share]] = [a for a in json.loads(out)["assumptions"] if a.startswith("trained tokens per step")]
    assert "192000 (data.prompts_per_step x rollout.n_samples x 1500 / dp)" in lines["false"]
    assert "80000 with train.share_prompts" in lines["true"] and "2.40x fewer than 192000" in lines["true"]


# ---- multi-turn trajectories -------------------------------------------------------------------------------------
def test_multi_turn_groups_share_their_prompt_and_train_as_each_trajectory_alone(tool_chat_dir, groups):
    """Trajectories of several turns (tests/envs_for_tests.py CountingEnv: observation tokens, masked out,
    between the generated turns) in GRPO groups of four: a group shares its prompt, and everything after it is
    each trajectory's own. Held once per row, the prompt gives the GRPO loss, its statistics, the entropy per
    token and every parameter's gradient that the padded and the packed layouts give (TOL)."""
    from test_multi_turn import make_run, rows

    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig, EnvConfig
    from megarl.loops.colocated import generate
    from megarl.objective import policy_objective
    from megarl.packing import sequence_lengths
    from megarl.rollout.native import NativeEngine

    env = EnvConfig(name="envs_for_tests:CountingEnv", max_turns=3, max_tokens=240)
    run = make_run(tool_chat_dir, groups, NativeEngine(str(tool_chat_dir), seed=0), env=env, max_new_tokens=100,
                   chat_template=True)
    batch = generate(run, run.rollouts, rows(3), n_samples=4).batch
    assert int((batch.turns > 1).sum()) >= 3, batch.turns  # observations sit inside the responses
    tokens, mask = batch.tokens, batch.response_mask
    lengths = sequence_lengths(mask, batch.prompt_lens)
    prompt_groups = PromptGroups(batch.group_ids, batch.prompt_lens)
    assert prompt_units(tokens, lengths, prompt_groups, max_tokens=4096) == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                             [8, 9, 10, 11]]
    ok = valid(lengths, tokens.shape[1])

    engine = make_engine(tool_chat_dir, groups, train=True)
    base = engine.logprobs(tokens, temperature=1.0, micro_batch_size=12)
    gen = torch.Generator().manual_seed(7)
    old, ref = (base + 0.3 * torch.randn(tokens.shape, generator=gen) for _ in range(2))
    advantages = torch.linspace(-1.0, 1.0, len(tokens))[:, None] * mask
    extras = {"response_mask": mask, "old_logprobs": old * mask, "ref_logprobs": ref * mask,
              "advantages": advantages, "row_id": torch.arange(float(len(tokens)))[:, None].expand_as(mask)}
    loss_fn = partial(policy_objective(AlgoConfig(name="grpo", kl_coef=0.1, entropy_coef=0.05)),
                      norm=global_loss_norm(mask))
    budget = int(lengths.max()) + 16  # a group's prompt and a trajectory or two per row: groups cut over rows
    layouts = {"padded": dict(micro_batch_size=4),
               "packed": dict(micro_batch_size=12, micro_batch_tokens=budget, lengths=lengths),
               "shared in one row": dict(micro_batch_size=12, micro_batch_tokens=4096, lengths=lengths,
                                         prompt_groups=prompt_groups),
               "shared over rows": dict(micro_batch_size=12, micro_batch_tokens=budget, lengths=lengths,
                                        prompt_groups=prompt_groups)}
    assert_same_passes(policy_passes(engine, tokens, extras, loss_fn, layouts), ok)


# ---- mixture of experts: routes replayed and recorded ------------------------------------------------------------
def grouped_routes(tokens, lengths, prompt_groups, *, experts: int, layers: int, top_k: int) -> list[torch.Tensor]:
    """Per sample, random distinct experts for every token the engine fed in (all but the last), [length - 1,
    layers, top_k]: most differ from the model's own choice. A group's samples have their first sample's routes
    over the prompt, as an engine that reads a prompt once gives them, except sample 3, whose prompt routes
    differ at one token (a tie broken otherwise): it must not share its group's prompt."""
    gen = torch.Generator().manual_seed(11)
    routes = []
    for i in range(len(tokens)):
        n = int(lengths[i]) - 1
        routes.append(torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(n * layers)])
                      .view(n, layers, top_k).to(torch.uint8))
    first = {}
    for i, (g, p) in enumerate(zip(prompt_groups.group_ids.tolist(), prompt_groups.prompt_lens.tolist())):
        routes[i][:p] = routes[first.setdefault(g, i)][:p]
    routes[3][1, 0] = torch.tensor([e for e in range(experts) if e not in routes[3][1, 0].tolist()][:top_k])
    return routes


def test_moe_shared_prompts_replay_record_and_train_as_each_sample_alone(arch_dir, groups):
    """A MoE model (the tiny Qwen2-MoE: 4 experts, top-2, a shared expert) with its load-balancing loss off, as
    train.share_prompts needs: with the engine's routes replayed (R3), the logprobs and the GRPO loss, entropy
    and every gradient of shared rows are the padded and packed layouts' (TOL); the routing recorded for R2 is
    each sample's own, whatever layout recorded it; a sample whose prompt routes differ from its group's trains
    on its own. With the load-balancing loss on, the engine refuses shared rows."""
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig, OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.objective import policy_objective
    from megarl.routing import RouteUse

    model_dir = arch_dir("qwen2_moe")
    optim = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0, distributed=True)
    engine = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={"moe_aux_loss_coeff": 0.0},
                         groups=groups, optim=optim)
    shape = engine.shape
    tokens, mask, advantages, prompt_groups, lengths = grouped_batch()
    ok = valid(lengths, tokens.shape[1])
    routes = grouped_routes(tokens, lengths, prompt_groups, experts=shape.experts, layers=shape.layers,
                            top_k=shape.topk)
    units = prompt_units(tokens, lengths, prompt_groups, max_tokens=64)
    from megarl.packing import with_prompt_routes

    assert units == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert prompt_units(tokens, lengths, with_prompt_routes(prompt_groups, routes), max_tokens=64) == \
        [[0, 1, 2], [3], [4, 5, 6], [7]]
    shared = dict(micro_batch_size=8, micro_batch_tokens=64, lengths=lengths, prompt_groups=prompt_groups)
    layouts = {"padded": dict(micro_batch_size=3), "packed": dict(micro_batch_size=8, micro_batch_tokens=40,
                                                                   lengths=lengths), "shared": shared,
               "shared over rows": shared | dict(micro_batch_tokens=20)}

    # R2's record: the trainer's own routing of every token, per sample
    recorded = {}
    for name, micro in layouts.items():
        engine.logprobs(tokens, temperature=1.0, routes=RouteUse(record=True), **micro)
        recorded[name] = engine.recorded_routes()
    for name, per_sample in recorded.items():
        for i, n in enumerate(lengths.tolist()):
            assert torch.equal(per_sample[i][:n], recorded["padded"][i][:n]), (name, i)
    # R3's replay: the engine's routes, most unlike the model's own, change the logprobs; every layout alike
    own = engine.logprobs(tokens, temperature=1.0, micro_batch_size=8)
    replay = RouteUse(routes=routes, replay=True)
    replayed = {name: engine.logprobs(tokens, temperature=1.0, routes=replay, **micro)
                for name, micro in layouts.items()}
    assert (replayed["padded"] - own)[ok].abs().max() > 1e-3  # measured 0.02: a thousand times TOL
    for name, lp in replayed.items():
        assert (lp - replayed["padded"])[ok].abs().max() <= TOL, name

    gen = torch.Generator().manual_seed(7)
    old, ref = (replayed["padded"] + 0.3 * torch.randn(tokens.shape, generator=gen) for _ in range(2))
    extras = {"response_mask": mask, "old_logprobs": old * mask, "ref_logprobs": ref * mask,
              "advantages": advantages, "row_id": torch.arange(float(len(tokens)))[:, None].expand_as(mask)}
    loss_fn = partial(policy_objective(AlgoConfig(name="grpo", kl_coef=0.1, entropy_coef=0.05)),
                      norm=global_loss_norm(mask))
    runs = policy_passes(engine, tokens, extras, loss_fn,
                         {name: micro | dict(routes=replay) for name, micro in layouts.items()})
    assert_same_passes(runs, ok)
    experts = [name for name in runs["padded"][2] if "local_experts" in name]
    assert experts and all(runs["shared"][2][name].abs().max() > 0 for name in experts[:1])

    with_aux = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={}, groups=groups, optim=None)
    with pytest.raises(ValueError, match="load-balancing loss"):
        with_aux.logprobs(tokens, temperature=1.0, **shared)
