"""GPU: the repack kernel, the kernel path in training (50 steps of a small BERT against the masked-dense path), a
SparseTrainer run that engages it, and loaded checkpoints running inference on the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import ToyClassification, random_ids
from helpers import prune_now
from ops._helpers import PATTERNS, poison_allocator, random_masked, rel_err
from transformers import AutoModelForSequenceClassification, BertConfig, TrainerCallback, TrainingArguments

import hf_sparse
from hf_sparse import SparseTrainer, SparsityConfig
from hf_sparse.nn import SparseLinear
from hf_sparse.nn.kernel_path import enable_kernel_path, kernel_path_layers
from hf_sparse.ops import pack, repack_many
from hf_sparse.ops.pack import repack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(("v", "m"), PATTERNS)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_repack_kernel_matches_full_pack(v, m, src, dtype):
    rows, cols = 192 if m == 4 else 2 * v, 8 * m * 3
    w, mask = random_masked(rows, cols, v, m, device="cuda", seed=m + v)
    p = pack(w.to(src), mask, v, m, dtype)
    w2 = torch.where(mask, torch.randn_like(w), 0.0).to(src)  # new values, same mask
    ref = pack(w2, mask, v, m, dtype)
    for all_valid in (False, bool(p.valid.all())):
        got = repack(w2, p, all_valid=all_valid)
        assert torch.equal(got.values, ref.values) and got.meta is p.meta
    strided = w2.t().contiguous().t()  # column-major: read in place through strides
    assert torch.equal(repack(strided, p).values, ref.values)


def test_repack_many_kernel_matches_one_repack_per_weight():
    """The batched repack (one launch per master dtype and 40 weights): 90 weights of every pattern, fp32 / bf16 /
    fp16 masters, row- and column-major, with and without the slot-validity check, into poisoned memory."""
    weights, packs, flags = [], [], []
    for i in range(90):
        v, m = PATTERNS[i % len(PATTERNS)]
        rows, cols = (64 if m == 4 else v) * (1 + i % 3), 8 * m * (1 + i % 2)
        w, mask = random_masked(rows, cols, v, m, device="cuda", seed=100 + i)
        p = pack(w, mask, v, m, torch.bfloat16)
        new = torch.where(mask, torch.randn_like(w), 0.0).to((torch.float32, torch.bfloat16, torch.float16)[i % 3])
        weights.append(new.t().contiguous().t() if i % 4 == 1 else new)
        packs.append(p)
        flags.append(i % 5 == 0 and bool(p.valid.all()))
    expected = [repack(w, p, all_valid=ok).values for w, p, ok in zip(weights, packs, flags, strict=True)]
    poison_allocator()
    got = repack_many(weights, packs, all_valid=flags)
    torch.cuda.synchronize()
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(g.values, e), i


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


@pytest.mark.parametrize("backend", ["sparse", "auto"])
@pytest.mark.parametrize(("pattern", "extra"), [("64:2:8", {}), ("2:4", {"transposable": True}), ("64:2:16", {})])
def test_50_steps_track_masked_dense(pattern, extra, backend, monkeypatch):
    monkeypatch.setenv("HF_SPARSE_BACKEND", backend)
    runs = []
    for kernels in (False, True):
        model = _small_bert(seed=0)
        pruner = prune_now(model, pattern, **extra)
        if kernels:
            assert len(enable_kernel_path(model, pruner)) == len(pruner.layers) == 12
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(50):
            ids = torch.randint(1, 512, (8, 64), generator=gen).cuda()
            labels = (ids[:, 0] % 3).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            pruner.apply(opt)  # as the callback does: settled layers (fused AdamW) are not masked again
            losses.append(loss.item())
        for layer in pruner.layers:
            assert (layer.weight[~pruner.masks[layer.name]] == 0).all()
        runs.append(torch.tensor(losses))
    dense, kern = runs
    assert torch.isfinite(kern).all()
    assert (dense - kern).abs().max() < 0.1, (dense, kern)
    assert abs(dense[-10:].mean() - kern[-10:].mean()) < 0.03 * dense[-10:].mean()


def test_sparse_trainer_makes_layers_compact_on_cuda(tmp_path):
    seen = []

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(sum(isinstance(m, SparseLinear) for m in model.modules()))

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=8,
        bf16=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
    )
    model = _small_bert(seed=2)
    trainer = SparseTrainer(
        model=model,
        args=args,
        train_dataset=ToyClassification(size=64, length=16),
        callbacks=[Probe()],
        sparsity_config=SparsityConfig(pattern="64:2:8", schedule="oneshot", start=0.5, end=0.5),
    )
    trainer.train()
    assert seen[0] == 0 and seen[-1] == 12, seen  # dense until the masks are final at step 3, compact after
    for layer in trainer.pruner.layers:
        assert layer.compact and layer.module._kernel is not None  # trained on its own kernel state
        assert torch.equal(layer.module.mask(), trainer.pruner.masks[layer.name])
        assert torch.isfinite(layer.module.weight).all()


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
def test_loaded_layer_measures_once_and_repacks_only_when_the_values_change(tmp_path, pattern):
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


def test_loaded_model_forward_replays_from_a_cuda_graph(tmp_path, monkeypatch):
    """Inference is often host-bound; a CUDA graph (or torch.compile's "reduce-overhead") removes the host from it.
    The captured forward must read the graph's input buffer on every replay, not the one it was captured with."""
    monkeypatch.setenv("HF_SPARSE_BACKEND", "auto")
    loaded = _loaded_bert(tmp_path, "64:2:8", seed=6)
    ids = random_ids(4, 48, seed=7).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):  # the dispatcher measures on the first call (never during a capture)
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


@pytest.mark.parametrize(("pattern", "extra"), [("2:4", {"transposable": True}), ("64:2:8", {})])
def test_kernel_path_plan_gives_the_results_of_the_lookups_it_replaces(pattern, extra, monkeypatch):
    """The layer keeps the dispatcher's measured choices per call shape and hands them to the autograd function; each
    must land on the part it was measured for (forward, input gradient, weight gradient)."""
    from hf_sparse.nn.sparse_matmul import sparse_linear_unchecked

    monkeypatch.setenv("HF_SPARSE_BACKEND", "auto")
    model = _small_bert(seed=1)
    pruner = prune_now(model, pattern, **extra)
    enable_kernel_path(model, pruner)
    layer = pruner.layers[2].module
    k = layer.__dict__["_hf_sparse_kernel"]
    x = torch.randn(4, 64, layer.in_features, device="cuda")
    g = torch.randn(4, 64, layer.out_features, device="cuda").bfloat16()
    for _ in range(3):  # measures every part, then decides the route
        with torch.autocast("cuda", dtype=torch.bfloat16):
            layer(x.clone().requires_grad_()).backward(g)
    (key, plan), *rest = k.plans.items()
    assert not rest and key[1] and plan[0] is not None and plan[2] is not None
    assert (plan[1] is not None) == (k.packed_t is not None)

    def run(plan):
        xx = x.clone().requires_grad_()
        layer.weight.grad = layer.bias.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = sparse_linear_unchecked(xx, layer.weight, k.packed, layer.bias, k.packed_t, k.lp, k.bias_lp, plan)
        y.backward(g)
        return y, xx.grad, layer.weight.grad, layer.bias.grad

    poison_allocator()
    for planned, looked_up in zip(run(plan), run(None), strict=True):
        assert torch.equal(planned, looked_up)
        assert not bool(torch.isnan(planned).any())
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):  # evaluation: no autograd function
        y = layer(x)
    assert y.dtype == torch.bfloat16 and not y.requires_grad
    assert rel_err(y, run(None)[0]) < 1e-2


def test_kernel_path_training_step_replays_from_a_cuda_graph(monkeypatch):
    """A whole training step captured in a CUDA graph (PyTorch's whole-network recipe) takes the host out of the step
    time. Everything the kernel path does between steps must be in the graph: the repack of the new master values at
    the first layer of each forward and the masking after the optimizer step; a replay that reused the packs of the
    captured step would train on stale weights and drift from the eager run."""
    monkeypatch.setenv("HF_SPARSE_BACKEND", "auto")
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randint(1, 512, (8, 64), generator=gen).cuda() for _ in range(8)]

    def setup():
        model = _small_bert(seed=0)
        pruner = prune_now(model, "2:4", transposable=True)
        assert len(enable_kernel_path(model, pruner)) == 12
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        ids = batches[0].clone()

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                loss = model(input_ids=ids, labels=ids[:, 0] % 3).loss
            loss.backward()
            opt.step()
            pruner.apply()
            return loss

        return model, pruner, opt, ids, step

    model, pruner, opt, ids, step = setup()
    eager = []
    for batch in batches:
        ids.copy_(batch)
        eager.append(step().item())
        opt.zero_grad(set_to_none=True)
    model, pruner, opt, ids, step = setup()
    replayed = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for batch in batches[:3]:
            ids.copy_(batch)
            replayed.append(step().item())
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    for batch in batches[3:]:
        ids.copy_(batch)
        graph.replay()
        replayed.append(loss.item())
    assert kernel_path_layers(model), "the kernel path was switched off"
    torch.testing.assert_close(torch.tensor(replayed), torch.tensor(eager), rtol=2e-3, atol=2e-3)
    for layer in pruner.layers:
        assert (layer.weight[~pruner.masks[layer.name]] == 0).all()
