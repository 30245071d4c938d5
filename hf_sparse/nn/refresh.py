"""Refreshing a compact layer's packs from its kept values: what to write (:class:`RefreshEntry`), the torch ops
that write it (:func:`run_refresh_entries`, the reference, used on CPU) and the extension's one launch for the entries
of many layers (:func:`launch_refresh`).

A compact layer (:mod:`hf_sparse.nn.compact`) computes on packs made from its values: the fragment-ordered pack, the
transposed 2:4 pack, the 2:4 view of a V:2:M weight, the bias in the compute dtype. After each optimizer step every
pack must follow its values. With torch ops that is three or four launches per layer (a strided copy, one gather per
2:4 pack, a copy), ~400 per step for BERT-large, each costing the host ~20 us on the machines this was measured on;
the extension's ``refresh_packs`` runs the entries of every stale layer in one launch from a table of pointers.

Entries (every one writes all of ``dst``, converting to its dtype):

* ``PACK``: ``dst`` is the fragment-ordered pack (flat) of the ``(rows, 2 * groups)`` values ``src``; the layout's
  padding (rows past ``rows``, groups past ``groups``) is zero.
* ``GATHER``: ``dst[j] = src.flatten()[index[j]]``, zero where ``index[j] >= src.numel()`` (the 2:4 packs of a
  layer's values: ``index`` is their permutation, with ``src.numel()`` at padding slots).
* ``COPY``: ``dst = src`` (the bias in the compute dtype).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["COPY", "GATHER", "PACK", "RefreshEntry", "gather_source", "launch_refresh", "run_refresh_entries"]

PACK, GATHER, COPY = 0, 1, 2
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/kernels.h kRefreshF32 / BF16 / F16


class RefreshEntry(NamedTuple):
    """One piece of a refresh (see the module docstring). ``rows``, ``groups``, ``steps``: ``PACK`` only."""

    kind: int
    src: Tensor
    dst: Tensor
    index: Tensor | None = None
    rows: int = 0
    groups: int = 0
    steps: int = 0

    def words(self, first_block: int) -> list[int]:
        """The entry as the extension's ``RefreshEntry`` (csrc/kernels.h): eleven 64-bit words."""
        index = self.index
        return [
            self.src.data_ptr(),
            self.dst.data_ptr(),
            0 if index is None else index.data_ptr(),
            self.dst.numel(),
            self.src.numel(),
            self.rows,
            self.groups,
            self.steps,
            first_block,
            self.kind | _DTYPES[self.src.dtype] << 32,
            _DTYPES[self.dst.dtype] | int(index is not None and index.dtype == torch.int64) << 32,
        ]


def gather_source(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` flat in ``dtype``, then one zero: what a ``GATHER`` index reads with torch ops (position
    ``weight.numel()`` is the zero)."""
    flat = weight.detach().reshape(-1)
    return torch.cat([flat.to(dtype), flat.new_zeros(1, dtype=dtype)])


def run_refresh_entries(entries) -> None:
    """Write ``entries`` with torch ops, one entry after the other (the reference of :func:`launch_refresh`)."""
    with torch.no_grad():
        for e in entries:
            if e.kind == PACK:
                values = e.dst.view(-1, e.steps, 32, 8)
                _fill(values, e.src.detach(), _pieces(e.rows, e.groups), e.groups)
            elif e.kind == GATHER:
                torch.index_select(gather_source(e.src, e.dst.dtype), 0, e.index, out=e.dst.view(-1))
            else:
                e.dst.copy_(e.src.detach())


class _Table(NamedTuple):
    key: tuple
    table: Tensor
    blocks: int


_tables: dict[torch.device, _Table] = {}  # the last launch table per device: pointers only, rebuilt when they change


def launch_refresh(ext, groups: list[tuple[tuple[int, ...], tuple[RefreshEntry, ...]]], device: torch.device) -> None:
    """Run the entries of ``groups`` (each ``(key, entries)``: ``key`` names the entries' storage, so that an equal
    key means equal pointers) in one launch of the extension ``ext``'s ``refresh_packs``, on the current stream.
    The table of pointers is made again only when the keys change; it holds no tensor, the callers' entries keep
    the storage alive."""
    if not groups:
        return
    key = tuple(k for k, _ in groups)
    cached = _tables.get(device)
    if cached is None or cached.key != key:
        words, blocks = [], 0
        for _, entries in groups:
            for e in entries:
                words.append(e.words(blocks))
                blocks += ext.refresh_block_count(e.dst.numel())
        table = torch.tensor(words, dtype=torch.int64).to(device)
        cached = _tables[device] = _Table(key, table, blocks)
    ext.refresh_packs(cached.table, cached.blocks)


def _pieces(rows: int, groups: int) -> list[tuple[tuple, int, int, tuple, int, int, tuple]]:
    """How the logical ``(rows, groups, 2)`` values map onto the pack seen as ``(mt, rh, g8, s, ch, t, 2)`` (row
    ``16 mt + 8 rh + g8``, group ``8 s + 4 ch + t``): ``(pack index, r0, r1, row split, g0, g1, group split)`` per
    block of rows and groups that is a strided slice of both; one block when ``rows % 16 == 0`` and ``groups % 8 ==
    0``."""
    row_parts = []
    full = rows // 16
    if full:
        row_parts.append(((slice(0, full), slice(None)), 0, 16 * full, (full, 2, 8)))
    if rows % 16:  # rows are a multiple of 8: the last 8 fill one half of a 16-row tile
        row_parts.append(((slice(full, full + 1), slice(0, 1)), 16 * full, rows, (1, 1, 8)))
    group_parts = []
    steps = groups // 8
    if steps:
        group_parts.append(((slice(0, steps), slice(None), slice(None)), 0, 8 * steps, (steps, 2, 4)))
    rest, g0 = groups % 8, 8 * steps
    if rest >= 4:
        group_parts.append(((slice(steps, steps + 1), slice(0, 1), slice(None)), g0, g0 + 4, (1, 1, 4)))
        g0 += 4
    if rest % 4:
        ch = int(rest >= 4)
        group_parts.append(
            ((slice(steps, steps + 1), slice(ch, ch + 1), slice(0, rest % 4)), g0, groups, (1, 1, rest % 4))
        )
    pieces = []
    for (mt, rh), r0, r1, rsplit in row_parts:
        for (s, ch, t), a, b, gsplit in group_parts:
            pieces.append(((mt, rh, slice(None), s, ch, t, slice(None)), r0, r1, rsplit, a, b, gsplit))
    return pieces


def _logical_view(values: Tensor) -> Tensor:
    """The fragment-ordered pack ``(Rp/16, S, 32, 8)`` seen as ``(mt, rh, g8, s, ch, t, 2)`` (a view)."""
    tiles, steps = values.shape[:2]
    return values.view(tiles, steps, 8, 4, 2, 2, 2).permute(0, 5, 2, 1, 4, 3, 6)


def _fill(values: Tensor, weight: Tensor, pieces: list, groups: int) -> None:
    """Write ``weight`` (R, 2G) into the pack ``values``, cast to its dtype; the padding is left as it is."""
    view = _logical_view(values)
    w3 = weight.view(weight.shape[0], groups, 2)
    for index, r0, r1, rsplit, g0, g1, gsplit in pieces:
        view[index].copy_(w3[r0:r1, g0:g1].view(*rsplit, *gsplit, 2))
