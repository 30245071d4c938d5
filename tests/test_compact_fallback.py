"""Never slower than dense, the parts that need no Trainer: the decision from hand-written timings, the inverse switch
(compact -> masked dense, optimizer state scattered back) and the fallback's config fields. The Trainer runs through
the comparison are in ``tests/test_compact_switch.py``."""

from __future__ import annotations

import math
import time

import pytest
import torch
from conftest import random_ids, tiny_config
from helpers import prune_now, torch_compile_runs
from transformers import AutoModelForSequenceClassification
from transformers.pytorch_utils import Conv1D

from hf_sparse import SparseLinear, SparsityConfig, compaction
from hf_sparse.compact_fallback import CompactFallback, choose_path
from hf_sparse.compaction import make_compact, make_dense
from hf_sparse.nn.compact import sure_saving_ms


@pytest.mark.parametrize(
    "compact_ms, dense_ms, margin, expected",
    [
        (100.0, 80.0, 0.03, "dense"),  # dense 20 % faster
        (100.0, 96.0, 0.03, "dense"),  # 4 % faster: beyond the 3 % margin
        (100.0, 98.0, 0.03, "compact"),  # 2 % faster: noise, the compact layers (less memory) stay
        (100.0, 100.0, 0.03, "compact"),
        (80.0, 100.0, 0.03, "compact"),
        (100.0, 99.5, 0.0, "dense"),  # no margin: strictly faster wins
        (100.0, 80.0, 0.25, "compact"),
        (None, 80.0, 0.03, "compact"),  # a path that could not be timed: keep compact
        (100.0, None, 0.03, "compact"),
    ],
)
def test_choose_path_keeps_the_faster_beyond_the_noise_margin(compact_ms, dense_ms, margin, expected):
    assert choose_path(compact_ms, dense_ms, margin) == expected


@pytest.mark.parametrize(
    "args, message",
    [((-1.0, 5.0), "compact_ms=-1.0"), ((5.0, math.nan), "dense_ms=nan"), ((5.0, math.inf), "dense_ms=inf")],
)
def test_choose_path_refuses_times_that_are_not_times(args, message):
    with pytest.raises(ValueError, match=message):
        choose_path(*args)
    with pytest.raises(ValueError, match="margin=1.0"):
        choose_path(5.0, 4.0, margin=1.0)


def test_fallback_config_fields_validate_and_round_trip():
    config = SparsityConfig(score="magnitude", compact_fallback="always", compact_fallback_steps=3)
    assert SparsityConfig.from_dict(config.to_dict()) == config
    assert (
        SparsityConfig(score="magnitude").compact_fallback == "auto"
        and SparsityConfig(score="magnitude").compact_fallback_steps == 10
    )
    with pytest.raises(ValueError, match=r"compact_fallback='sometimes': allowed 'auto'"):
        SparsityConfig(score="magnitude", compact_fallback="sometimes")
    for steps in (0, True, 2.0):
        with pytest.raises(ValueError, match=r"compact_fallback_steps=.*must be an int >= 1"):
            SparsityConfig(score="magnitude", compact_fallback_steps=steps)
    with pytest.raises(ValueError, match="did you mean 'compact_fallback'"):
        SparsityConfig.from_dict({"compact_fallbak": "never"})


def _logical(module, tensor):
    return tensor.T if isinstance(module, Conv1D) else tensor


def _compact_step(family: str, optim):
    """A tiny model pruned at 2:4, made compact, with one optimizer step taken on the compact layers."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config(family))
    pruner = prune_now(model, "2:4")
    make_compact(model, pruner)
    optimizer = optim(model.parameters())
    model(input_ids=random_ids(), labels=torch.tensor([0, 1, 2])).loss.backward()
    optimizer.step()
    return model, pruner, optimizer


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, fused=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("family", ["bert", "gpt2"])
@pytest.mark.parametrize("optim", list(OPTIMIZERS), ids=list(OPTIMIZERS))
def test_make_dense_scatters_the_optimizer_state_back_and_make_compact_undoes_it(family, optim):
    model, pruner, optimizer = _compact_step(family, OPTIMIZERS[optim])
    before = {}
    for layer in pruner.layers:
        weight = layer.module.weight
        before[layer.name] = (
            weight,
            weight.detach().clone(),
            {k: v.clone() for k, v in optimizer.state[weight].items()},
        )
    assert make_dense(model, pruner, optimizer=optimizer) == [layer.name for layer in pruner.layers]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for layer in pruner.layers:
        module, mask = layer.module, pruner.masks[layer.name]
        old_weight, values, state = before[layer.name]
        assert type(module) is (Conv1D if family == "gpt2" else torch.nn.Linear) and not layer.compact
        assert model.get_submodule(layer.name) is module
        assert any(p is module.weight for p in params) and not any(p is old_weight for p in params)
        assert old_weight not in optimizer.state
        dense = _logical(module, module.weight.detach())
        assert torch.equal(dense[mask], values.reshape(-1)) and not dense[~mask].any()
        moved = optimizer.state[module.weight]
        assert moved.keys() == state.keys()
        for key, value in moved.items():
            if state[key].dim() == 0:  # Adam's step: carried as it is
                assert torch.equal(value, state[key]), key
                continue
            assert value.shape == module.weight.shape and value.is_contiguous(), key  # dense numel
            logical = _logical(module, value)
            assert torch.equal(logical[mask], state[key].reshape(-1)), key  # kept positions: the compact state
            assert torch.equal(logical[~mask], torch.zeros(int((~mask).sum()))), key  # pruned ones: zeros
            assert not torch.signbit(logical[~mask]).any(), key  # +0.0
    make_compact(model, pruner, optimizer)
    for layer in pruner.layers:
        weight = layer.module.weight
        _, values, state = before[layer.name]
        assert isinstance(layer.module, SparseLinear) and torch.equal(weight.detach(), values)
        moved = optimizer.state[weight]
        assert moved.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(moved[key], value) and moved[key].numel() == value.numel(), key  # kept values only


def test_fallback_schedule_and_what_declines_it(caplog):
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    pruner = prune_now(model, "2:4")
    fallback = CompactFallback("always", steps=2, warmup=3)
    fallback.begin_step(0, 100, model, pruner, optimizer=None)
    assert fallback.start is None and fallback.declined is None  # dense layers: nothing to time yet
    make_compact(model, pruner)
    fallback.begin_step(5, 100, model, pruner, optimizer=None)
    assert fallback.start == 5
    assert list(fallback.timed_steps("compact")) == [8, 9] and list(fallback.timed_steps("dense")) == [13, 14]
    assert [fallback.holds_dense(step) for step in range(4, 17)] == [False] * 6 + [True] * 5 + [False] * 2
    auto = CompactFallback("auto", steps=2)
    auto.begin_step(0, 100, model, pruner, optimizer=None)
    assert auto.start is None and auto.declined == "not on CUDA"
    short = CompactFallback("always", steps=2, warmup=3)
    with caplog.at_level("INFO", logger="hf_sparse.compact_fallback"):
        short.begin_step(0, 9, model, pruner, optimizer=None)
    assert short.start is None and "9 optimizer steps are left and the comparison needs 10" in caplog.text


def _compact_bert_with_measured_savings(ms_per_layer: float | None):
    """A tiny BERT whose pruned layers are compact, each with its kernel state (built on the CPU) holding a training
    plan's measured saving of ``ms_per_layer`` (what a CUDA measurement records; None: nothing measured)."""
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    pruner = prune_now(model, "2:4")
    make_compact(model, pruner)
    layers = [layer for layer in pruner.layers if layer.compact]
    for layer in layers:
        kernel = layer.module.kernel_state(torch.bfloat16)
        if ms_per_layer is not None:
            kernel.savings[(64, True)] = ms_per_layer
            kernel.savings[(128, False)] = -100.0  # an inference plan's: not a training saving
    return model, pruner, len(layers)


def test_measured_saving_is_the_layers_training_savings_or_none():
    _, pruner, count = _compact_bert_with_measured_savings(0.25)
    assert compaction.measured_saving_ms(pruner) == pytest.approx(0.25 * count)
    _, unmeasured, _ = _compact_bert_with_measured_savings(None)
    assert compaction.measured_saving_ms(unmeasured) is None


def test_the_optimizer_steps_saving_is_not_measured_off_cuda():
    """The optimizer step's saving is measured on the GPU the layers train on; on the CPU (or without an optimizer)
    there is nothing to measure, and the fallback counts the layers' own savings alone."""
    model, pruner, _ = _compact_bert_with_measured_savings(0.25)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert compaction.optimizer_saving_ms(pruner, optimizer) is None
    assert compaction.optimizer_saving_ms(pruner, None) is None


@pytest.mark.parametrize(
    ("dense", "compact", "sure"),
    [
        ((1.00, 0.30), (0.80, 0.10), 0.20),  # less GPU time and less host work: only the GPU time counts
        ((1.00, 0.10), (0.80, 0.25), 0.05),  # more host work is paid in full
        ((1.00, 0.30), (1.10, 0.05), -0.10),  # more GPU time is a loss, whatever host work it spares
    ],
)
def test_a_layer_surely_saves_its_gpu_time_less_any_host_time_it_adds(dense, compact, sure):
    """A training step waits for the GPU in its backward (and at Trainer's synchronisation after it), so the host
    time a compact layer spares may buy nothing: the saving the fallback trusts to skip the dense phase is GPU time
    saved, less any host time added."""
    assert sure_saving_ms(dense, compact) == pytest.approx(sure)


@pytest.mark.parametrize(("ms_per_layer", "passes", "skips"), [(50.0, 1, True), (0.0, 1, False), (None, 4, False)])
def test_layers_that_measured_a_clear_saving_decide_without_the_dense_phase(caplog, ms_per_layer, passes, skips):
    """After the compact window: where the layers' measured savings exceed the noise margin of the compact step, the
    run decides for the compact layers at once (one log line; the layers stay compact, nothing dense is held); a
    saving within the margin, or none measured, goes on to time the masked dense layers."""
    model, pruner, _ = _compact_bert_with_measured_savings(ms_per_layer)
    fallback = CompactFallback("always", steps=2, warmup=1)
    with caplog.at_level("INFO", logger="hf_sparse.compact_fallback"):
        for step in range(3):
            fallback.begin_step(step, 100, model, pruner, optimizer=None, passes=passes)
            time.sleep(0.01)  # a step: 10 ms, so a 50 ms saving per layer is far beyond 3 % of it, and 0 ms is not
            fallback.end_step(step + 1, False, model, pruner, optimizer=None)
    assert fallback.timings["compact"].steps == 2
    if ms_per_layer is not None:  # what the decision counted: the layers' savings, once per pass
        assert fallback.savings_ms["layers"] == pytest.approx(ms_per_layer * passes * len(pruner.layers))
    compact_now = all(layer.compact for layer in pruner.layers)
    assert (fallback.choice == "compact") == skips and compact_now == skips
    assert [fallback.holds_dense(step) for step in range(3, 6)] == [not skips] * 3
    lines = [r.getMessage() for r in caplog.records if "are not timed" in r.getMessage()]
    assert len(lines) == int(skips)


@pytest.mark.parametrize(("eager_sleep", "winner"), [(0.0, "eager"), (0.04, "compact")])
def test_under_torch_compile_the_compiled_step_is_timed_against_the_eager_one(caplog, eager_sleep, winner):
    """With ``compiled=True`` the schedule's second half runs with torch.compile set aside (compiled functions run
    their Python as written, nothing is recompiled) instead of switching to masked dense layers; the faster wins (one
    log line), the eager stance stays only where eager won, and the end of training brings torch.compile back. The
    layers stay compact throughout."""
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    pruner = prune_now(model, "2:4")
    make_compact(model, pruner)
    fallback = CompactFallback("always", steps=2, warmup=1)
    compiled_at = []
    with caplog.at_level("INFO", logger="hf_sparse.compact_fallback"):
        for step in range(8):
            fallback.begin_step(step, 100, model, pruner, optimizer=None, compiled=True)
            compiled_at.append(torch_compile_runs())
            time.sleep(0.02 if compiled_at[-1] else eager_sleep)  # a compiled step: 20 ms
            fallback.end_step(step + 1, False, model, pruner, optimizer=None)
    assert fallback.rival == "eager" and list(fallback.timed_steps("eager")) == [4, 5]
    assert fallback.timed_steps("dense") == range(0)
    assert compiled_at[:3] == [True] * 3 and compiled_at[3:6] == [False] * 3  # warm-up and timed, each path
    assert compiled_at[6:] == [winner == "compact"] * 2
    assert fallback.choice == winner and fallback.timings["eager"].steps == 2
    assert all(layer.compact for layer in pruner.layers)
    lines = [r.getMessage() for r in caplog.records if "compiled step" in r.getMessage()]
    assert len(lines) == 1 and ("goes on eager" in lines[0]) == (winner == "eager")
    fallback.end_training()
    assert torch_compile_runs()


def test_a_resumed_run_goes_on_eager_where_eager_won():
    """The decision is in the checkpoint: a run resumed after the eager step won runs eager from its first step,
    without timing again; a state without the rival (masked dense layers timed) loads as before."""
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    pruner = prune_now(model, "2:4")
    make_compact(model, pruner)
    timings = {"compact": [50.0, 2], "eager": [30.0, 2]}
    state = {"start": 0, "declined": None, "choice": "eager", "rival": "eager", "timings": timings}
    resumed = CompactFallback("always", steps=2, warmup=1)
    resumed.load_state_dict(state)
    resumed.begin_step(20, 100, model, pruner, optimizer=None, compiled=True)
    try:
        assert not torch_compile_runs() and resumed.timings["eager"].steps == 2
    finally:
        resumed.end_training()
    assert torch_compile_runs()
    legacy = {"start": 0, "declined": None, "choice": "compact", "timings": {"compact": [1.0, 1], "dense": [2.0, 1]}}
    plain = CompactFallback("always", steps=2, warmup=1)
    plain.load_state_dict(legacy)
    assert plain.rival == "dense" and plain.timings["dense"].steps == 1
