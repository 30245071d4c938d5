"""CPU: the sparse-wgmma SpMMs' tile choices in ``csrc/tile_config.h`` (the persistent configurations and their split,
the few-token tiles and the split-K count), compiled on their own with the host compiler, against hand-computed choices."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"

# (rows_padded, tokens, SMs) -> config above 512 tokens (sm90_large_config): 20 = 128 x 256 tiles, 27 = 128 x 192,
# 23 = 128 x 128. fill = tiles / (rounds * SMs) for each token tile; 20 unless 256 fills < 85% and 192 or 128 fills
# > 10 points better; then 27 unless 128 fills > 2 points better than 192.
CASES = [
    # 6 row blocks x 32 token tiles = 192 tiles: 73% of 2 rounds; 192: 258 tiles 98%; 128: 384 tiles 97% -> 27
    ((768, 8192, 132), 27),
    # 32 x 2 = 64 tiles: 48%; 192: 64 tiles 48%; 128: 96 tiles 73% -> 23
    ((4096, 300, 132), 23),
    # 32 x 32 = 1024 tiles: 97% of 8 rounds -> 20
    ((4096, 8190, 132), 20),
    # 32 x 17 = 544 tiles: 82% of 5 rounds; 192: 704 tiles 89%; 128: 1056 tiles 100% -> 23
    ((4096, 4100, 132), 23),
    # 114 SMs: 192 tiles 84% of 2 rounds; 192: 258 tiles 75% of 3; 128: 384 tiles 84% of 4: none 10 points better -> 20
    ((768, 8192, 114), 20),
]

# (rows_padded, tokens, k-tiles, SMs) -> (config, splits) of the persistent plan (sm90_large_plan). Splits: only where
# the configuration's tiles leave half the SMs or more idle, then SMs // tiles, at most k-tiles // 16 and 16, as many
# as the k-tiles per split (rounded up) need. Up to 512 tokens the configuration with the least ceil(units / SMs) x
# (tile tokens + 64) x (k-tiles per split + 3 x (splits + 1) where split), the larger tile on a tie; above, CASES.
LARGE_PLAN_CASES = [
    # 28672 -> 8192 at 192 tokens (64 row blocks): 256: 64 x 2 splits, 1 x 320 x (224 + 9); 192: 64 x 2,
    # 1 x 256 x 233; 128: 128 tiles, unsplit, 1 x 192 x 448 -> 27 in 2
    ((8192, 192, 448, 132), (27, 2)),
    # 28672 -> 8192 at 256 tokens: 256: 64 x 2, 320 x 233 = 74560; 192: 128 tiles, 256 x 448; 128: 128 tiles,
    # 192 x 448 = 86016 -> 20 in 2 (without the 64 per k-tile, 128 x 448 would beat 256 x 233)
    ((8192, 256, 448, 132), (20, 2)),
    # 13824 -> 5120 at 192 tokens (40 row blocks, 216 k-tiles): 192: 40 x 3 splits (132 // 40), 256 x (72 + 12);
    # 256: 40 x 3, 320 x 84; 128: 80 tiles, unsplit, 192 x 216 -> 27 in 3
    ((5120, 192, 216, 132), (27, 3)),
    # 4096 -> 4096 at 256 tokens (32 row blocks, 64 k-tiles): 256: 32 x 4 (64 // 16), 320 x (16 + 15) = 9920; 192:
    # 64 x 2, 256 x (32 + 9); 128: 64 x 2, 192 x 41 = 7872 -> 23 in 2 (without the split-K sum, 20 in 4: 320 x 16)
    ((4096, 256, 64, 132), (23, 2)),
    # 4096 -> 4096 at 80 tokens: every configuration 32 tiles x 4 splits of 16 -> 23 in 4
    ((4096, 80, 64, 132), (23, 4)),
    # 100 SMs, 128 tokens: every configuration 32 tiles x 3 (100 // 32) splits of 22 -> 23 in 3
    ((4096, 128, 64, 100), (23, 3)),
    ((4096, 128, 20, 132), (23, 1)),  # 20 k-tiles: fewer than 2 x 16, never split
    # 8192 -> 28672 at 256 tokens (224 row blocks): no configuration leaves half the SMs idle; 256: 2 x 320 x 128;
    # 192: 448 tiles, 4 x 256 x 128; 128: 448 tiles, 4 x 192 x 128 -> 20
    ((28672, 256, 128, 132), (20, 1)),
    # 8192 -> 28672 at 144 tokens: 256: 2 x 320; 192: 224 tiles, 2 x 256; 128: 448 tiles, 4 x 192 -> 27
    ((28672, 144, 128, 132), (27, 1)),
    # 5120 -> 13824 at 96 tokens (108 row blocks, unsplit): 128: 1 x 192; 192: 1 x 256; 256: 1 x 320 -> 23
    ((13824, 96, 80, 132), (23, 1)),
    # one row block at 256 tokens, 64 k-tiles: 256: 1 tile x 4, 1 x 320 x 31; 192: 2 x 4, 1 x 256 x 31; 128: 2 x 4,
    # 1 x 192 x 31 -> 23 in 4
    ((128, 256, 64, 132), (23, 4)),
    # one row block at 129 tokens, 2 k-tiles (never split): 256: 1 tile, 1 x 320 x 2; 192: 1 tile, 1 x 256 x 2; 128: 2
    # tiles, 1 x 192 x 2 -> 23 (the tokens past the last count as a tile's own: neither kernel loads them)
    ((128, 129, 2, 132), (23, 1)),
    # 8192 -> 28672 at 300 tokens: 256: 448 tiles, 4 x 320 x 128; 192: 448 tiles, 4 x 256 x 128; 128: 672 tiles,
    # 6 x 192 x 128 -> 27 (the fill rule, above 512 tokens, would take 20: no tile fills 10 points better than 85%)
    ((28672, 300, 128, 132), (27, 1)),
    # one row block at 8192 tokens: the fill rule's 23 (64 tiles of 128 tokens), 2 splits
    ((128, 8192, 64, 132), (23, 2)),
]

# (tiles, k_tiles, SMs, CTAs per SM) -> splits: the count with the least ceil(tiles x splits / (SMs x CTAs per SM)) x
# (k-tiles per split + 4), fewer on a tie, at most 16 and at most k_tiles // 4, then as many as the k-tiles per split
# (rounded up) need, so that no split is empty.
SPLIT_CASES = [
    # 4096 rows (32 tiles) x K 11008 (172 k-tiles), 132 SMs x 2: 8 splits, 1 x (22 + 4) = 26; 16: 2 x (11 + 4) = 30
    ((32, 172, 132, 2), 8),
    ((86, 64, 132, 2), 3),  # 11008 rows x K 4096: 3: 1 x (22 + 4) = 26; 6: 2 x (11 + 4) = 30; 4: 2 x (16 + 4) = 40
    ((224, 64, 132, 2), 1),  # 28672 rows: 1: 1 x 68; 2: 2 x 36; 3: 3 x 26
    ((2, 65, 132, 2), 13),  # one round at any count: 16 wanted (65 // 4 = 16 allowed): 5 k-tiles per split, 13 splits
    ((2, 10, 132, 2), 2),  # 10 k-tiles // 4 = 2 splits of 5
    ((1, 3, 132, 2), 1),  # fewer than 2 x 4 k-tiles: never split
    ((5000, 64, 132, 2), 1),  # more tiles than arrival counters (4096): never split
    ((2, 65, 132, 1), 13),  # one CTA per SM: the same
    ((5000, 64, 132, 1), 1),
]
# The same with the V:2:M kernel's minimum of 2 k-tiles per split
VNM_SPLIT_CASES = [
    # 4096 rows x K 4096 at M = 16 (16 k-tiles), 132 SMs x 3: one round at any count, 16 // 2 = 8
    ((32, 16, 132, 3), 8),
    ((32, 64, 132, 3), 11),  # 64 k-tiles (K 8192 at M = 8): 11 splits of 6, 1 x 10; 16 of 4, 2 x 8
    ((2, 3, 132, 3), 1),  # fewer than 2 x 2 k-tiles: never split
    # 8192 -> 28672 at M = 16, 1-16 tokens: 224 tiles x 32 k-tiles on 396 slots: 1: 1 x 36 (57% of the slots busy);
    # 2: 2 x 20; 3: 2 x 15 -> 3
    ((224, 32, 132, 3), 3),
    # the same at 17-32 tokens, 448 tiles: 1: 2 x 36; 2: 3 x 20; 3: 4 x 15; 4: 5 x 12 -> 2 (a tie of 2, 3, 4: fewer)
    ((448, 32, 132, 3), 2),
    # M = 8 (64 k-tiles), 1-16 tokens: 1: 68; 3: 2 x 26; 4: 3 x 20; 5: 3 x 17 = 51 -> 5
    ((224, 64, 132, 3), 5),
    # 5120 -> 13824 at 17-32 tokens, M = 8: 216 tiles x 40 k-tiles: 1: 1 x 44; 2: 2 x 24; 3: 2 x 18 -> 3
    ((216, 40, 132, 3), 3),
    # 4096 -> 11008 at 33-64 tokens, M = 8, the 32-token tile (two CTAs per SM): 172 tiles x 32 k-tiles on 264
    # slots: 1: 36; 2: 2 x 20; 3: 1.95 rounds, 2 x 15 -> 3
    ((172, 32, 132, 2), 3),
    # One CTA per SM. 13824 -> 5120 at M = 8, 256 tokens: 80 tiles x 108 k-tiles; 1: 1 x 112, 2: 2 x 58, 3: 2 x 40,
    # 4: 3 x 31, 6: 4 x 22, 8: 5 x 18 -> 3
    ((80, 108, 132, 1), 3),
    # 4096 -> 4096 at M = 16, 64 tokens: 32 tiles x 16 k-tiles; 1: 20, 2: 12, 3: 10, 4: 8, 6: 2 x 7, 8: 2 x 6 -> 4
    ((32, 16, 132, 1), 4),
    # 8192 -> 28672 at M = 8, 128 tokens: 224 tiles x 64 k-tiles; 1: 2 x 68, 2: 4 x 36, 4: 7 x 20 -> 1
    ((224, 64, 132, 1), 1),
    ((1, 3, 132, 1), 1),  # fewer than 2 x 2 k-tiles: never split
]
# The 2:4 few-token 64-token tile's minimum of 16 k-tiles per split (two CTAs per SM)
WIDE_SPLIT_CASES = [
    ((32, 64, 132, 2), 4),  # 4096 rows x K 4096 at 17-64 tokens: 264 // 32 = 8 wanted, 64 // 16 = 4 allowed
    ((40, 216, 132, 2), 6),  # 5120 rows x K 13824: 264 // 40 = 6 (13 allowed)
    ((1, 31, 132, 2), 1),  # fewer than 2 x 16 k-tiles: never split
]
# (rows_padded, tokens, k-tiles, SMs) -> few-token tile width in tokens (0: a persistent configuration): 16 up to 16
# tokens, 64 up to 64, and the persistent configurations above, whatever the shape.
SMALL_CASES = [
    ((4096, 1, 64, 132), 16),
    ((4096, 16, 64, 132), 16),
    ((4096, 17, 64, 132), 64),
    ((8192, 64, 128, 132), 64),
    ((4096, 64, 64, 132), 64),
    ((28672, 64, 448, 132), 64),
    ((28672, 65, 128, 132), 0),
    ((11008, 80, 64, 132), 0),
    ((8192, 95, 448, 132), 0),
    ((128, 200, 4, 132), 0),
    ((4096, 257, 64, 132), 0),
    # 65-192 tokens: the 128-token few-token tile where the persistent plan splits 3 or more ways into at most 66 units
    # and the few-token plan's splits sum with the shared sum
    ((1024, 96, 128, 132), 128),  # 8192 -> 1024: persistent 8 tiles x 8 splits = 64 units; 8 x 16 = 128 CTAs
    ((1024, 192, 64, 132), 128),  # 4096 -> 1024: 16 tiles x 4 = 64 units; 16 x 8 = 128 CTAs
    ((768, 128, 48, 132), 128),  # 3072 -> 768: 6 tiles x 3 = 18 units; 6 x 6 = 36 CTAs
    ((1024, 192, 128, 132), 0),  # 8192 -> 1024 at 192: 16 tiles x 8 = 128 units, more than half the SMs
    ((2048, 96, 32, 132), 0),  # 2048 -> 2048: 16 tiles in 2 splits
    ((1024, 96, 16, 132), 0),  # 1024 -> 1024: 16 k-tiles, unsplit
    ((1024, 256, 64, 132), 0),  # above 192 tokens
]

# (M, tokens, unused) -> tokens per CTA of the V:2:M sparse-wgmma SpMM
VNM_CASES = [
    ((8, 1, 0), 16),
    ((8, 16, 0), 16),
    ((8, 17, 0), 32),
    ((8, 32, 0), 32),
    ((8, 33, 0), 64),  # the chunk gather (M = 8): 64 tokens in two CTAs per SM
    ((8, 64, 0), 64),
    ((8, 65, 0), 128),
    ((16, 1, 0), 16),  # the word gather (M >= 16): 16, 32 or 64 tokens
    ((16, 16, 0), 16),
    ((16, 17, 0), 32),
    ((16, 32, 0), 32),
    ((32, 33, 0), 32),
    ((32, 64, 0), 32),
    ((32, 65, 0), 64),
    ((128, 65, 0), 64),
    ((128, 8192, 0), 64),
]

# (M, tokens, rows, K, V) -> whether the V:2:M sparse-wgmma SpMM takes its X^T path (X transposed): M >= 8, from 65
# tokens and 1024 weight rows (exactly 1024 at V = 64: from 256 tokens, at M = 8 from 512); from 33 tokens at M >= 16
# from 4097 rows or where rows x K >= 2^27 (134M), and at M = 8 where V = 128 and rows x K >= 2^25 (33.5M)
VNM_XT_CASES = [
    ((8, 1024, 1024, 4096, 64), 1),
    ((16, 256, 1024, 8192, 64), 1),  # 1024 rows at V = 64 (8192 -> 1024): from 256 tokens at M >= 16
    ((16, 255, 1024, 8192, 64), 0),
    ((8, 511, 1024, 8192, 64), 0),  # ... and from 512 at M = 8
    ((8, 512, 1024, 4096, 64), 1),
    ((8, 256, 1024, 8192, 128), 1),  # M = 8's 512-token rule for 1024 rows is V = 64's only
    ((8, 65, 1024, 8192, 128), 1),  # at V = 128 from 65 tokens
    ((8, 65, 1088, 8192, 64), 1),  # 1088 rows: from 65 tokens
    ((16, 8192, 11008, 4096, 64), 1),
    ((8, 128, 4096, 4096, 64), 1),
    ((16, 65, 4096, 4096, 64), 1),
    ((8, 64, 4096, 4096, 64), 0),
    ((64, 300, 1023, 4096, 64), 0),
    ((8, 8192, 768, 3072, 64), 0),
    ((4, 8192, 4096, 4096, 64), 0),  # 2:4 has its own kernel
    ((16, 33, 28672, 8192, 64), 1),  # 8192 -> 28672
    ((32, 64, 8192, 28672, 128), 1),
    ((16, 32, 28672, 8192, 64), 0),  # the register gather's 32-token tile
    ((16, 64, 5120, 13824, 64), 1),  # 5120 rows
    ((16, 64, 4096, 11008, 64), 0),  # 4096 rows, 45M weights
    ((16, 64, 4096, 32768, 64), 1),  # 4096 rows, exactly 2^27 weights
    ((16, 64, 4096, 32767, 64), 0),
    ((8, 64, 28672, 8192, 128), 1),  # M = 8: 235M weights at V = 128
    ((8, 64, 28672, 8192, 64), 0),  # at V = 64: the register pipeline's 64-token tile
    ((8, 64, 13824, 5120, 128), 1),  # M = 8, V = 128: 70.8M weights
    ((8, 64, 13824, 5120, 64), 0),  # at V = 64: never
    ((8, 64, 11008, 4096, 128), 1),  # 45M weights
    ((8, 64, 4096, 4096, 128), 0),  # 16.8M weights
    ((8, 33, 4096, 8192, 128), 1),  # exactly 2^25
    ((8, 64, 4095, 8192, 128), 0),
    ((16, 64, 4096, 16384, 128), 0),  # M >= 16 below 4097 rows: 2^27, whatever V
]

# (M, tokens, K, padded rows, SMs) -> whether the V:2:M SpMM runs on the CUDA cores: M >= 8, one CTA per 16 rows
# within 2 per SM, and one token, or 2-4 tokens with K <= 4096 at M = 8 and tokens x K <= 49152 at M >= 16
VNM_GEMV_CASES = [
    ((8, 1, 11008, 4096, 132), 1),  # 256 CTAs in 264 slots
    ((16, 1, 4096, 4224, 132), 1),  # 264: exactly one wave
    ((16, 1, 4096, 4288, 132), 0),
    ((8, 1, 4096, 5120, 132), 0),  # 320 CTAs: a second, partial wave
    ((8, 2, 4096, 4096, 132), 1),
    ((8, 4, 4096, 4224, 132), 1),
    ((8, 2, 4104, 4096, 132), 0),  # M = 8 past 4096 features: the 16-token tile
    ((8, 3, 11008, 4096, 132), 0),
    ((16, 2, 11008, 4096, 132), 1),
    ((16, 4, 12288, 4096, 132), 1),  # 96 KB of X
    ((16, 4, 12296, 4096, 132), 0),
    ((32, 2, 24584, 4096, 132), 0),
    ((16, 4, 4096, 4352, 132), 0),  # past one wave
    ((8, 5, 4096, 4096, 132), 0),  # five tokens: the 16-token tile
    ((4, 1, 4096, 4096, 132), 0),  # 2:4 has its own kernel
    ((128, 1, 1024, 192, 132), 1),
]

# (tiles, k-tiles, SMs) -> the V:2:M X^T path's split count (256-token tiles): the least busiest-SM work,
# ceil(tiles x splits / SMs) x (256 + 16) x (k-tiles per split + 3 x (splits + 1) where split), fewer splits on a tie
VNM_XT_SPLIT_CASES = [
    ((32, 43, 132), 4),  # 11008 -> 4096, M = 16, 256 tokens: 1 x 272 x (11 + 15) = 7072 < 3 splits' 7344
    ((32, 32, 132), 3),  # 4096 -> 4096, M = 8: 3 and 4 splits tie at 6256 (2: 6800, 5: two rounds, 13600)
    ((32, 16, 132), 1),  # M = 16: 4352 unsplit, 4624 in 2
    ((192, 224, 132), 2),  # 28672 -> 8192 at 768 tokens: 3 rounds x 272 x (112 + 9) < 2 rounds x 272 x 224
    ((128, 224, 132), 1),  # the same at 512 tokens: one full round unsplit
    ((2752, 32, 132), 1),  # 4096 -> 11008 at 8192 tokens
    ((4097, 448, 132), 1),  # more tiles than split-K counters
    ((32, 3, 132), 1),  # fewer k-tiles than two splits' minimum
]

# (rows, tokens, k-tiles, SMs) -> the X^T path's (tile tokens, splits): at 64 tokens or fewer 64; above, the width (256
# or 128) and split whose busiest SM has the least work, (tile tokens + 16) per k-tile, the wider tile on a tie
VNM_XT_PLAN_CASES = [
    # 64 tokens or fewer: one 64-token tile per row block, split by the same work model. 4160 rows (33 row blocks) x
    # 40 k-tiles at 33 tokens: 1 split 80 x 40 = 3200; 2: 80 x (20 + 9); 3: 80 x (14 + 12); 4: 80 x (10 + 15) = 2000;
    # 5: two rounds, 2 x 80 x (8 + 18) -> 4
    ((4160, 33, 40, 132), (64, 4)),
    # 8192 -> 28672 at 64 tokens, M = 16 (224 row blocks, 32 k-tiles): unsplit, 2 rounds x 80 x 32 = 5120; 2 splits:
    # 4 x 80 x (16 + 9) = 8000 -> 1
    ((28672, 64, 32, 132), (64, 1)),
    ((11008, 512, 32, 132), (128, 1)),  # 256: 172 tiles, 2 x 272 x 32 = 17408; 128: 344 tiles, 3 x 144 x 32 = 13824
    ((11008, 1024, 32, 132), (256, 1)),  # 3 x 272 x 32 = 26112 against 6 x 144 x 32 = 27648
    # 28672 -> 8192 at 256 tokens, M = 8 (64 row blocks, 224 k-tiles): 256 in 2 splits, 272 x (112 + 9) = 32912;
    # 128 unsplit, 144 x 224 = 32256 (in 2: 2 rounds x 144 x 121)
    ((8192, 256, 224, 132), (128, 1)),
    # 13824 -> 5120 at 256 tokens, M = 8 (40 row blocks, 107 k-tiles): 256 in 3 splits, 120 units, 272 x (36 + 12) =
    # 13056 (2: 272 x 63; 4: 2 rounds); 128 unsplit, 80 tiles, 144 x 107 = 15408 (in 2: 2 rounds x 144 x 63)
    ((5120, 256, 107, 132), (256, 3)),
    ((4096, 256, 16, 132), (128, 1)),  # 32 tiles: 272 x 16 = 4352; 64 tiles: 144 x 16 = 2304 (2 splits: 2448)
    ((4096, 72, 16, 132), (128, 1)),  # 32 tiles either way: 272 x 16 = 4352 against 144 x 16 = 2304 (2 splits: 2448)
    ((4096, 256, 32, 132), (128, 2)),  # 128 tiles in 2 splits: 144 x (16 + 9) = 3600 < 4608 unsplit, 6256 at 256
    # 11008 -> 4096, M = 8 (32 row blocks, 86 k-tiles) at 512 tokens: 256, 64 tiles in 2: 272 x (43 + 9) = 14144; 128,
    # 128 tiles unsplit: 144 x 86 = 12384
    ((4096, 512, 86, 132), (128, 1)),
]

# (M, tile tokens, tokens, V) -> whether the X^T path runs its tiles with the deeper ring: 128- and 256-token tiles at
# M = 8, 16, 32 and V < 128, up to 256 tokens
VNM_XT_DEEP_RING_CASES = [
    ((16, 256, 256, 64), 1),
    ((16, 256, 129, 64), 1),
    ((16, 256, 257, 64), 0),  # past 256 tokens (not measured there)
    ((16, 256, 8192, 64), 0),
    ((16, 256, 256, 128), 0),  # V = 128: one B tile feeds both slabs
    ((16, 256, 200, 256), 0),
    ((8, 256, 256, 64), 1),
    ((32, 256, 256, 64), 1),
    ((64, 256, 256, 64), 0),  # M = 64: not measured, not compiled
    ((16, 128, 256, 64), 1),
    ((8, 128, 65, 64), 1),
    ((32, 128, 100, 64), 1),
    ((8, 128, 100, 128), 0),
    ((128, 128, 100, 64), 0),
    ((8, 128, 300, 64), 0),
    ((16, 64, 64, 64), 0),  # the 64-token tile keeps its ring
    ((8, 64, 40, 64), 0),
]

# (M, rows_padded, tokens, k-tiles) -> the V:2:M register pipeline's (tile tokens, splits) on 132 SMs: sm90_vnm_bn's
# tile split by sm90_split_k, except at 17-32 tokens: the 32-token tile (264 slots) or two 16-token tiles (396 slots),
# and at M = 8 and 33-64 tokens: the 64-token tile (264 slots) or two 32-token tiles, whichever's
# ceil(tiles x splits / slots) x (k-tiles per split + 4) is less, that of the 32-token tile x 5/4 at M >= 16, of the
# 64-token tile x 13/8, the narrower on a tie
VNM_PLAN_CASES = [
    # 8192 -> 28672, M = 8, 24 tokens: 32: 224 tiles unsplit, 1 x 68; 16: 448 tiles in 4, 5 x 20 = 100
    ((8, 28672, 24, 64), (32, 1)),
    # 4096 -> 4096, M = 8: 32: 32 tiles in 8, 1 x 8; 16: 64 tiles in 6, 1 x (6 + 4) = 10
    ((8, 4096, 24, 32), (32, 8)),
    # the same at M = 16 (16 k-tiles): 32: in 8, 1 x 6 x 5/4 = 7.5; 16: in 6 (of 3), 1 x 7 -> 16
    ((16, 4096, 24, 16), (16, 6)),
    # 8192 -> 28672, M = 16: 32: 1 x 36 x 5/4 = 45; 16: 448 tiles in 2, 3 x 20 = 60
    ((16, 28672, 24, 32), (32, 1)),
    # 5120 -> 13824, M = 32 (10 k-tiles): 32: 108 tiles in 2, 1 x 9 x 5/4 = 11.25; 16: 216 tiles unsplit, 1 x 14
    ((32, 13824, 17, 10), (32, 2)),
    # 16 tokens: the 16-token tile (8192 -> 28672, M = 8: 224 tiles in 5, 3 x 17)
    ((8, 28672, 16, 64), (16, 5)),
    # 8192 -> 28672 at 48 tokens, M = 8: 64: 224 tiles unsplit (1 x 68 against 2 splits' 2 x 36), 68 x 13/8 = 110.5;
    # 32: 448 tiles unsplit, 2 x 68 = 136
    ((8, 28672, 48, 64), (64, 1)),
    # 4096 -> 11008 at 48 tokens, M = 8: 64: 86 tiles in 3 (1 x 15; 1 x 36 unsplit, 1 x 20 in 2, 2 x 12 in 4),
    # 15 x 13/8 = 24.4; 32: 172 tiles in 3, 2 x 15 = 30
    ((8, 11008, 48, 32), (64, 3)),
    # 4096 -> 4096 at 48 tokens, M = 8: 64: 32 tiles in 8, 1 x 8 x 13/8 = 13; 32: 64 tiles in 4, 1 x 12 -> 32
    ((8, 4096, 48, 32), (32, 4)),
    # 48 tokens at M >= 16: the 32-token tile (8192 -> 28672 at M = 16 below the X^T path's weights: 448 tiles in 264
    # slots; unsplit 2 x 36 against 2 splits' 4 x 20)
    ((16, 28672, 48, 32), (32, 1)),
    # 65 tokens at M = 8: the 128-token tile, one CTA per SM (224 tiles; unsplit 2 x 68 against 4 x 36)
    ((8, 28672, 65, 64), (128, 1)),
    # the grouped-query 8 row blocks, split 16 ways, at two or three CTAs per SM (their splits sum shared):
    # 8192 -> 1024, M = 8, 24 tokens: 32: 8 tiles in 16, 1 x (4 + 4) = 8; 16: 16 tiles in 16 (256 CTAs, 396 slots),
    # 1 x 8: a tie, the narrower
    ((8, 1024, 24, 64), (16, 16)),
    # 4096 -> 1024, M = 8, 48 tokens: 64: 8 tiles in 16, 1 x (2 + 4) x 13/8 = 9.75; 32: 16 tiles in 16 (256 CTAs,
    # 264 slots), 1 x 6
    ((8, 1024, 48, 32), (32, 16)),
    # 8192 -> 1024, M = 16, 48 tokens: the 32-token tile, 16 tiles in 16 (1 x 6 against 8 splits' 1 x 8)
    ((16, 1024, 48, 32), (32, 16)),
    # 3072 -> 768, M = 8, 24 tokens: 16: 12 tiles in 12 (144 CTAs), 1 x (2 + 4); 32: 6 tiles in 12, 1 x 6: a tie
    ((8, 768, 24, 24), (16, 12)),
]

# (rows_padded, tokens, k-tiles, SMs) -> (tile tokens, splits) of the few-token tiles (sm90_small_plan): splits of at
# least 16 k-tiles for the 64-token tile (4 for the 16-token one), with 2 CTA slots per SM, ceil(tiles x splits / 264)
# x (k-tiles per split + 4) the least; the 64-token tile in splits of at least 8 k-tiles where that gives more splits
# and tiles x splits <= 2 x SMs (the shared sum).
SMALL_PLAN_CASES = [
    # 8192 -> 1024 at 64 tokens, 8 tiles: 8 splits of 16 (1 x 20); of 8: 16 splits (1 x 12), 128 CTAs -> 16
    ((1024, 64, 128, 132), (64, 16)),
    # 4096 -> 1024 at 32 tokens: 4 splits of 16; of 8: 8 splits, 64 CTAs -> 8
    ((1024, 32, 64, 132), (64, 8)),
    # 4096 -> 4096 at 64 tokens, 32 tiles: 4 splits of 16; of 8: 8 splits, 256 CTAs, within the 264 resident -> 8
    ((4096, 64, 64, 132), (64, 8)),
    # 12288 rows at 64 tokens, 96 tiles of 64 k-tiles: 2 splits of 32 (1 round of 36 against 3 splits' 2 of 26); of 8:
    # 5 splits (2 rounds of 13 + 4), but 480 CTAs, past the 264 resident -> 2
    ((12288, 64, 64, 132), (64, 2)),
    # 11008 -> 4096 at 64 tokens: 8 splits of 22 either way (9 or more take two rounds) -> 8
    ((4096, 64, 172, 132), (64, 8)),
    # the 16-token tile: splits of at least 4, 8 tiles x 16 in one round -> 16
    ((1024, 16, 128, 132), (16, 16)),
]

# (tiles, splits, slots: SMs x CTAs per SM resident) -> whether a split launch of non-persistent CTAs sums with the
# chunked shared sum (sm90_split_sum_shared): split, and tiles x splits at most the slots (every split of a tile
# resident at once).
SHARED_SUM_CASES = [
    ((8, 16, 132), 1),  # 8192 -> 1024, V:2:M 128-token tile in 16 splits: 128 CTAs, one per SM
    ((8, 8, 132), 1),  # 8192 -> 1024, 2:4 64-token tile in 8 splits
    ((33, 4, 132), 1),  # exactly one CTA per SM
    ((32, 8, 264), 1),  # 4096 rows, 2:4 16-token tile in 8 splits: 256 CTAs, two per SM resident
    ((32, 11, 396), 1),  # 4096 rows, V:2:M 16-token tile in 11 splits: 352 CTAs, three per SM resident
    ((32, 8, 132), 0),  # the same 256 CTAs where one per SM is resident: the last split sums
    ((96, 5, 264), 0),  # 12288 rows in 5 splits: 480 CTAs, past the 264 resident
    ((34, 4, 132), 0),  # one CTA over
    ((100, 1, 132), 0),  # unsplit: no sum
    ((0, 4, 132), 0),
]

PROGRAM = r"""
#include <cstdio>
#include "tile_config.h"
int main(int argc, char** argv) {
  char fn;
  long long a, b, c, d, e;
  while (std::scanf(" %c %lld %lld %lld %lld %lld", &fn, &a, &b, &c, &d, &e) == 6) {
    if (fn == 'L') std::printf("%d\n", hf_sparse::sm90_large_config(a, b, (int)c));
    if (fn == 'S') std::printf("%d\n", hf_sparse::sm90_split_k(a, b, (int)c, (int)d));
    if (fn == 'T') std::printf("%d\n", hf_sparse::sm90_split_k(a, b, (int)c, (int)d, hf_sparse::kVnmSplitMinKTiles));
    if (fn == 'W')
      std::printf("%d\n", hf_sparse::sm90_split_k(a, b, (int)c, (int)d, hf_sparse::sm90_small_min_k_tiles(64)));
    if (fn == 'B') {
      const hf_sparse::Sm90Sparse24Plan p = hf_sparse::sm90_sparse24_plan(a, b, c, (int)d);
      std::printf("%d\n", p.few_token ? p.split.bn : 0);
    }
    if (fn == 'Q') {
      const hf_sparse::Sm90SplitPlan p = hf_sparse::sm90_small_plan(a, b, c, (int)d);
      std::printf("%d %d\n", p.bn, p.splits);
    }
    if (fn == 'V') std::printf("%d\n", hf_sparse::sm90_vnm_bn((int)a, b));
    if (fn == 'X') std::printf("%d\n", hf_sparse::sm90_vnm_xt((int)a, b, (int)c, d, (int)e) ? 1 : 0);
    if (fn == 'G') std::printf("%d\n", hf_sparse::sm90_vnm_gemv((int)a, b, c, d, (int)e) ? 1 : 0);
    if (fn == 'Y') std::printf("%d\n", hf_sparse::sm90_vnm_xt_split_k(a, b, (int)c));
    if (fn == 'H') std::printf("%d\n", hf_sparse::sm90_split_sum_shared(a, (int)b, c) ? 1 : 0);
    if (fn == 'D') std::printf("%d\n", hf_sparse::sm90_vnm_xt_deep_ring((int)a, (int)b, c, (int)d) ? 1 : 0);
    if (fn == 'Z') {
      const hf_sparse::Sm90SplitPlan p = hf_sparse::sm90_vnm_xt_plan(a, b, c, (int)d);
      std::printf("%d %d\n", p.bn, p.splits);
    }
    if (fn == 'R') {
      const hf_sparse::Sm90SplitPlan p = hf_sparse::sm90_vnm_plan((int)a, b, c, d, 132);
      std::printf("%d %d\n", p.bn, p.splits);
    }
    if (fn == 'P') {
      const hf_sparse::Sm90LargePlan p = hf_sparse::sm90_large_plan(a, b, c, (int)d);
      std::printf("%d %d\n", p.config, p.split.splits);
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def chooser(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler")
    folder = tmp_path_factory.mktemp("tile_choice")
    (folder / "main.cpp").write_text(PROGRAM)
    exe = folder / "choose"
    subprocess.run([cxx, "-std=c++17", f"-I{CSRC}", str(folder / "main.cpp"), "-o", str(exe)], check=True)
    return exe


def _choose(chooser, fn: str, cases) -> list[int]:
    stdin = "".join(f"{fn} {' '.join(str(v) for v in (*args, 0, 0)[:5])}\n" for args, _ in cases)
    out = subprocess.run([str(chooser)], input=stdin, capture_output=True, text=True, check=True).stdout.split()
    return [int(c) for c in out]


def _choose_pairs(chooser, fn: str, cases) -> list[tuple[int, int]]:
    """``_choose`` for the choosers that print two numbers a case (a plan: width or configuration, and splits)."""
    got = _choose(chooser, fn, cases)
    return list(zip(got[::2], got[1::2], strict=True))


def test_sm90_large_config_matches_hand_computed_choices(chooser):
    assert _choose(chooser, "L", CASES) == [expected for _, expected in CASES]


def test_split_k_count_matches_hand_computed_choices(chooser):
    assert _choose(chooser, "S", SPLIT_CASES) == [expected for _, expected in SPLIT_CASES]
    assert _choose(chooser, "T", VNM_SPLIT_CASES) == [expected for _, expected in VNM_SPLIT_CASES]
    assert _choose(chooser, "W", WIDE_SPLIT_CASES) == [expected for _, expected in WIDE_SPLIT_CASES]


def test_persistent_plan_matches_hand_computed_choices(chooser):
    assert _choose_pairs(chooser, "P", LARGE_PLAN_CASES) == [expected for _, expected in LARGE_PLAN_CASES]


def test_few_token_tiles_match_hand_computed_choices(chooser):
    assert _choose(chooser, "B", SMALL_CASES) == [expected for _, expected in SMALL_CASES]


def test_vnm_token_tiles_match_hand_computed_choices(chooser):
    assert _choose(chooser, "V", VNM_CASES) == [expected for _, expected in VNM_CASES]


def test_vnm_register_pipeline_plan_matches_hand_computed_choices(chooser):
    assert _choose_pairs(chooser, "R", VNM_PLAN_CASES) == [expected for _, expected in VNM_PLAN_CASES]


def test_vnm_large_token_path_matches_hand_computed_choices(chooser):
    assert _choose(chooser, "X", VNM_XT_CASES) == [expected for _, expected in VNM_XT_CASES]


def test_vnm_gemv_matches_hand_computed_choices(chooser):
    assert _choose(chooser, "G", VNM_GEMV_CASES) == [expected for _, expected in VNM_GEMV_CASES]


def test_vnm_xt_plan_matches_hand_computed_choices(chooser):
    assert _choose_pairs(chooser, "Z", VNM_XT_PLAN_CASES) == [expected for _, expected in VNM_XT_PLAN_CASES]


def test_vnm_xt_split_matches_hand_computed_choices(chooser):
    assert _choose(chooser, "Y", VNM_XT_SPLIT_CASES) == [expected for _, expected in VNM_XT_SPLIT_CASES]


def test_vnm_xt_deep_ring_matches_hand_computed_choices(chooser):
    assert _choose(chooser, "D", VNM_XT_DEEP_RING_CASES) == [expected for _, expected in VNM_XT_DEEP_RING_CASES]


def test_shared_split_sum_rule_matches_hand_computed_choices(chooser):
    assert _choose(chooser, "H", SHARED_SUM_CASES) == [expected for _, expected in SHARED_SUM_CASES]


def test_few_token_plan_matches_hand_computed_choices(chooser):
    assert _choose_pairs(chooser, "Q", SMALL_PLAN_CASES) == [expected for _, expected in SMALL_PLAN_CASES]
