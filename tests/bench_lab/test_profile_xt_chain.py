"""CPU: the byte model and kernel-name parsing of ``benchmarks/profile_xt_chain.py``, whose bounds on the V:2:M X^T
path (benchmarks/RESULTS.md, runs N1-N5) rest on them. The expected byte counts are ncu's measured L2 -> SM reads
(``l1tex__m_xbar2l1tex_read_bytes.sum``, run N3: one launch at 4096 -> 11008, 8192 tokens), not the model's output."""

from __future__ import annotations

import pytest
from profile_xt_chain import feed_bytes, tile_tokens

ROWS, TOKENS = 11008, 8192
Y_BYTES = ROWS * TOKENS * 2  # the model adds Y's writes; ncu's count is reads only


@pytest.mark.parametrize(
    ("k_tiles", "ncu_read_bytes"),
    [
        (32, 3.71e9),  # 128:2:8 on the X^T path: 4096 columns, 2048 condensed, 32 k-tiles of 64
        (64, 7.39e9),  # 2:4 (configuration 20): 4096 columns, 64 k-tiles
    ],
)
def test_feed_bytes_match_what_ncu_counted(k_tiles, ncu_read_bytes):
    reads = feed_bytes(ROWS, TOKENS, k_tiles, 256, 1) - Y_BYTES
    assert reads == pytest.approx(ncu_read_bytes, rel=0.01)


def test_feed_bytes_count_the_b_tile_twice_where_slabs_keep_their_own_columns():
    one, two = feed_bytes(4096, 1024, 8, 256, 1), feed_bytes(4096, 1024, 8, 256, 2)
    tiles = 32 * 4
    assert two - one == tiles * 8 * 256 * 64 * 2  # one more 32 KB B tile per tile and k-tile


def test_tile_tokens_reads_the_widths_from_the_kernels_names():
    xt = "void hf_sparse::(anonymous namespace)::spmm_vnm_sm90_xt_kernel<__nv_bfloat16, 8, 256>(const T1 *, int)"
    tma = (
        "void hf_sparse::(anonymous namespace)::spmm_sm90_tma_a_kernel<__nv_bfloat16, 128, 4, 1, 1, 0, 64, 2, 0, 1, 1,"
        " 0, 0>(CUtensorMap_st, CUtensorMap_st)"
    )
    assert tile_tokens(xt, xt=True) == 256
    assert tile_tokens(xt.replace("8, 256", "16, 128"), xt=True) == 128
    assert tile_tokens(tma, xt=False) == 128
    with pytest.raises(RuntimeError, match="no template arguments"):
        tile_tokens("at::native::elementwise_kernel", xt=False)
