"""Sequence packing and token balancing: who trains on which sample, in which micro-batch, at which offset.

Two partitions, both pure functions of per-sample token counts:
- over data-parallel ranks (`balanced_partition(..., equal_size=True)`): every rank trains on as many samples
  as before, with token totals as even as the greedy allows; `redistribute` moves the samples.
- over micro-batches (`plan_micro_batches`): a rank's samples into a given number of micro-batches under a
  token budget, balanced by tokens. The number is agreed over DP ranks by the engine (Megatron's DDP and
  pipeline schedules need the same count everywhere).

A packed micro-batch is one row of its sequences back to back (the "thd" layout): `PackedRow` holds the
segment boundaries (`cu_seqlens`, as Megatron's PackedSeqParams wants them), and `unpack` turns per-token
outputs of the row back into the [b, T] layout of right-padded sequences that loss functions expect.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.batch import RolloutBatch


# ---- partitions -----------------------------------------------------------------------------------------
def balanced_partition(weights: list[int], n_parts: int, *, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` split into `n_parts` parts with sums as even as a greedy gets; each index once.

    equal_size=False (longest processing time first): weights in decreasing order, each to the lightest
    part. The heaviest part is at most sum/n_parts + max(weights) * (1 - 1/n_parts) (the last weight it got
    went to the then lightest part).
    equal_size=True: len(weights) must be divisible by n_parts and every part gets len/n_parts indices.
    Weights in decreasing order are dealt in rounds of n_parts, the heaviest of a round to the lightest
    part. The spread max - min grows in a round by at most (its first - its last weight), which is at most
    (the round's first - the next round's first weight); over all rounds it telescopes, so max - min <=
    max(weights) - min(weights), and the heaviest part is at most sum/n_parts + max - min.
    Ties are broken by index, so the result is deterministic. Each part's indices are sorted.
    """
    if n_parts < 1:
        raise ValueError(f"n_parts must be >= 1, got {n_parts}")
    if equal_size and len(weights) % n_parts:
        raise ValueError(f"{len(weights)} weights cannot be split into {n_parts} parts of equal size")
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    loads = [0] * n_parts
    if equal_size:
        for start in range(0, len(order), n_parts):
            by_load = sorted(range(n_parts), key=lambda p: (loads[p], p))
            for p, i in zip(by_load, order[start: start + n_parts]):
                parts[p].append(i)
                loads[p] += weights[i]
    else:
        for i in order:
            p = min(range(n_parts), key=lambda q: (loads[q], len(parts[q]), q))
            parts[p].append(i)
            loads[p] += weights[i]
    return [sorted(part) for part in parts]


def count_bins(lengths: list[int], capacity: int) -> int:
    """Bins of `capacity` tokens that first-fit-decreasing needs for `lengths` (0 for no lengths).

    ValueError when one length alone exceeds the capacity."""
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit in a micro-batch of "
                         f"micro_batch_tokens={capacity} tokens")
    free: list[int] = []
    for n in sorted(lengths, reverse=True):
        for b, room in enumerate(free):
            if n <= room:
                free[b] -= n
                break
        else:
            free.append(capacity - n)
    return len(free)


def plan_micro_batches(lengths: list[int], *, max_tokens: int, n_micro: int) -> list[list[int]] | None:
    """`n_micro` micro-batches of sample indices balanced by tokens, or None when the balanced split puts
    more than `max_tokens` tokens in one (the caller then asks for one more micro-batch). Micro-batches are
    empty only when there are fewer samples than `n_micro`."""
    parts = balanced_partition(lengths, n_micro)
    if any(sum(lengths[i] for i in part) > max_tokens for part in parts):
        return None
    return parts


# ---- the packed layout ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedRow:
    """Sequences of one micro-batch back to back in one row of `row_len` tokens.

    Segment k covers row positions cu_seqlens[k] : cu_seqlens[k + 1]. The sequences come first, in the
    order of `index`; padding up to `row_len`, if any, is one more segment of its own, so attention never
    mixes it with a real sequence.
    """

    index: Tensor        # [b] long: the rows of the rank's [B, T] batch in this micro-batch
    lengths: Tensor      # [b] long: real tokens of each of those sequences
    cu_seqlens: Tensor   # [segments + 1] int32: segment boundaries in the row, from 0 to row_len
    row_len: int
    shared: SharedPrompts | None = None  # the prompts held once per group (`shared_row`); None: none are

    @property
    def max_seqlen(self) -> int:
        """The longest segment, and with shared prompts the longest sequence (its last position id + 1)."""
        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        if self.shared is not None and len(self.lengths):
            longest = max(longest, int(self.lengths.max()))
        return longest


def packed_row(index: list[int], lengths: Tensor, *, row_len: int) -> PackedRow:
    """The layout of sequences `index` (lengths [B] of the whole batch) in a row of `row_len` tokens."""
    seg = lengths[torch.as_tensor(index, dtype=torch.long)].long()
    used = int(seg.sum())
    if used > row_len:
        raise ValueError(f"{used} tokens do not fit in a packed row of {row_len}")
    bounds = [0, *torch.cumsum(seg, 0).tolist()]
    if used < row_len or not index:
        bounds.append(row_len)
    return PackedRow(index=torch.as_tensor(index, dtype=torch.long), lengths=seg,
                     cu_seqlens=torch.tensor(bounds, dtype=torch.int32), row_len=row_len)


def pack(values: Tensor, row: PackedRow, *, fill: int | float = 0) -> tuple[Tensor, Tensor]:
    """values [B, T] (token ids) -> (the row [1, row_len], position ids [1, row_len] restarting at 0 in
    every segment, padding included)."""
    out = values.new_full((row.row_len,), fill)
    positions = torch.arange(row.row_len)
    starts = row.cu_seqlens[:-1].long()
    seg_lens = (row.cu_seqlens[1:] - row.cu_seqlens[:-1]).long()
    positions = positions - torch.repeat_interleave(starts, seg_lens)
    offset = 0
    for i, n in zip(row.index.tolist(), row.lengths.tolist()):
        out[offset: offset + n] = values[i, :n]
        offset += n
    return out[None], positions[None]


def unpack(row_values: Tensor, row: PackedRow, *, width: int) -> Tensor:
    """Per-token outputs of a packed row [row_len] -> [b, width] in the right-padded layout.

    Column t of sequence k is row position start_k + t, for 1 <= t < length_k. Column 0 is 0, as in the
    padded layout (nothing predicts a first token; in the row that position holds the prediction from the
    previous sequence's end), and so is every column past the sequence's end. Differentiable (a gather).
    """
    starts = row.cu_seqlens[: len(row.index)].long().to(row_values.device)
    cols = torch.arange(width, device=row_values.device)
    where = starts[:, None] + cols[None, :]                                       # [b, width]
    valid = (cols[None, :] >= 1) & (cols[None, :] < row.lengths.to(row_values.device)[:, None])
    gathered = row_values[where.clamp(max=row.row_len - 1)]
    return torch.where(valid, gathered, torch.zeros((), dtype=row_values.dtype, device=row_values.device))


# ---- prompts held once per group ---------------------------------------------------------------------------
# A group's samples share their prompt: a shared row holds it once, then each sample's own tokens (its
# response, and in a multi-turn trajectory the turns after the prompt). Own tokens take the position ids
# that follow the prompt (P, P + 1, ...) and attend to the prompt and to their own earlier tokens only, so
# every sample's outputs are those of the sample alone. The prompt's last position predicts the first own
# token of every sample: one extra prediction per sample, read after the row's own (see `unpack`).
@dataclass(frozen=True)
class PromptGroups:
    """Which samples of a [B, T] batch may share a prompt: those of one group whose prompt tokens are equal."""

    group_ids: Tensor    # [B] long: samples of the same prompt share an id
    prompt_lens: Tensor  # [B] long: prompt tokens of each sample


@dataclass(frozen=True)
class SharedPrompts:
    """Where the sequences of a shared row sit: sequence k's tokens 0 .. prompt_len[k] - 1 are the prompt at
    prompt_start[k] (the same for every sequence of its group), its tokens from prompt_len[k] on are its own,
    at own_start[k]. A sequence alone in its group shares nothing: prompt_len 0, all its tokens its own."""

    prompt_start: Tensor  # [b] long
    prompt_len: Tensor    # [b] long
    own_start: Tensor     # [b] long
    prefix_of: Tensor     # [segments] long: the segment every token of a segment also sees whole, -1 for none


@dataclass(frozen=True)
class SharedKeys:
    """A shared row's keys segment by segment, for packed attention that takes each segment's queries against
    keys of its own (Transformer Engine's, megarl.engine.te_attention): a segment's keys are its prompt's
    tokens, then its own. Under a bottom-right aligned causal mask its i-th token then sees the whole prompt
    and its own tokens up to i; a segment without a prompt has its own tokens only: plain causal attention."""

    index: Tensor       # [keys] long: the row position of each key, segment after segment
    cu_seqlens: Tensor  # [segments + 1] int32: where each segment's keys begin in `index`, and the end
    max_seqlen: int     # the most keys of a segment


def shared_keys(cu_seqlens: Tensor, prefix_of: Tensor) -> SharedKeys:
    """The keys of a shared row with segment bounds `cu_seqlens` and prompts `prefix_of` (SharedPrompts)."""
    bounds, keys = cu_seqlens.tolist(), []
    for s, p in enumerate(prefix_of.tolist()):
        prompt = range(bounds[p], bounds[p + 1]) if p >= 0 else range(0)
        keys.append([*prompt, *range(bounds[s], bounds[s + 1])])
    counts = [len(k) for k in keys]
    return SharedKeys(index=torch.tensor([i for k in keys for i in k], dtype=torch.long),
                      cu_seqlens=torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32),
                      max_seqlen=max(counts, default=0))


def with_prompt_routes(groups: PromptGroups, routes: list[Tensor]) -> PromptGroups:
    """`groups` where samples also share only with those whose MoE routes over the prompt are the same: a shared
    prompt is routed once, so a group whose samples' routes for it differ (a near tie the engine broke otherwise
    in another batch) shares within each set of equal routes, and every sample is still replayed and compared
    with its own routes."""
    ids, kinds, new_ids = [], {}, 0  # kinds, per group: (new id, a sample with those prompt routes)
    for i, (g, p) in enumerate(zip(groups.group_ids.tolist(), groups.prompt_lens.tolist())):
        known = kinds.setdefault(g, [])
        same = next((k for k, j in known if torch.equal(routes[j][:p], routes[i][:p])), None)
        if same is None:
            same, new_ids = new_ids, new_ids + 1
            known.append((same, i))
        ids.append(same)
    return PromptGroups(torch.tensor(ids, dtype=torch.long), groups.prompt_lens)


def sequence_positions(row: PackedRow) -> list[Tensor]:
    """Row positions of each sequence's tokens 0 .. length - 1, in `row.index` order: consecutive in a packed
    row; in a shared row the prompt's (the same for every sequence of its group), then its own tokens'."""
    if row.shared is None:
        return [torch.arange(start, start + n) for start, n in zip(row.cu_seqlens.tolist(), row.lengths.tolist())]
    sh = row.shared
    return [torch.cat([torch.arange(p0, p0 + p), torch.arange(o0, o0 + n - p)])
            for n, p0, p, o0 in zip(row.lengths.tolist(), sh.prompt_start.tolist(), sh.prompt_len.tolist(),
                                    sh.own_start.tolist())]


def prompt_units(tokens: Tensor, lengths: Tensor, groups: PromptGroups, *, max_tokens: int) -> list[list[int]]:
    """The samples of `tokens` [B, T] (`lengths` [B] real tokens) in units that hold one prompt: a group's
    samples with equal prompt tokens, in batch order, cut where prompt + own tokens would pass `max_tokens`;
    every sample in exactly one unit (alone when it shares with no one)."""
    units: dict[tuple, list[list[int]]] = {}
    for i in range(len(tokens)):
        p = int(groups.prompt_lens[i])
        key = (int(groups.group_ids[i]), p, tuple(tokens[i, :p].tolist()) if p > 0 else i)
        chunks = units.setdefault(key, [[]])
        if chunks[-1] and p + sum(int(lengths[j]) - p for j in chunks[-1]) + int(lengths[i]) - p > max_tokens:
            chunks.append([])
        chunks[-1].append(i)
    return sorted((u for chunks in units.values() for u in chunks), key=lambda u: u[0])


def unit_tokens(unit: list[int], lengths: Tensor, prompt_lens: Tensor) -> int:
    """Tokens of a unit in a shared row: its prompt once, then every sample's own tokens."""
    if len(unit) == 1:
        return int(lengths[unit[0]])
    p = int(prompt_lens[unit[0]])
    return p + sum(int(lengths[i]) - p for i in unit)


def shared_row(units: list[list[int]], lengths: Tensor, prompt_lens: Tensor, *, row_len: int) -> PackedRow:
    """The layout of `units` (`prompt_units`) in a row of `row_len` tokens: per unit its prompt, then each
    sample's own tokens, one segment each (an empty one is left out); padding, if any, a segment of its own."""
    index, prompt_start, prompt_len, own_start, bounds, prefix_of = [], [], [], [], [0], []
    for unit in units:
        p = int(prompt_lens[unit[0]]) if len(unit) > 1 else 0
        start, prompt_segment = bounds[-1], -1
        if p > 0:
            prompt_segment = len(prefix_of)
            bounds.append(start + p)
            prefix_of.append(-1)
        for i in unit:
            own = int(lengths[i]) - p
            index.append(i), prompt_start.append(start), prompt_len.append(p), own_start.append(bounds[-1])
            if own > 0:
                bounds.append(bounds[-1] + own)
                prefix_of.append(prompt_segment)
    if bounds[-1] > row_len:
        raise ValueError(f"{bounds[-1]} tokens do not fit in a packed row of {row_len}")
    if bounds[-1] < row_len or not index:
        bounds.append(row_len)
        prefix_of.append(-1)
    longs = partial(torch.tensor, dtype=torch.long)
    shared = SharedPrompts(prompt_start=longs(prompt_start), prompt_len=longs(prompt_len), own_start=longs(own_start),
                           prefix_of=longs(prefix_of))
    return PackedRow(index=longs(index), lengths=lengths[longs(index)].long(),
                     cu_seqlens=torch.tensor(bounds, dtype=torch.int32), row_len=row_len, shared=shared)


def pack_shared(values: Tensor, row: PackedRow, *, fill: int | float = 0) -> tuple[Tensor, Tensor]:
    """values [B, T] (token ids) -> (the shared row [1, row_len], position ids [1, row_len]: a sequence's
    position in its own sequence, own tokens after the prompt's; padding from 0)."""
    out = values.new_full((row.row_len,), fill)
    positions = torch.zeros(row.row_len, dtype=torch.long)
    sh, used = row.shared, 0
    for i, n, p0, p, o0 in zip(row.index.tolist(), row.lengths.tolist(), sh.prompt_start.tolist(),
                               sh.prompt_len.tolist(), sh.own_start.tolist()):
        out[p0: p0 + p] = values[i, :p]
        positions[p0: p0 + p] = torch.arange(p)
        out[o0: o0 + n - p] = values[i, p:n]
        positions[o0: o0 + n - p] = torch.arange(p, n)
        used = max(used, o0 + n - p)
    positions[used:] = torch.arange(row.row_len - used)
    return out[None], positions[None]


def first_own_predictions(row: PackedRow, ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each sequence k of a shared row (ids [row_len]): (the row position that predicts its first own
    token, the prompt's last, [b] long; that token [b]). A sequence that shares nothing or has no own
    token gets position 0 (its prediction is never read)."""
    sh = row.shared
    has = (sh.prompt_len > 0) & (row.lengths > sh.prompt_len)
    where = torch.where(has, sh.prompt_start + sh.prompt_len - 1, 0)
    return where, ids[torch.where(has, sh.own_start, 0).to(ids.device)]


def unpack_shared(predictions: Tensor, row: PackedRow, *, width: int) -> Tensor:
    """Outputs of a shared row -> [b, width] in the right-padded layout. `predictions` [row_len + b]: what
    each row position predicts (logprob of the row's next token, entropy, or the value there), then each
    sequence's first-own-token prediction (`first_own_predictions`).

    Column t of sequence k (1 <= t < length_k) is the prediction made at the row position of its token t - 1,
    except the first own token (t = prompt_len_k), predicted by the prompt's last position for that sequence
    alone. Column 0 and the columns past the end are 0. Differentiable (a gather)."""
    device = predictions.device
    sh = row.shared
    cols = torch.arange(width, device=device)[None, :]                                   # [1, width]
    p, prompt_start, own_start = (t.to(device)[:, None] for t in (sh.prompt_len, sh.prompt_start, sh.own_start))
    before = cols - 1                                                                   # token t - 1
    where = torch.where(before < p, prompt_start + before, own_start + before - p)      # [b, width]
    first = torch.arange(len(row.index), device=device)[:, None] + row.row_len
    where = torch.where((cols == p) & (p > 0), first, where)
    valid = (cols >= 1) & (cols < row.lengths.to(device)[:, None])
    gathered = predictions[where.clamp(min=0, max=predictions.shape[0] - 1)]
    return torch.where(valid, gathered, torch.zeros((), dtype=predictions.dtype, device=device))


# ---- rollout samples over data-parallel ranks -----------------------------------------------------------------
def sequence_lengths(response_mask: Tensor, prompt_lens: Tensor) -> Tensor:
    """Real tokens per sample [B] of right-padded rows: through the last response token (response_mask
    [B, T]), at least the prompt (prompt_lens [B])."""
    width = response_mask.shape[1]
    last = torch.where(response_mask.bool(), torch.arange(1, width + 1), 0).amax(dim=1)
    return torch.maximum(last, prompt_lens.long())


def tokens_imbalance(tokens_per_rank: list[int]) -> float:
    """max / mean of the tokens per rank: 1.0 is perfect balance (and an empty step)."""
    mean = sum(tokens_per_rank) / len(tokens_per_rank)
    return max(tokens_per_rank) / mean if mean > 0 else 1.0


def redistribute(batch: RolloutBatch, *, group, pad_id: int) -> tuple[RolloutBatch, float]:
    """Move samples between the ranks of the data-parallel `group` so every rank trains on the same number
    of samples with token totals as even as `balanced_partition(equal_size=True)` makes them. Returns this
    rank's new batch and the token imbalance (max / mean over ranks) it trains with.

    Every field travels with its sample, so per-sample quantities computed before (advantages, group
    baselines) keep their values: redistribute after advantages. Group ids become id * size + source rank,
    distinct over the whole group. A sample's [B, T] fields are right padded to the widest received batch.
    Every rank of `group` must call this (and hold equally many samples); group None is a no-op.
    """
    size = dist.get_world_size(group) if group is not None else 1
    lengths = sequence_lengths(batch.response_mask, batch.prompt_lens)
    if size == 1:
        return batch, 1.0
    rank = dist.get_rank(group)
    counts = torch.tensor([len(batch)])
    all_counts = [torch.zeros_like(counts) for _ in range(size)]
    dist.all_gather(all_counts, counts, group=group)
    if len({int(c) for c in all_counts}) != 1:
        raise ValueError(f"redistribute: ranks hold different numbers of samples {[int(c) for c in all_counts]}")
    all_lengths = [torch.zeros_like(lengths) for _ in range(size)]
    dist.all_gather(all_lengths, lengths.contiguous(), group=group)
    flat = torch.cat(all_lengths).tolist()  # global sample g = source rank * B + local index
    parts = balanced_partition(flat, size, equal_size=True)
    n = len(batch)
    batch = batch.renumber_groups(batch.group_ids * size + rank)
    received: list[RolloutBatch | None] = [None] * size
    # An all-to-all made of one scatter per source rank: each rank receives only its own samples.
    for src in range(size):
        outgoing = None
        if src == rank:
            outgoing = [batch.select(torch.tensor([g - src * n for g in part if g // n == src], dtype=torch.long))
                        for part in parts]
        slot: list[RolloutBatch | None] = [None]
        dist.scatter_object_list(slot, outgoing, src=dist.get_global_rank(group, src), group=group)
        received[src] = slot[0]
    mine = RolloutBatch.concat(received, pad_id=pad_id)
    return mine, tokens_imbalance([sum(flat[g] for g in part) for part in parts])


def zero_advantage_split(batch: RolloutBatch, *, group, multiple: int = 1) -> tuple[RolloutBatch, float]:
    """Split off the samples whose advantage is exactly zero on every response token: under a loss whose
    terms all scale with the advantage (`PolicyObjective.inert_at_zero_advantage`) such a sample adds
    exactly zero to the loss and to every gradient, so training without it gives the same update (a GRPO
    group whose samples all earned the same reward is one). Returns (trained, trained_frac): `equal_part`
    of the samples with a non-zero advantage, and their global fraction. Every rank of `group` must call
    this (group None: this rank alone)."""
    return equal_part(batch, nonzero_advantage(batch), group=group, multiple=multiple)


def nonzero_advantage(batch: RolloutBatch) -> Tensor:
    """[B] bool: the samples with a non-zero advantage on some response token."""
    return ((batch.advantages != 0) & batch.response_mask.bool()).any(dim=-1)


def equal_part(batch: RolloutBatch, chosen: Tensor, *, group, multiple: int = 1) -> tuple[RolloutBatch, float]:
    """The samples `chosen` ([B] bool), with as many on every rank of the data-parallel `group`, so the ranks
    run the same number of micro-batches (and `redistribute` can even out the tokens afterwards): as many as
    the rank with the most chosen samples (at least one, so every rank still joins the collectives of a pass)
    rounded up to a `multiple` of samples (pipeline parallelism's padded micro-batches), topped up with its
    shortest other samples, whose response masks are zeroed (they run through their prompts only, and no
    statistic counts them, whatever the layout). Returns (part, fraction): `fraction` is the global share
    of chosen samples; `part` is `batch` itself when it keeps every sample and masks nothing. Every rank of
    `group` must call this (group None: this rank alone)."""
    counts = torch.tensor([int(chosen.sum())])
    size = dist.get_world_size(group) if group is not None else 1
    if size > 1:
        gathered = [torch.zeros_like(counts) for _ in range(size)]
        dist.all_gather(gathered, counts, group=group)
        counts = torch.cat(gathered)
    keep_n = min(max(-(-int(counts.max()) // multiple) * multiple, multiple), len(batch))
    fraction = float(counts.sum()) / (len(batch) * size)
    lengths = sequence_lengths(batch.response_mask, batch.prompt_lens)
    fillers = sorted((i for i in range(len(batch)) if not chosen[i]), key=lambda i: (int(lengths[i]), i))
    keep = sorted([i for i in range(len(batch)) if chosen[i]] + fillers[:keep_n - int(chosen.sum())])
    part = batch if len(keep) == len(batch) else batch.select(torch.tensor(keep, dtype=torch.long))
    # a filler's response is masked out: it runs through its prompt only, and no statistic counts it
    return part.mask_responses_except(chosen[keep]), fraction
