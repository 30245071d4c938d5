"""Making a compact layer's packs from its kept values: what to write (:class:`RefreshEntry`), the torch ops that
write it (:func:`run_refresh_entries`, the reference, used on CPU) and the extension's one launch for the entries of
many layers (:func:`launch_refresh`).

A compact layer (:mod:`hf_sparse.nn.compact`) computes on packs made from its values: the fragment-ordered pack, the
transposed 2:4 pack, the 2:4 view of a V:2:M weight, the bias in the compute dtype. A call that trains makes the one
it computes on inside the call (the extension's ``pack_in_call``: its own kernel for each kind). What inference
holds between calls (the own pack, the bias's cast) must follow the values after each optimizer step; with torch
ops that is a launch or more per layer, each costing the host ~20 us on the machines this was measured on, so the
extension's ``refresh_packs`` runs the ``PACK`` and ``COPY`` entries of every stale layer in one launch from a table
of pointers.

Entries (every one writes all of ``dst``, converting to its dtype; ``src`` is a layer's kept values ``(R, 2G)``):

* ``PACK``: ``dst`` is the fragment-ordered pack (flat) of ``src``; the layout's padding (rows past ``rows``, groups
  past ``groups``) is zero.
* ``TRANSPOSED``: ``dst`` is the fragment-ordered 2:4 pack of ``W^T`` for a 2:4 layer whose transposed mask is 2:4
  too (``rows`` = W's columns, ``groups`` = W's rows / 4): slot k of a group holds the k-th kept value, by row, of
  that column and 4 rows.
* ``VIEW24``: ``dst`` is the fragment-ordered 2:4 pack of a V:2:M weight (M >= 8) seen as 2:4 (``rows`` = W's rows,
  ``groups`` = W's columns / 4): slot k holds the k-th kept value, by column, of that row and 4 columns, zero where
  there are fewer.
* ``COPY``: ``dst = src`` (the bias in the compute dtype).

``TRANSPOSED`` and ``VIEW24`` find each slot's source from the layer's kept positions in their on-disk form (``sel``,
the 2-bit codes; ``columns``, V:2:M's block columns): a permutation held for them would take 4 bytes per slot, more
than the pack it fills.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..formats.compressed import kept_index
from ..ops._layout import _first_k_true, values_to_kernel
from ..patterns import NM, VNM

__all__ = [
    "COPY",
    "PACK",
    "TRANSPOSED",
    "VIEW24",
    "RefreshEntry",
    "kept_index_of",
    "launch_refresh",
    "run_refresh_entries",
    "source_index",
]

PACK, TRANSPOSED, VIEW24, COPY = 0, 1, 2, 3  # csrc/kernels.h kRefreshPack / Transposed / View24 / Copy
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/kernels.h kRefreshF32 / BF16 / F16


class RefreshEntry(NamedTuple):
    """One piece of a refresh (see the module docstring). ``rows``, ``groups``, ``steps``: the destination pack's
    logical rows and groups and its layout's steps (not for ``COPY``); ``sel``, ``columns``, ``m``, ``v``: the
    layer's kept positions (:func:`hf_sparse.nn.compact.positions`) and group size, for ``TRANSPOSED`` and
    ``VIEW24``."""

    kind: int
    src: Tensor
    dst: Tensor
    rows: int = 0
    groups: int = 0
    steps: int = 0
    sel: Tensor | None = None
    columns: Tensor | None = None
    m: int = 4
    v: int = 1

    def words(self, first_block: int) -> list[int]:
        """The entry as the extension's ``RefreshEntry`` (csrc/kernels.h): ``kRefreshWords`` 64-bit words. Only
        ``PACK`` and ``COPY`` entries go into a table; the extension makes the other packs by their own kernels."""
        if self.kind not in (PACK, COPY):
            raise ValueError(
                f"RefreshEntry.words: kind {self.kind} is not PACK ({PACK}) or COPY ({COPY}); the transposed pack and "
                "the 2:4 view are made inside a training call (the extension's pack_in_call), not by refresh_packs"
            )
        return [
            self.src.data_ptr(),
            self.dst.data_ptr(),
            self.dst.numel(),
            self.rows,
            self.groups,
            self.steps,
            first_block,
            self.kind | _DTYPES[self.src.dtype] << 32,
            _DTYPES[self.dst.dtype],
        ]


def kept_index_of(sel: Tensor, sel_columns: Tensor | None, rows: int, cols: int, v: int, m: int) -> Tensor:
    """The flat position in the ``(rows, cols)`` matrix of every kept value (int64, ``(rows, 2 cols / m)``) from the
    positions' on-disk form (:func:`hf_sparse.nn.compact.positions`), decoded by the format's own :func:`kept_index`:
    the reference of the extension's ``gather_kept`` / ``scatter_kept``, and what :func:`source_index` starts from."""
    if sel_columns is None:
        tensors, pattern = {"weight_indices": sel}, NM(2, 4)
    else:
        tensors, pattern = {"weight_selectors": sel, "weight_columns": sel_columns}, VNM(v, 2, m)
    return kept_index(tensors, pattern, (rows, cols)).view(rows, -1)


def source_index(e: RefreshEntry) -> Tensor:
    """Where each slot of a ``TRANSPOSED`` or ``VIEW24`` entry's ``dst`` reads ``src`` (flat), -1 for a zero: the
    torch-op reference of the extension's ``transposed_source`` / ``view24_source``."""
    rows, two_g = e.src.shape
    cols = two_g // 2 * e.m
    kept = kept_index_of(e.sel, e.columns, rows, cols, e.v, e.m).view(-1)
    where = torch.full((rows * cols,), -1, dtype=torch.int64, device=e.src.device)
    where[kept] = torch.arange(kept.numel(), device=e.src.device)
    where = where.view(rows, cols)
    if e.kind == TRANSPOSED:
        where = where.t()
    r, c = where.shape
    groups4 = where.reshape(r, c // 4, 4)
    slots, _ = _first_k_true(groups4 >= 0, 2)  # the pack's selectors: kept offsets, padded, in increasing order
    source = groups4.gather(-1, slots).reshape(r, c // 2)  # -1 at a padding offset
    return values_to_kernel(source + 1, torch.int64).view(-1) - 1  # the layout's padding reads zero too


def run_refresh_entries(entries) -> None:
    """Write ``entries`` with torch ops, one entry after the other (the reference of :func:`launch_refresh`)."""
    with torch.no_grad():
        for e in entries:
            if e.kind == PACK:
                values = e.dst.view(-1, e.steps, 32, 8)
                _fill(values, e.src.detach(), _pieces(e.rows, e.groups), e.groups)
            elif e.kind in (TRANSPOSED, VIEW24):
                index = source_index(e)
                values = e.src.detach().reshape(-1).index_select(0, index.clamp(min=0))
                e.dst.view(-1).copy_(torch.where(index >= 0, values, 0))
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
