"""Multimodal RoPE positions (Qwen2.5-VL, Qwen3-VL): three position indices per token, (time, height, width).

A text token's three indices are equal and advance by one. An image's merged patches, laid out row by row, sit
at time = start, height = start + row, width = start + column, where `start` is the position after the text
before it; the text after the image goes on from start + the larger of the image's merged rows and columns. Each
sample starts at 0; a packed row of several samples gives each its own positions (`packed_mrope_positions`), as
each sample alone would have them. transformers' `get_rope_index` is the reference the tests hold these to.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor


def mrope_positions(token_types: list[int], grids: Tensor, *, spatial_merge: int) -> Tensor:
    """[3, T] int64 positions of one sample: `token_types[t]` 1 at image tokens, 0 elsewhere (ImagePrompt's
    mm_token_type_ids, then the response's zeros); `grids` [images, 3] each image's (frames, patch rows, patch
    columns), in order. ValueError when a run of image tokens does not hold its image's merged patches."""
    pieces, start, images = [], 0, iter(grids.tolist())
    for kind, run in itertools.groupby(token_types):
        length = len(list(run))
        if kind == 0:
            pieces.append(torch.arange(start, start + length).expand(3, -1))
            start += length
            continue
        frames, rows, columns = next(images, (0, 0, 0))
        rows, columns = rows // spatial_merge, columns // spatial_merge
        if frames * rows * columns != length:
            raise ValueError(f"a run of {length} image tokens for an image of {frames} x {rows} x {columns} merged "
                             "patches")
        t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(columns), indexing="ij")
        pieces.append(torch.stack([t, h, w]).reshape(3, -1) + start)
        start += max(rows, columns)
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.int64)


def packed_mrope_positions(samples: list[tuple[list[int], Tensor]], *, spatial_merge: int) -> Tensor:
    """[3, sum of T] positions of a packed row: each sample's (token_types, grids) positioned from 0, in order."""
    return torch.cat([mrope_positions(types, grids, spatial_merge=spatial_merge) for types, grids in samples], dim=1)
