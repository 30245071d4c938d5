"""Compact layers under DDP and FSDP2, two processes on the CPU (gloo).

Masks final before training (one-shot at step 0): the layers turn compact in ``Trainer.__init__``, before DDP wraps
the model (``SparseTrainer``) or ``fully_shard`` shards it (a manual loop: accelerate does not drive FSDP on the CPU),
so the all-reduce, the shards and the optimizer hold kept values only; the result matches one process on the same
global batch. A gradual schedule under DDP cannot switch mid-run: the run stays masked dense and says why once.
The spawning and batch helpers are those of ``tests/test_distributed.py``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import ToyClassification
from test_distributed import PER_DEVICE, WORLD, _batch, _model, _read_json, _setup_rank, _spawn, _trainer_args
from transformers import TrainerControl, TrainerState, TrainingArguments

from hf_sparse import SparseLinear, SparseTrainer, SparsityCallback, SparsityConfig

STEPS = 4
ONESHOT = SparsityConfig(score="magnitude", pattern="64:2:8", schedule="oneshot", start=0)
GRADUAL = SparsityConfig(score="magnitude", pattern="64:2:8", schedule="cubic", start=0, end=2, update_every=1)


def _train(output_dir, batch: int, config: SparsityConfig) -> SparseTrainer:
    trainer = SparseTrainer(
        model=_model(),
        args=_trainer_args(output_dir, batch, max_steps=STEPS),
        train_dataset=ToyClassification(),
        sparsity_config=config,
    )
    trainer.train()
    return trainer


def _compact_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _fsdp_loop(rank: int, world: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The callback's events around ``fully_shard`` and AdamW, as Trainer orders them: on_init_end (prune, compact)
    before the wrapper, then per step forward/backward, clipping, step."""
    from torch.distributed.fsdp import fully_shard

    from hf_sparse.distributed import gather_full_state_dict

    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    state, control = TrainerState(max_steps=STEPS), TrainerControl()
    model = _model()
    callback = SparsityCallback(ONESHOT)
    callback.on_init_end(args, state, control, model=model)
    seen = {"compact": [type(layer.module).__name__ for layer in callback.pruner.layers]}
    if world > 1:
        for block in model.bert.encoder.layer:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    for step in range(STEPS):
        state.global_step = step
        callback.on_step_begin(args, state, control, model=model, optimizer=optimizer)
        model(**_batch(step, rank, world)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        callback.on_optimizer_step(args, state, control, optimizer=optimizer)
        optimizer.zero_grad()
    layer = callback.pruner.layers[0]
    seen["sharded_values"] = type(layer.module.weight).__name__
    seen["metrics"] = callback.pruner.metrics()
    full = gather_full_state_dict(model) if world > 1 else _compact_state(model)
    return full, seen


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _worker(rank: int, port: int, out: str) -> None:
    _setup_rank(rank, port)
    out = Path(out)
    trainer = _train(out / "oneshot", PER_DEVICE, ONESHOT)
    record = {
        "wrapped": type(trainer.model_wrapped).__name__,
        "compact": all(isinstance(layer.module, SparseLinear) for layer in trainer.pruner.layers),
        "ddp_numel": sum(p.numel() for p in trainer.model_wrapped.parameters()),
    }
    torch.save(_compact_state(trainer.model), out / f"ddp_rank{rank}.pt")
    lines = _Lines()
    logging.getLogger("hf_sparse").addHandler(lines)
    gradual = _train(out / "gradual", PER_DEVICE, GRADUAL)
    record["gradual_compact"] = any(layer.compact for layer in gradual.pruner.layers)
    record["gradual_lines"] = [line for line in lines.lines if "stay dense" in line]
    full, record["fsdp"] = _fsdp_loop(rank, WORLD)
    if rank == 0:
        torch.save(full, out / "fsdp_full.pt")
    (out / f"record_rank{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_compact")
    _spawn(_worker, out)
    single = _train(out / "single", WORLD * PER_DEVICE, ONESHOT)
    return out, single


@pytest.mark.slow
def test_ddp_trains_compact_layers_made_before_wrapping(run):
    out, single = run
    reference = _compact_state(single.model)
    records = [_read_json(out / f"record_rank{r}.json") for r in range(WORLD)]
    assert records[0]["wrapped"] == "DistributedDataParallel" and all(r["compact"] for r in records)
    # DDP all-reduces the compact values: its parameters are the kept values, not the dense weights
    assert records[0]["ddp_numel"] == sum(p.numel() for p in single.model.parameters())
    assert records[0]["ddp_numel"] < sum(p.numel() for p in _model().parameters())
    for rank in range(WORLD):
        final = torch.load(out / f"ddp_rank{rank}.pt")
        assert final.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")


@pytest.mark.slow
def test_mid_run_switch_under_ddp_stays_masked_and_says_why_once(run):
    out, _ = run
    for rank in range(WORLD):
        record = _read_json(out / f"record_rank{rank}.json")
        assert not record["gradual_compact"]
        assert len(record["gradual_lines"]) == 1 and "2 processes" in record["gradual_lines"][0]


@pytest.mark.slow
def test_fsdp2_shards_compact_layers_and_matches_one_process(run):
    out, _ = run
    single_full, single_seen = _fsdp_loop(0, 1)
    records = [_read_json(out / f"record_rank{r}.json")["fsdp"] for r in range(WORLD)]
    assert all(name == "SparseLinear" for r in records for name in r["compact"])
    assert records[0]["sharded_values"] == "DTensor"
    assert records[0]["metrics"]["sparsity"] == pytest.approx(single_seen["metrics"]["sparsity"])
    full = torch.load(out / "fsdp_full.pt")
    assert full.keys() == single_full.keys()
    for key, value in single_full.items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)
