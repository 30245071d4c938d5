"""GPU: compact layers in training (50 steps of a small BERT against the masked-dense path), a SparseTrainer run that
makes its layers compact, and loaded checkpoints running inference on the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import ToyClassification, random_ids
from helpers import logical_weight, prune_now, torch_compile_runs
from ops._helpers import poison_allocator
from transformers import AutoModelForSequenceClassification, BertConfig, TrainerCallback, TrainingArguments

import hf_sparse
from hf_sparse import SparseTrainer, SparsityConfig
from hf_sparse.compaction import make_compact
from hf_sparse.nn import SparseLinear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _small_bert(seed: int):
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=128,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return AutoModelForSequenceClassification.from_config(cfg).cuda()


def _gpu_args(tmp_path, **overrides) -> TrainingArguments:
    """The GPU Trainer runs' arguments: bf16, batch 8, no saving, reporting or progress bar."""
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, bf16=True, report_to=[], save_strategy="no",
        disable_tqdm=True, learning_rate=1e-3,
    )  # fmt: skip
    return TrainingArguments(**{**settings, **overrides})


def _train(run, opt, steps: int, gen: torch.Generator, after_step=None) -> torch.Tensor:
    """``steps`` optimizer steps of ``run`` under bf16 autocast on random 8 x 64 batches drawn from ``gen``
    (``after_step(opt)`` after each); the losses."""
    losses = []
    for _ in range(steps):
        ids = torch.randint(1, 512, (8, 64), generator=gen).cuda()
        labels = (ids[:, 0] % 3).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(opt)
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.mark.parametrize(("pattern", "extra"), [("64:2:8", {}), ("2:4", {"transposable": True}), ("64:2:16", {})])
def test_50_steps_of_compact_layers_track_masked_dense(pattern, extra):
    """The same model, masks and batches trained 50 steps with fused AdamW under bf16 autocast, once masked dense and
    once with every pruned layer compact (on its measured kernel plans): the losses and the final logical weights
    agree within bf16 noise."""
    runs, weights = [], []
    for compact in (False, True):
        model = _small_bert(seed=0)
        pruner = prune_now(model, pattern, **extra)
        start = {layer.name: logical_weight(layer).float() for layer in pruner.layers}
        if compact:
            assert len(make_compact(model, pruner)) == len(pruner.layers) == 12
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        # pruner.apply after each step, as the callback does: masks the dense layers, leaves compact ones alone
        losses = _train(model, opt, 50, torch.Generator().manual_seed(1), pruner.apply)
        assert all(layer.compact == compact for layer in pruner.layers)
        runs.append(losses)
        weights.append({layer.name: logical_weight(layer).float() for layer in pruner.layers})
    dense, kern = runs
    assert torch.isfinite(kern).all()
    assert (dense - kern).abs().max() < 0.1, (dense, kern)
    assert abs(dense[-10:].mean() - kern[-10:].mean()) < 0.03 * dense[-10:].mean()
    for name, w in weights[0].items():
        assert bool((w[~pruner.masks[name]] == 0).all()), name
        moved, apart = float((w - start[name]).norm()), float((weights[1][name] - w).norm())
        assert apart < 0.5 * moved, (name, apart, moved)  # both runs moved the same way


@pytest.mark.parametrize(("pattern", "extra"), [("2:4", {"transposable": True}), ("64:2:8", {})])
def test_compiled_compact_training_tracks_eager(pattern, extra):
    """torch.compile (Inductor, one graph) of a model with compact layers: each layer is the extension's C++
    ``hf_sparse::compact_linear`` op, the packs follow the fused AdamW steps (the refresh after each step: compiled code
    does not check the weights), and 15 steps track eager compact training within bf16 noise; after training, a
    compiled forward equals an eager one on the same weights."""
    runs = []
    for compiled in (False, True):
        model = _small_bert(seed=0)
        pruner = prune_now(model, pattern, **extra)
        assert len(make_compact(model, pruner)) == 12
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        run = torch.compile(model, fullgraph=True) if compiled else model
        gen = torch.Generator().manual_seed(1)
        runs.append(_train(run, opt, 15, gen))
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hf_sparse::compact_linear", "CUDA")
    assert "binding.cpp" in torch._C._dispatch_dump("hf_sparse::compact_linear")  # the C++ function, not Python
    eager, comp = runs
    assert torch.isfinite(comp).all() and (eager - comp).abs().max() < 0.1, (eager, comp)
    ids = torch.randint(1, 512, (8, 64), generator=gen).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        y_compiled = run(input_ids=ids).logits.float()  # first: an eager call would refresh stale packs
        y_eager = model(input_ids=ids).logits.float()
    assert float((y_compiled - y_eager).abs().max()) <= 2e-2 * float(y_eager.abs().max()) + 1e-2


def test_sparse_trainer_makes_layers_compact_on_cuda(tmp_path):
    seen = []

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(sum(isinstance(m, SparseLinear) for m in model.modules()))

    args = _gpu_args(tmp_path, max_steps=6)
    model = _small_bert(seed=2)
    trainer = SparseTrainer(
        model=model,
        args=args,
        train_dataset=ToyClassification(size=64, length=16),
        callbacks=[Probe()],
        sparsity_config=SparsityConfig(score="magnitude", pattern="64:2:8", schedule="oneshot", start=0.5, end=0.5),
    )
    trainer.train()
    assert seen[0] == 0 and seen[-1] == 12, seen  # dense until the masks are final at step 3, compact after
    for layer in trainer.pruner.layers:
        assert layer.compact and layer.module._kernel is not None  # trained on its own kernel state
        assert torch.equal(layer.module.mask(), trainer.pruner.masks[layer.name])
        assert torch.isfinite(layer.module.weight).all()


def test_torch_compile_run_times_the_compiled_step_against_the_eager_one(tmp_path, caplog):
    """``TrainingArguments(torch_compile=True)`` with compact layers from step 0: the run times its compiled steps
    against eager ones (torch.compile set aside, the layers compact throughout), keeps the faster with one log line,
    and leaves torch.compile's stance as it was when training ends."""

    args = _gpu_args(tmp_path, max_steps=12, torch_compile=True)
    config = SparsityConfig(
        score="magnitude", pattern="2:4", transposable=True, schedule="oneshot", start=0, end=0,
        compact_fallback="always", compact_fallback_steps=2,
    )  # fmt: skip
    trainer = SparseTrainer(
        model=_small_bert(seed=4), args=args, train_dataset=ToyClassification(size=96, length=16),
        sparsity_config=config,
    )  # fmt: skip
    with caplog.at_level("INFO", logger="hf_sparse.compact_fallback"):
        trainer.train()
    fallback = trainer.sparsity_callback.fallback
    assert fallback.rival == "eager" and fallback.choice in ("compact", "eager")
    assert fallback.timings["compact"].steps == 2 and fallback.timings["eager"].steps == 2
    assert sum("compiled step" in r.getMessage() for r in caplog.records) == 1
    assert all(layer.compact for layer in trainer.pruner.layers)
    assert torch_compile_runs()  # torch.compile is back after training
    assert all(torch.isfinite(layer.module.weight).all() for layer in trainer.pruner.layers)


@pytest.mark.parametrize("pattern", ["64:2:8", "2:4"])
def test_loaded_checkpoint_runs_inference_on_the_kernels(tmp_path, pattern):
    model = _small_bert(seed=3).float().cpu()
    pruner = prune_now(model, pattern)
    hf_sparse.save_pretrained(model, tmp_path, pruner)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    sparse_layers = [m for m in loaded.modules() if isinstance(m, SparseLinear)]
    assert len(sparse_layers) == 12
    assert sum(m.activation == "gelu" for m in sparse_layers) == 2  # each layer's intermediate GELU, folded
    ids = random_ids(4, 48, seed=4).cuda()
    with torch.no_grad():
        auto_logits = loaded(input_ids=ids).logits.float()
        for m in sparse_layers:  # every call shape on the sparse kernel
            sparse = "sparse24" if m._kernel.packed24 is not None else "sparse"  # V:2:M: on its 2:4 view
            m._kernel.plans = {key: (sparse,) + plan[1:] for key, plan in m._kernel.plans.items()}
        kernel_logits = loaded(input_ids=ids).logits.float()
    assert all(m._kernel is not None and m._kernel.packed_t is None for m in sparse_layers)
    ref = model.cuda().eval()(input_ids=ids).logits.detach().float()
    scale = ref.abs().max()
    assert (kernel_logits - ref).abs().max() < 0.05 * scale
    assert (auto_logits - ref).abs().max() < 0.05 * scale
    # training a loaded model runs on the kernels too, with gradients on the kept values
    loaded.train()
    loss = loaded(input_ids=ids, labels=torch.zeros(4, dtype=torch.long, device="cuda")).loss
    loss.backward()
    assert all(m.weight.grad is not None and m.weight.grad.shape == m.weight.shape for m in sparse_layers)


def _loaded_bert(tmp_path, pattern: str, seed: int):
    model = _small_bert(seed=seed).float().cpu()
    pruner = prune_now(model, pattern)
    hf_sparse.save_pretrained(model, tmp_path, pruner)
    return AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()


@pytest.mark.parametrize("pattern", ["64:2:8", "2:4"])
def test_loaded_layer_measures_once_and_refreshes_only_when_the_values_change(tmp_path, pattern):
    layer = next(m for m in _loaded_bert(tmp_path, pattern, seed=5).modules() if isinstance(m, SparseLinear))
    x = torch.randn(3, 40, layer.in_features, device="cuda").bfloat16()
    with torch.no_grad():
        first = layer(x)  # builds the kernel state, measures the plan of this token bucket
        k = layer._kernel
        plans, stamp = dict(k.plans), k.stamp
        poison_allocator()
        again = layer(x)
        assert k.plans == plans and k.stamp == stamp and layer._kernel is k
        assert torch.equal(first, again)
        ref = F.linear(x.float(), layer.dense_weight().float(), layer.bias.float())
        assert (again.float() - ref).abs().max() < 0.02 * ref.abs().max()
        layer.weight.mul_(-1.5)  # new values (version bump): the packs are refreshed in place
        changed = layer(x)
        assert k.stamp != stamp and k.plans == plans
        ref = F.linear(x.float(), layer.dense_weight().float(), layer.bias.float())
        assert (changed.float() - ref).abs().max() < 0.02 * ref.abs().max()


def test_loaded_model_forward_replays_from_a_cuda_graph(tmp_path):
    """Inference is often host-bound; a CUDA graph (or torch.compile's "reduce-overhead") removes the host from it.
    The captured forward must read the graph's input buffer on every replay, not the one it was captured with."""
    loaded = _loaded_bert(tmp_path, "64:2:8", seed=6)
    ids = random_ids(4, 48, seed=7).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):  # each layer measures its plan on the first call (never during a capture)
            loaded(input_ids=ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_logits = loaded(input_ids=ids).logits
    old = static_logits.clone()
    for seed in (8, 9):
        new = random_ids(4, 48, seed=seed).cuda()
        ids.copy_(new)
        poison_allocator()
        graph.replay()
        with torch.no_grad():
            eager = loaded(input_ids=new).logits
        # the same kernels, but cuBLAS may pick another algorithm under capture: bf16 rounding apart at most
        tol = 1e-2 * float(eager.abs().max())
        assert float((static_logits - eager).abs().max()) <= tol
        assert not torch.equal(static_logits, old)  # a stale replay would give ``old`` again, bit for bit
