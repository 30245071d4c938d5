"""CPU: the kernel choice (hf_sparse.ops._select) against hand-written expected choices, and force_kernel."""

from __future__ import annotations

import pytest

from hf_sparse.ops import force_kernel
from hf_sparse.ops._select import choose_kernel, device_kernel, forced_kernel

M_VALUES = (4, 8, 16, 32, 64, 128)


@pytest.mark.parametrize(
    ("op", "wgmma_ok", "expected"),
    [
        # SpMM: wgmma at every M where it runs, mma.sp where it cannot
        ("spmm", True, ["wgmma"] * 6),
        ("spmm", False, ["mma_sp"] * 6),
        # SDDMM: wgmma up to M = 32 where it runs, mma.sync at 64 and 128 (not timed) and where it cannot
        ("sddmm", True, ["wgmma", "wgmma", "wgmma", "wgmma", "mma", "mma"]),
        ("sddmm", False, ["mma"] * 6),
    ],
)
def test_automatic_choice(op, wgmma_ok, expected):
    assert [choose_kernel(op, m, wgmma_ok) for m in M_VALUES] == expected
    assert [choose_kernel(op, m, wgmma_ok, "auto") for m in M_VALUES] == expected


@pytest.mark.parametrize(
    ("op", "kernel"), [("spmm", "mma_sp"), ("spmm", "wgmma"), ("sddmm", "mma"), ("sddmm", "wgmma")]
)
def test_forced_choice_wins_everywhere(op, kernel):
    # forced, the kernel runs whatever the group size and whether wgmma can run (the binding refuses it there)
    assert {choose_kernel(op, m, ok, kernel) for m in M_VALUES for ok in (True, False)} == {kernel}


@pytest.mark.parametrize(("op", "bad"), [("spmm", "mma"), ("spmm", "fastest"), ("sddmm", "mma_sp")])
def test_unknown_kernel_names_are_refused(op, bad):
    with pytest.raises(ValueError, match=f"{op}={bad!r}.*use one of"):
        choose_kernel(op, 4, True, bad)
    with pytest.raises(ValueError, match="force_kernel"):
        with force_kernel(**{op: bad}):
            pass
    assert forced_kernel(op) is None


def test_force_kernel_nests_and_restores():
    assert forced_kernel("spmm") is None and forced_kernel("sddmm") is None
    with force_kernel(spmm="wgmma"):
        assert (forced_kernel("spmm"), forced_kernel("sddmm")) == ("wgmma", None)
        with force_kernel(sddmm="mma"):
            assert (forced_kernel("spmm"), forced_kernel("sddmm")) == ("wgmma", "mma")
            with force_kernel(spmm="auto"):
                assert (forced_kernel("spmm"), forced_kernel("sddmm")) == (None, "mma")
        assert (forced_kernel("spmm"), forced_kernel("sddmm")) == ("wgmma", None)
    with pytest.raises(RuntimeError, match="boom"), force_kernel(spmm="mma_sp", sddmm="wgmma"):
        raise RuntimeError("boom")
    assert forced_kernel("spmm") is None and forced_kernel("sddmm") is None


def test_device_choice_without_a_gpu_needs_no_extension():
    # forced, and at group sizes the wgmma kernel is not chosen for, the answer needs no device query or build
    with force_kernel(spmm="mma_sp", sddmm="mma"):
        assert device_kernel("spmm", 16, None) == "mma_sp"
        assert device_kernel("sddmm", 4, None) == "mma"
    assert device_kernel("sddmm", 64, None) == "mma"
