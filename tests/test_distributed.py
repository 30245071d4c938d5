"""Two processes on the CPU (gloo): ``SparseTrainer`` under DDP, and the pruner under FSDP2's ``fully_shard``.

Each scenario spawns two workers once (``torch.multiprocessing``, the environment ``torchrun`` would set); they
write what they saw (per-step mask digests, whether pruned gradients and weights were exactly zero, final weights,
the saved checkpoint) under ``tmp_path``, and the tests compare that with a single process run here on the same
global batch (2 ranks x 4 samples against 1 x 8; no dropout, fp32).

Accelerate does not drive FSDP on the CPU (it falls back to DDP), so the FSDP2 scenario shards the model with
``fully_shard`` itself and drives the real ``SparsityCallback`` from a small loop; ``SparseTrainer``'s FSDP2 path
(gather in ``save_model``) runs the same ``save_pretrained`` code tested here, and is exercised end to end on GPUs.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ToyClassification, tiny_config
from safetensors import safe_open
from transformers import (
    AutoModelForSequenceClassification,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from hf_sparse import Pruner, SparseTrainer, SparsityCallback, SparsityConfig, save_pretrained
from hf_sparse.distributed import full_tensor, gather_full_state_dict, local_part
from hf_sparse.formats.compressed import compress

pytestmark = pytest.mark.slow  # spawning two workers that import transformers: 10-20 s on 2 CPU cores

WORLD = 2
PER_DEVICE = 4
STEPS = 6
PATTERN = "64:2:8"  # V=64 rows: FSDP2 cuts the 128-row FFN weight into two 64-row shards, the 64-row ones in half


# ---------------------------------------------------------------------------------------------------- helpers
def _config() -> SparsityConfig:
    # levels change at steps 2 and 4 (64:3:8, then 64:2:8), so masks are recomputed from trained weights
    # compact=False: the one-process reference stays masked dense, as the DDP run does (no mid-run switch under DDP)
    return SparsityConfig(
        score="magnitude", pattern=PATTERN, schedule="cubic", start=0, end=4, update_every=2, compact=False
    )


def _model(family: str = "bert"):
    config = tiny_config(family)
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config)


def _digest(pruner) -> str | None:
    """One hash over all masks; ``None`` while dense."""
    masks = [pruner.masks[layer.name] for layer in pruner.layers]
    if all(m is None for m in masks):
        return None
    h = hashlib.sha256()
    for m in masks:
        h.update(m.cpu().numpy().tobytes())
    return h.hexdigest()


def _pruned_zero(tensor, mask, transposed) -> bool:
    """Every pruned position of what this rank holds is exactly ``+0.0``."""
    values, local_mask = local_part(tensor.detach(), mask, transposed)
    pruned = values[~local_mask]
    return bool((pruned == 0).all()) and not bool(torch.signbit(pruned).any())


class _Probe(TrainerCallback):
    """Records, per optimizer step, the masks' digest and whether pruned gradients (after DDP's all-reduce and
    clipping, right before the optimizer) and pruned weights (after the step) are exactly zero."""

    def __init__(self) -> None:
        self.pruner = None
        self.grads_zero: list[bool] = []
        self.weights_zero: list[bool] = []
        self.digests: list[str | None] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        ok = True
        for layer in self.pruner.layers:
            mask = self.pruner.masks[layer.name]
            if mask is not None:
                ok &= _pruned_zero(layer.module.weight.grad, mask, layer.transposed)
        self.grads_zero.append(ok)

    def on_step_end(self, args, state, control, **kwargs):
        ok = True
        for layer in self.pruner.layers:
            mask = self.pruner.masks[layer.name]
            if mask is not None:
                ok &= _pruned_zero(layer.module.weight, mask, layer.transposed)
        self.weights_zero.append(ok)
        self.digests.append(_digest(self.pruner))


def _trainer_args(output_dir, batch: int, **kwargs) -> TrainingArguments:
    settings = dict(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=batch,
        learning_rate=1e-3,
        weight_decay=0.1,
        max_grad_norm=0.5,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        train_sampling_strategy="sequential",  # rank r's batch is samples [8k + 4r, 8k + 4r + 4): the same 8 overall
        ddp_timeout=120,
        # BERT classification takes **kwargs but ignores num_items_in_batch (mean loss per rank), so Trainer's
        # default multiplication by the world size would double DDP's gradients against one process
        average_tokens_across_devices=False,
    )
    settings.update(kwargs)
    return TrainingArguments(**settings)


def _train(output_dir, batch: int, resume: str | None = None, **kwargs):
    probe = _Probe()
    trainer = SparseTrainer(
        model=_model(),
        args=_trainer_args(output_dir, batch, **kwargs),
        train_dataset=ToyClassification(),
        sparsity_config=_config(),
        callbacks=[probe],
    )
    probe.pruner = trainer.pruner
    trainer.train(resume_from_checkpoint=resume)
    return trainer, probe


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_rank(rank: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)


def _run_worker(rank: int, worker, port: int, out: str, *extra) -> None:
    """``worker(rank, port, out, *extra)``, then the process group destroyed before the process exits.

    A process that exits with its gloo group alive can abort after its work is done (SIGABRT, "terminate called
    without an active exception"): gloo's threads still hold finished work whose tensors are released while the
    interpreter is being finalised. After a worker's last collective, a barrier keeps one rank from closing its
    connections while the other still reads from them; after a failure the group is destroyed without it, so
    the other rank's collective fails at once instead of waiting for the timeout.
    """
    import torch.distributed as dist

    try:
        worker(rank, port, out, *extra)
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Done and torn down: leave without the interpreter's finalisation, where gloo's threads and the tensors of
    # finished work can still meet (the same abort). Everything the tests read is written and closed by now; the
    # exit handlers still run, after the teardown.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(worker, out: Path, *extra, timeout: float = 240.0, nprocs: int = WORLD) -> None:
    """Run ``worker(rank, port, out, *extra)`` in fresh processes; fail (and stop them) if they hang.

    A worker killed by a signal is run once more (with a warning): gloo's teardown has aborted processes
    (SIGABRT, "terminate called without an active exception") in a way no run of this file alone reproduced. A
    crash of the code under test happens again on the second run and fails the test; an exception in a worker
    is never retried."""
    import torch.multiprocessing as mp

    for attempt in (1, 2):
        args = (worker, _free_port(), str(out), *extra)
        context = mp.start_processes(_run_worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        if process.is_alive():
                            process.kill()
                        process.join()
                    pytest.fail(f"distributed workers did not finish in {timeout:.0f} s")
            return
        except mp.ProcessExitedException as exc:
            if attempt == 2 or exc.signal_name is None:
                raise
            for process in context.processes:
                process.join()
            warnings.warn(f"distributed worker died ({exc}); running the workers once more", stacklevel=2)


def _read_json(path: Path):
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------------------- the workers
def _worker(rank: int, port: int, out: str) -> None:
    """Both scenarios in one pair of processes (each process spends seconds importing transformers)."""
    _setup_rank(rank, port)
    _ddp_scenario(rank, Path(out))  # accelerate initialises the gloo process group the FSDP2 scenario reuses
    _fsdp_scenario(rank, Path(out))


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _spawn(_worker, out)
    return out


def _ddp_scenario(rank: int, out: Path) -> None:
    trainer, probe = _train(out / "run", PER_DEVICE, save_strategy="steps", save_steps=3)
    trainer.save_model(str(out / f"saved_rank{rank}"))  # one folder per rank: only rank 0's may appear
    resumed, resumed_probe = _train(out / "resumed", PER_DEVICE, resume=str(out / "run" / "checkpoint-3"))
    torch.save(
        {"final": _weights(trainer.model), "resumed": _weights(resumed.model), "masks": dict(trainer.pruner.masks)},
        out / f"state_rank{rank}.pt",
    )
    record = {
        "grads_zero": probe.grads_zero + resumed_probe.grads_zero,
        "weights_zero": probe.weights_zero + resumed_probe.weights_zero,
        "digests": probe.digests,
        "resumed_digests": resumed_probe.digests,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "wrapped": type(trainer.model_wrapped).__name__,
        "bucket_view": _bucket_view_check(rank),
        "kept_only": _bucket_view_check(rank, kept_only=True),
    }
    (out / f"record_rank{rank}.json").write_text(json.dumps(record))


def _bucket_view_check(rank: int, kept_only: bool = False) -> dict:
    """DDP with ``gradient_as_bucket_view=True`` (``param.grad`` aliases the all-reduce bucket): the gradient the
    optimizer gets is still exactly zero at pruned positions, and the same on both ranks (really all-reduced).
    ``kept_only``: with the communication hook that sends only kept positions."""
    from torch.nn.parallel import DistributedDataParallel

    from hf_sparse.distributed import KeptGradientAllReduce, kept_gradient_all_reduce_hook

    model = _model()
    pruner = Pruner(model, SparsityConfig(score="magnitude", pattern="2:4", schedule="oneshot", start=0))
    pruner.bind(3)
    # small buckets, so that some hold pruned weights only, some dense parameters only, some both
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
    hook_state = KeptGradientAllReduce(pruner)
    if kept_only:
        ddp.register_comm_hook(hook_state, kept_gradient_all_reduce_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    seen = {"grads_zero": [], "grad_digests": []}
    for step in range(3):
        pruner.update(step)
        ddp(**_batch(step, rank, WORLD)).loss.backward()
        seen["grads_zero"].append(
            all(_pruned_zero(lay.module.weight.grad, pruner.masks[lay.name], lay.transposed) for lay in pruner.layers)
        )
        grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        seen["grad_digests"].append(hashlib.sha256(grads.numpy().tobytes()).hexdigest())
        optimizer.step()
        pruner.apply()
        optimizer.zero_grad()
    seen["sent_fraction"] = hook_state.elements_sent / hook_state.elements_total if kept_only else 1.0
    return seen


def _leave_work_in_flight(rank: int, port: int, out: str) -> None:
    """Start gloo, leave an all-reduce in flight and return; at exit, record whether the group was still alive."""
    _setup_rank(rank, port)
    torch.distributed.init_process_group("gloo")
    alive = Path(out) / f"group_alive_at_exit_rank{rank}"
    atexit.register(lambda: alive.write_text(str(torch.distributed.is_initialized())))
    torch.distributed.all_reduce(torch.ones(1000), async_op=True)


def test_workers_destroy_their_process_group_before_exiting(tmp_path):
    # a group left alive at exit can abort the process after its work is done (SIGABRT), so _spawn would fail too
    _spawn(_leave_work_in_flight, tmp_path)
    assert [(tmp_path / f"group_alive_at_exit_rank{r}").read_text() for r in range(WORLD)] == ["False"] * WORLD


@pytest.fixture(scope="module")
def ddp_run(workers):
    """The two-rank DDP run (workers) and the single-process run on the same global batch (here)."""
    out = workers
    single, single_probe = _train(out / "single", WORLD * PER_DEVICE)
    single.save_model(str(out / "saved_single"))
    return out, single, single_probe


def test_ddp_masks_agree_across_ranks_and_with_one_process(ddp_run):
    out, single, single_probe = ddp_run
    records = [_read_json(out / f"record_rank{r}.json") for r in range(WORLD)]
    assert records[0]["wrapped"] == "DistributedDataParallel"
    assert records[0]["digests"] == records[1]["digests"] == single_probe.digests
    assert None in single_probe.digests and len(set(single_probe.digests) - {None}) == 2  # dense, 64:3:8, 64:2:8
    masks = [torch.load(out / f"state_rank{r}.pt")["masks"] for r in range(WORLD)]
    for name, mask in single.pruner.masks.items():
        assert torch.equal(masks[0][name], mask) and torch.equal(masks[1][name], mask), name


def test_ddp_pruned_gradients_and_weights_exactly_zero_every_step(ddp_run):
    out, _, single_probe = ddp_run
    for rank in range(WORLD):
        record = _read_json(out / f"record_rank{rank}.json")
        assert len(record["grads_zero"]) == STEPS + STEPS - 3  # the full run, then the resumed one from step 3
        assert all(record["grads_zero"]) and all(record["weights_zero"]), rank
    assert all(single_probe.grads_zero) and all(single_probe.weights_zero)


def test_ddp_matches_one_process_on_the_same_global_batch(ddp_run):
    out, single, _ = ddp_run
    reference = _weights(single.model)
    for rank in range(WORLD):
        final = torch.load(out / f"state_rank{rank}.pt")["final"]
        for key, value in reference.items():
            torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
    changed = [k for k, v in _model().state_dict().items() if not torch.equal(v, reference[k])]
    assert len(changed) > 10  # training moved the weights: the comparison is not between two initial models


def test_ddp_gradient_as_bucket_view_keeps_pruned_gradients_zero(ddp_run):
    out, _, _ = ddp_run
    checks = [_read_json(out / f"record_rank{r}.json")["bucket_view"] for r in range(WORLD)]
    assert all(checks[0]["grads_zero"]) and all(checks[1]["grads_zero"]) and len(checks[0]["grads_zero"]) == 3
    assert checks[0]["grad_digests"] == checks[1]["grad_digests"]  # all-reduced: each rank saw different samples


def test_kept_gradient_all_reduce_equals_ddp_default(ddp_run):
    out, _, _ = ddp_run
    records = [_read_json(out / f"record_rank{r}.json") for r in range(WORLD)]
    for record in records:
        assert all(record["kept_only"]["grads_zero"])
        assert record["kept_only"]["grad_digests"] == record["bucket_view"]["grad_digests"]  # bit for bit
        assert 0.5 < record["kept_only"]["sent_fraction"] < 0.75  # 2:4 halves the encoder's linear weights


def test_ddp_metrics_are_over_the_full_model(ddp_run):
    out, single, _ = ddp_run
    logs = _read_json(out / "record_rank0.json")["logs"]
    expected = [h for h in single.state.log_history if "loss" in h]
    assert [h["sparsity"] for h in logs] == [h["sparsity"] for h in expected]
    assert logs[-1]["sparsity"] == pytest.approx(0.75, abs=1e-3)


def test_ddp_resume_is_exact(ddp_run):
    out, _, _ = ddp_run
    for rank in range(WORLD):
        state = torch.load(out / f"state_rank{rank}.pt")
        for key, value in state["final"].items():
            assert torch.equal(state["resumed"][key], value), f"rank {rank}: {key}"
        record = _read_json(out / f"record_rank{rank}.json")
        assert record["resumed_digests"] == record["digests"][3:]
    checkpoint = out / "run" / "checkpoint-3"
    assert (checkpoint / "hf_sparse_pruner.safetensors").is_file()
    assert not list(checkpoint.glob("*.tmp"))


def _assert_same_checkpoint_format(saved: Path, reference: Path, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same files, tensor names, dtypes, shapes, index tensors and metadata; values equal up to float rounding."""
    assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in reference.iterdir())
    config, ref_config = (_read_json(d / "config.json") for d in (saved, reference))
    assert config["quantization_config"] == ref_config["quantization_config"]
    with safe_open(saved / "model.safetensors", "pt") as a, safe_open(reference / "model.safetensors", "pt") as b:
        assert a.metadata() == b.metadata()
        assert sorted(a.keys()) == sorted(b.keys())
        for key in b.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            assert x.dtype == y.dtype and x.shape == y.shape, key
            if x.is_floating_point():
                torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=key)
            else:
                assert torch.equal(x, y), key


def test_ddp_checkpoint_written_once_and_like_one_process(ddp_run):
    out, _, _ = ddp_run
    assert not (out / f"saved_rank{1}").exists()  # rank 1 wrote nothing
    _assert_same_checkpoint_format(out / "saved_rank0", out / "saved_single")
    with safe_open(out / "saved_rank0" / "model.safetensors", "pt") as fh:
        assert "bert.encoder.layer.0.intermediate.dense.weight" in fh.keys()
        assert fh.get_tensor("bert.encoder.layer.0.intermediate.dense.weight").numel() == 128 * 64 // 4


# ------------------------------------------------------------------------------------------- FSDP2 (manual loop)
def _batch(step: int, rank: int, world: int) -> dict:
    """Rank ``rank``'s share of the global batch of step ``step`` (8 samples per step, split evenly)."""
    data = ToyClassification()
    per_rank = WORLD * PER_DEVICE // world
    start = step * WORLD * PER_DEVICE + rank * per_rank
    return {"input_ids": data.ids[start : start + per_rank], "labels": data.labels[start : start + per_rank]}


def _manual_loop(model, callback: SparsityCallback, rank: int, world: int, shard=None) -> dict:
    """What ``Trainer`` does around the callback: setup before wrapping, the wrapper, then per step mask update,
    forward/backward, clipping, AdamW, re-mask. Returns what it observed."""
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    state, control = TrainerState(max_steps=STEPS), TrainerControl()
    callback.setup(model, STEPS)  # SparseTrainer builds its pruner before the model is wrapped
    if shard is not None:
        shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    callback.on_train_begin(args, state, control, model=model)
    pruner = callback.pruner
    seen = {"grads_zero": [], "weights_zero": [], "digests": [], "sparsity": []}
    for step in range(STEPS):
        state.global_step = step
        callback.on_step_begin(args, state, control)
        model(**_batch(step, rank, world)).loss.backward()
        masked = [(layer, pruner.masks[layer.name]) for layer in pruner.layers if pruner.masks[layer.name] is not None]
        seen["grads_zero"].append(all(_pruned_zero(lay.module.weight.grad, m, lay.transposed) for lay, m in masked))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        callback.on_optimizer_step(args, state, control, optimizer=optimizer)  # as Trainer calls it
        optimizer.zero_grad()
        seen["weights_zero"].append(all(_pruned_zero(lay.module.weight, m, lay.transposed) for lay, m in masked))
        seen["digests"].append(_digest(pruner))
        seen["sparsity"].append(pruner.metrics()["sparsity"])
    return seen


def _fully_shard_bert(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.bert.encoder.layer:
        fully_shard(block)
    fully_shard(model)


def _fsdp_scenario(rank: int, out: Path) -> None:
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    model = _model()
    callback = SparsityCallback(_config())
    seen = _manual_loop(model, callback, rank, WORLD, shard=_fully_shard_bert)
    seen["sharded"] = callback.pruner.is_sharded
    seen["report"] = {name: row["sparsity"] for name, row in callback.pruner.sparsity_report().items()}
    save_pretrained(model, out / f"fsdp_saved_rank{rank}", callback.pruner)  # every rank joins the gather
    full = gather_full_state_dict(model)
    if rank == 0:
        torch.save({"final": full, "masks": dict(callback.pruner.masks)}, out / "fsdp_state.pt")
    seen["gpt2"] = _gpt2_conv1d_check()
    seen["broadcast"] = _broadcast_check(rank)
    seen["sparsegpt_refused"] = _sparsegpt_refused_on_shards(model)
    (out / f"fsdp_record_rank{rank}.json").write_text(json.dumps(seen))


def _sparsegpt_refused_on_shards(sharded_model) -> str:
    """The default score (SparseGPT) on FSDP2-sharded weights: the check a run makes before its first step raises,
    naming the way out; returns the message ('' if nothing was raised)."""
    pruner = Pruner(sharded_model, SparsityConfig(pattern="2:4"))
    try:
        pruner.check_can_update()
    except NotImplementedError as err:
        return str(err)
    finally:
        pruner.remove_hooks()
    return ""


def _gpt2_conv1d_check() -> dict:
    """GPT-2's Conv1D stores (in, out): FSDP2 shards the logical columns. One 2:4 step: pruned gradient and
    weight shards exactly zero, full weights follow the pattern."""
    from torch.distributed.fsdp import fully_shard

    model = _model("gpt2")
    callback = SparsityCallback(SparsityConfig(score="magnitude", pattern="2:4", schedule="oneshot", start=0))

    def shard(m):
        for block in m.transformer.h:
            fully_shard(block)
        fully_shard(m)

    rank = torch.distributed.get_rank()
    seen = {"grads_zero": [], "weights_zero": [], "pattern_ok": True}
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    state, control = TrainerState(max_steps=2), TrainerControl()
    callback.setup(model, 2)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    callback.on_train_begin(args, state, control, model=model)
    pruner = callback.pruner
    callback.on_step_begin(args, state, control)
    model(**_batch(0, rank, WORLD)).loss.backward()
    for layer in pruner.layers:
        seen["grads_zero"].append(_pruned_zero(layer.module.weight.grad, pruner.masks[layer.name], True))
    optimizer.step()
    callback.on_optimizer_step(args, state, control)
    for layer in pruner.layers:
        mask = pruner.masks[layer.name]
        seen["weights_zero"].append(_pruned_zero(layer.module.weight, mask, True))
        weight = full_tensor(layer.weight.detach())
        compress(weight, mask, pruner.current_pattern())  # raises unless the full weight follows 2:4 exactly
    seen["digest"] = _digest(pruner)
    return seen


def _broadcast_check(rank: int) -> dict:
    """Ranks whose weights differ still end with rank 0's masks (what a gradient-based score under DDP needs)."""
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1 + rank)))
    from hf_sparse import Pruner
    from hf_sparse.masks import compute_mask

    pruner = Pruner(model, SparsityConfig(score="magnitude", pattern="2:4", schedule="oneshot", start=0))
    own = {layer.name: compute_mask(layer.weight.detach().abs(), pruner.pattern) for layer in pruner.layers}
    pruner.bind(1)
    pruner.update(0)
    return {"digest": _digest(pruner), "own_equal": all(torch.equal(pruner.masks[n], m) for n, m in own.items())}


@pytest.fixture(scope="module")
def fsdp_run(workers):
    out = workers
    model = _model()
    callback = SparsityCallback(_config())
    seen = _manual_loop(model, callback, 0, 1)
    save_pretrained(model, out / "fsdp_saved_single", callback.pruner)
    return out, model, callback.pruner, seen


def test_fsdp2_masks_agree_and_pruned_values_exactly_zero(fsdp_run):
    out, _, pruner, seen = fsdp_run
    records = [_read_json(out / f"fsdp_record_rank{r}.json") for r in range(WORLD)]
    assert records[0]["sharded"] and not pruner.is_sharded
    assert records[0]["digests"] == records[1]["digests"] == seen["digests"]
    assert len(set(seen["digests"]) - {None}) == 2
    for record in records:
        assert all(record["grads_zero"]) and all(record["weights_zero"])
    state = torch.load(out / "fsdp_state.pt")
    for name, mask in pruner.masks.items():
        assert torch.equal(state["masks"][name], mask), name


def test_fsdp2_refuses_sparsegpt_before_training(fsdp_run):
    out = fsdp_run[0]
    for rank in range(WORLD):
        message = _read_json(out / f"fsdp_record_rank{rank}.json")["sparsegpt_refused"]
        assert "FSDP2-sharded" in message and "score='magnitude'" in message


def test_fsdp2_matches_one_process_and_counts_full_weights(fsdp_run):
    out, model, pruner, seen = fsdp_run
    final = torch.load(out / "fsdp_state.pt")["final"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=key)
    for rank in range(WORLD):
        record = _read_json(out / f"fsdp_record_rank{rank}.json")
        assert record["sparsity"] == seen["sparsity"]  # counted over full weights, not this rank's shard
        assert record["report"] == {n: row["sparsity"] for n, row in pruner.sparsity_report().items()}


def test_fsdp2_checkpoint_written_once_like_one_process(fsdp_run):
    out, model, _, _ = fsdp_run
    assert not (out / "fsdp_saved_rank1").exists()
    _assert_same_checkpoint_format(out / "fsdp_saved_rank0", out / "fsdp_saved_single")
    loaded = AutoModelForSequenceClassification.from_pretrained(out / "fsdp_saved_rank0")
    ids = _batch(0, 0, 1)["input_ids"]
    loaded.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_fsdp2_conv1d_shards_transposed_weights(fsdp_run):
    out, _, _, _ = fsdp_run
    checks = [_read_json(out / f"fsdp_record_rank{r}.json")["gpt2"] for r in range(WORLD)]
    for check in checks:
        assert check["grads_zero"] and all(check["grads_zero"]) and all(check["weights_zero"])
    assert checks[0]["digest"] == checks[1]["digest"] is not None


def test_masks_are_rank_zeros_even_when_weights_differ(fsdp_run):
    out, _, _, _ = fsdp_run
    checks = [_read_json(out / f"fsdp_record_rank{r}.json")["broadcast"] for r in range(WORLD)]
    assert checks[0]["digest"] == checks[1]["digest"]
    assert checks[0]["own_equal"] and not checks[1]["own_equal"]  # rank 1 took rank 0's masks, not its own


# ----------------------------------------------------------------------- GPUs (NCCL): what the CPU cannot run
# Accelerate drives FSDP only on accelerators, so SparseTrainer under Trainer's own FSDP2 is checked here.
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs"
)


def _gpu_trainer_kwargs(mode: str) -> dict:
    kwargs = {"use_cpu": False}
    if mode == "fsdp2":
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]}
    return kwargs


def _full_weights(model) -> dict[str, torch.Tensor]:
    """Every rank must call it: under FSDP2 it gathers (rank 0 gets the weights, the others ``{}``)."""
    from hf_sparse.distributed import has_sharded_parameters

    return gather_full_state_dict(model) if has_sharded_parameters(model) else _weights(model)


def _gpu_reference_worker(rank: int, port: int, out: str) -> None:
    """One process on one GPU (``CUDA_VISIBLE_DEVICES=0``: with two visible, Trainer would use DataParallel)."""
    out = Path(out)
    single, probe = _train(out / "single", WORLD * PER_DEVICE, use_cpu=False)
    single.save_model(str(out / "saved_single"))
    masks = {k: v.cpu() for k, v in single.pruner.masks.items()}
    torch.save({"final": _weights(single.model), "masks": masks}, out / "single_state.pt")
    logs = [h for h in single.state.log_history if "loss" in h]
    (out / "single_record.json").write_text(json.dumps({"digests": probe.digests, "logs": logs}))


def _gpu_worker(rank: int, port: int, out: str, mode: str) -> None:
    _setup_rank(rank, port)
    torch.cuda.set_device(rank)
    out = Path(out)
    kwargs = _gpu_trainer_kwargs(mode)
    trainer, probe = _train(out / "run", PER_DEVICE, save_strategy="steps", save_steps=3, **kwargs)
    trainer.save_model(str(out / f"saved_rank{rank}"))  # FSDP2: every rank joins the gather; rank 0 writes
    final = _full_weights(trainer.model)
    resumed, resumed_probe = _train(out / "resumed", PER_DEVICE, resume=str(out / "run" / "checkpoint-3"), **kwargs)
    resumed_final = _full_weights(resumed.model)
    if rank == 0:
        masks = {k: v.cpu() for k, v in trainer.pruner.masks.items()}
        torch.save({"final": final, "resumed": resumed_final, "masks": masks}, out / "state.pt")
    record = {
        "grads_zero": probe.grads_zero + resumed_probe.grads_zero,
        "weights_zero": probe.weights_zero + resumed_probe.weights_zero,
        "digests": probe.digests,
        "resumed_digests": resumed_probe.digests,
        "sharded": trainer.pruner.is_sharded,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
    }
    (out / f"record_rank{rank}.json").write_text(json.dumps(record))


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_sparse_trainer_on_two_gpus(tmp_path, monkeypatch, mode):
    _spawn(_gpu_worker, tmp_path, mode, timeout=400.0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # inherited by the spawned reference process only
    _spawn(_gpu_reference_worker, tmp_path, timeout=300.0, nprocs=1)
    single = _read_json(tmp_path / "single_record.json")
    records = [_read_json(tmp_path / f"record_rank{r}.json") for r in range(WORLD)]
    assert records[0]["sharded"] == (mode == "fsdp2")
    assert records[0]["digests"] == records[1]["digests"] == single["digests"]
    for record in records:
        assert all(record["grads_zero"]) and all(record["weights_zero"])
        assert record["resumed_digests"] == record["digests"][3:]
    assert [h["sparsity"] for h in records[0]["logs"]] == [h["sparsity"] for h in single["logs"]]
    state, reference = torch.load(tmp_path / "state.pt"), torch.load(tmp_path / "single_state.pt")
    for name, mask in reference["masks"].items():
        assert torch.equal(state["masks"][name], mask), name
    for key, value in reference["final"].items():
        torch.testing.assert_close(state["final"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        torch.testing.assert_close(state["resumed"][key], state["final"][key], rtol=1e-5, atol=1e-6, msg=key)
    assert not (tmp_path / "saved_rank1").exists()
    _assert_same_checkpoint_format(tmp_path / "saved_rank0", tmp_path / "saved_single", rtol=1e-4, atol=1e-5)
