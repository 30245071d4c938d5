import pytest

from hf_sparse.patterns import NM, VNM, Unstructured
from hf_sparse.schedules import SchedulePlan, available_schedules


def plan(pattern, schedule="linear", start=0, end=60, every=10, total=100):
    return SchedulePlan.build(pattern, schedule, start, end, every, total)


def test_registered():
    assert {"cubic", "linear", "oneshot"} <= set(available_schedules())


def test_nm_levels_step_down_one_at_a_time_for_2_8():
    p = plan(NM(2, 8), end=60, every=10)
    levels = [p.level(step) for step in range(0, 101)]
    distinct = [x for i, x in enumerate(levels) if i == 0 or x != levels[i - 1]]
    # linear ramp 0 -> 0.75 over 60 steps, updates every 10: targets 0, .125, .25, .375, .5, .625, .75
    assert distinct == [None, 7, 6, 5, 4, 3, 2]
    assert p.level(59) == 3 and p.level(60) == 2 and p.level(100) == 2


def test_quantisation_never_sparser_than_target():
    p = plan(NM(2, 8))
    for target in [0.0, 0.1, 0.124, 0.125, 0.3, 0.74, 0.75]:
        level = p.quantise(target)
        keep = 8 if level is None else level
        assert 1 - keep / 8 <= target + 1e-12
        assert 1 - (keep - 1) / 8 > target or keep == 2


def test_cubic_matches_zhu_gupta():
    p = plan(NM(2, 4), "cubic", start=10, end=50, total=100)
    assert p.target_sparsity(9) == 0
    assert p.target_sparsity(30) == pytest.approx(0.5 * (1 - 0.5**3))
    assert p.target_sparsity(50) == 0.5


def test_fractions_resolve_against_total_steps():
    p = plan(VNM(64, 2, 8), "cubic", start=0.1, end=0.5, every=5, total=200)
    assert (p.start_step, p.end_step) == (20, 100)
    assert p.is_update_step(20) and p.is_update_step(25) and p.is_update_step(100)
    assert not p.is_update_step(21) and not p.is_update_step(101) and not p.is_update_step(19)


def test_oneshot_prunes_at_start():
    p = plan(NM(2, 4), "oneshot", start=5, end=50)
    assert p.level(4) is None and p.level(5) == 2 and p.end_step == 5


def test_vnm_ramp_patterns_nest():
    p = plan(VNM(64, 2, 8))
    assert [str(p.pattern_at(k)) for k in (7, 4, 3, 2)] == ["64:7:8", "64:4:8", "64:3:8", "64:2:8"]
    assert p.pattern_at(5).keep_cols == 5 and p.pattern_at(3).keep_cols == 4


def test_unstructured_is_continuous():
    p = plan(Unstructured(0.8), end=100, every=1)
    assert p.level(50) == pytest.approx(0.4)
