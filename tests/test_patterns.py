import pytest

from hf_sparse.patterns import NM, VNM, PatternError, Unstructured, parse_pattern


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2:4", NM(2, 4)),
        (" 2:8 ", NM(2, 8)),
        ("64:2:8", VNM(64, 2, 8)),
        ("128:2:16", VNM(128, 2, 16)),
        ("unstructured:0.9", Unstructured(0.9)),
        ("UNSTRUCTURED:.5", Unstructured(0.5)),
    ],
)
def test_parse(text, expected):
    assert parse_pattern(text) == expected


@pytest.mark.parametrize(
    "text", ["", "2", "2:4:8:16", "a:b", "5:4", "0:4", "64:2:2", "unstructured:1.5", "unstructured:x", "2:-4", "0:2:8"]
)
def test_parse_rejects(text):
    with pytest.raises(PatternError):
        parse_pattern(text)


def test_error_message_lists_the_valid_forms():
    with pytest.raises(PatternError, match=r"'V:N:M'"):
        parse_pattern("2/4")


def test_sparsity_and_hardware():
    assert NM(2, 4).sparsity == 0.5 and NM(2, 4).sptc_runnable
    assert not NM(1, 4).sptc_runnable and not NM(2, 8).sptc_runnable
    assert VNM(64, 2, 8).sparsity == 0.75 and VNM(64, 2, 8).sptc_runnable
    assert not VNM(32, 2, 8).sptc_runnable
    assert VNM(64, 6, 8).keep_cols == 6 and VNM(64, 2, 8).keep_cols == 4


def test_fit_errors_name_the_dimension():
    assert "out_features=100" in VNM(64, 2, 8).fit_error(100, 64)
    assert "in_features=30" in NM(2, 4).fit_error(8, 30)
    assert NM(2, 4).fit_error(8, 32) is None


def test_str_round_trip():
    for p in [NM(2, 4), VNM(64, 2, 8), VNM(64, 5, 8), Unstructured(0.75)]:
        assert parse_pattern(str(p)) == p
