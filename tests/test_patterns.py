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


@pytest.mark.parametrize(
    "text, read, valid",
    [
        ("2:4:8", "v=2", "multiple of 4"),
        ("6:2:8", "v=6", "multiple of 4"),
        ("1:1", "m=1", "[2, 256]"),
        ("4:4", "n=4", "[1, m-1=3]"),
        ("64:8:8", "n=8", "[1, m-1=7]"),
        ("unstructured:0", "sparsity 0.0", "(0, 1)"),
        ("unstructured:1", "sparsity 1.0", "(0, 1)"),
    ],
)
def test_patterns_that_prune_nothing_or_are_typos_are_rejected(text, read, valid):
    with pytest.raises(PatternError) as info:
        parse_pattern(text)
    assert read in str(info.value) and valid in str(info.value)


@pytest.mark.parametrize("spec", ["2:8", "64:2:8", "128:2:16", "4:2:16"])
def test_unquoted_yaml_number_names_the_pattern_to_quote(spec):
    yaml = pytest.importorskip("yaml")
    number = yaml.safe_load(f"pattern: {spec}")["pattern"]  # YAML 1.1: base 60
    assert isinstance(number, int)
    with pytest.raises(PatternError) as info:
        parse_pattern(number)
    assert f"got int {number}" in str(info.value) and f'quote the pattern, e.g. pattern: "{spec}"' in str(info.value)
    assert parse_pattern(yaml.safe_load(f'pattern: "{spec}"')["pattern"]) == parse_pattern(spec)


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
