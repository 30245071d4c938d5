"""The kernel-path switch (hf_sparse.nn.kernel_path) on CPU: a no-op without CUDA; with ``allow_cpu`` (the ops'
reference implementations) the full machinery — forward through sparse_linear, lazy repack after an optimizer step,
unchanged state dict, gradients zero at pruned positions — checked against the dense masked path."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_config
from helpers import prune_now
from transformers import AutoModelForSequenceClassification

from hf_sparse import SparsityConfig
from hf_sparse.nn.kernel_path import disable_kernel_path, enable_kernel_path, kernel_path_layers, kernel_pattern
from hf_sparse.patterns import parse_pattern


def _model(family="bert", seed=0):
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(tiny_config(family))


def test_config_kernels_field_validates_and_round_trips():
    assert SparsityConfig().kernels == "auto"
    assert SparsityConfig(kernels="never").kernels == "never"
    with pytest.raises(ValueError, match="kernels='sometimes'.*'auto' or 'never'"):
        SparsityConfig(kernels="sometimes")
    cfg = SparsityConfig(pattern="64:2:8", kernels="never")
    assert SparsityConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("2:4", (64, 4)),
        ("64:2:8", (64, 8)),
        ("128:2:32", (128, 32)),
        ("2:8", None),
        ("32:2:8", None),
        ("64:3:8", None),
        ("unstructured:0.5", None),
    ],
)
def test_kernel_pattern(spec, expected):
    assert kernel_pattern(parse_pattern(spec)) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_enable_is_a_noop_without_cuda():
    model = _model()
    pruner = prune_now(model, "64:2:8")
    forwards = {name: m.forward for name, m in model.named_modules()}
    assert enable_kernel_path(model, pruner) == []
    assert kernel_path_layers(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert {name: m.forward for name, m in model.named_modules()} == forwards


def test_not_final_switches_nothing():
    model = _model()
    cfg = SparsityConfig(pattern="64:2:8", schedule="linear", start=0, end=10, update_every=1)
    from hf_sparse import Pruner

    pruner = Pruner(model, cfg)
    pruner.bind(20)
    pruner.update(1)  # an intermediate level
    assert not pruner.is_final
    assert enable_kernel_path(model, pruner, allow_cpu=True) == []


@pytest.mark.parametrize(("pattern", "extra"), [("64:2:8", {}), ("2:4", {"transposable": True})])
def test_cpu_kernel_path_matches_dense_masked_training(pattern, extra):
    """Same model twice: dense masked path vs kernel path (reference ops), under bf16 autocast, over 2 steps."""
    dense, sparse = _model(seed=3), _model(seed=3)
    p_dense, p_sparse = prune_now(dense, pattern, **extra), prune_now(sparse, pattern, **extra)
    keys = list(sparse.state_dict())
    switched = enable_kernel_path(sparse, p_sparse, allow_cpu=True)
    assert switched == [layer.name for layer in p_sparse.layers] and len(switched) == 12
    assert list(sparse.state_dict()) == keys
    state = sparse.get_submodule(switched[0]).__dict__["_hf_sparse_kernel"]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (dense, sparse)]
    ids, labels = random_ids(4, 12, seed=5), torch.tensor([0, 1, 2, 1])
    values_seen = []
    for _ in range(2):
        losses = []
        for model, pruner, opt in ((dense, p_dense, opts[0]), (sparse, p_sparse, opts[1])):
            model.train()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            for layer in pruner.layers:
                grad = layer.module.weight.grad
                grad = grad.T if layer.transposed else grad
                assert torch.count_nonzero(grad[~pruner.masks[layer.name]]) == 0, layer.name
            opt.step()
            opt.zero_grad()
            pruner.apply()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 2e-2 * max(1.0, abs(losses[0])), losses
        values_seen.append(state.packed.values.clone())
        assert state.packed.dtype == torch.bfloat16 and state.lp.dtype == torch.bfloat16
        if "transposable" in extra:
            assert state.packed_t is not None
    # the pack follows the master: rebuilt after every step (lazily, by the next forward)
    assert not torch.equal(values_seen[0], values_seen[1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        sparse.eval()
        sparse(input_ids=ids)
    w = p_sparse.layers[0].weight.detach()
    mask = p_sparse.masks[p_sparse.layers[0].name]
    from hf_sparse.ops import dense_from_packed

    assert torch.equal(dense_from_packed(state.packed, torch.float32), torch.where(mask, w, 0.0).bfloat16().float())
    # no autocast and an fp32 weight: Sparse Tensor Cores have no fp32 mode, the layer runs its dense forward
    before = state.packed.values
    with torch.no_grad():
        out_fp32 = sparse(input_ids=ids).logits
    assert state.packed.values is before and out_fp32.dtype == torch.float32
    assert disable_kernel_path(sparse) == 12 and kernel_path_layers(sparse) == []
    with torch.no_grad():
        assert torch.equal(sparse(input_ids=ids).logits, out_fp32)


def test_replaced_mask_triggers_full_pack():
    model = _model(seed=1)
    pruner = prune_now(model, "64:2:8")
    enable_kernel_path(model, pruner, allow_cpu=True)
    name = pruner.layers[0].name
    layer = model.get_submodule(name)
    x = torch.randn(2, 5, layer.in_features)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
        state = layer.__dict__["_hf_sparse_kernel"]
        meta_before = state.packed.meta
        new_mask = torch.flip(pruner.masks[name], dims=[1])  # a different valid 64:2:8 mask (groups mirrored)
        pruner.masks[name] = new_mask
        with torch.no_grad():
            layer.weight.mul_(new_mask)
        y = layer(x)
    assert state.packed.meta is not meta_before
    w, b = layer.weight.detach(), layer.bias.detach()
    ref = torch.nn.functional.linear(x.bfloat16().float(), w.bfloat16().float(), b.float())
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


def test_gpt2_conv1d_layers_take_the_path_with_their_transposed_weight():
    torch.manual_seed(4)
    model = AutoModelForSequenceClassification.from_config(tiny_config("gpt2"))
    twin = AutoModelForSequenceClassification.from_config(tiny_config("gpt2"))
    twin.load_state_dict(model.state_dict())
    pruner, twin_pruner = prune_now(model, "64:2:8"), prune_now(twin, "64:2:8")
    switched = enable_kernel_path(model, pruner, allow_cpu=True)
    assert len(switched) == 8 and all(layer.transposed for layer in pruner.layers)
    ids = random_ids(2, 10, seed=6)
    outs = []
    for m in (model, twin):
        m.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(input_ids=ids).logits
        logits.float().square().sum().backward()
        outs.append(logits.float())
    assert float((outs[0] - outs[1]).norm() / outs[1].norm()) < 2e-2
    for layer, ref in zip(pruner.layers, twin_pruner.layers, strict=True):
        grad, ref_grad = layer.module.weight.grad, ref.module.weight.grad  # Conv1D: stored (in, out)
        assert grad.shape == ref_grad.shape
        assert torch.count_nonzero(grad.T[~pruner.masks[layer.name]]) == 0
        assert float((grad - ref_grad).norm() / ref_grad.norm()) < 5e-2, layer.name


def test_dynamic_masks_and_foreign_forwards_are_left_alone():
    import types

    moving = _model(seed=2)
    dynamic = prune_now(moving, "64:2:8", dynamic=True)  # final pattern, masks still moving
    assert dynamic.is_final and not dynamic.masks_final
    assert enable_kernel_path(moving, dynamic, allow_cpu=True) == []
    model = _model(seed=2)
    pruner = prune_now(model, "64:2:8")
    first = model.get_submodule(pruner.layers[0].name)
    foreign = types.MethodType(lambda self, x: torch.nn.functional.linear(x, self.weight, self.bias), first)
    first.forward = foreign  # e.g. a straight-through masked forward installed by someone else
    switched = enable_kernel_path(model, pruner, allow_cpu=True)
    assert pruner.layers[0].name not in switched and len(switched) == 11
    assert disable_kernel_path(model) == 11
    assert first.__dict__["forward"] is foreign


def test_shadows_follow_a_fused_optimizer_step_without_masking():
    """AdamW(fused=True) writes the parameters without bumping their version counter; the next forward must still
    run on the new weights (nothing else, e.g. the pruner's masking, bumps it here)."""
    model = _model(seed=6)
    pruner = prune_now(model, "64:2:8")
    enable_kernel_path(model, pruner, allow_cpu=True)
    layer = pruner.layers[0]
    state = layer.module.__dict__["_hf_sparse_kernel"]
    ids, labels = random_ids(4, 12, seed=7), torch.tensor([0, 1, 2, 1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=labels).loss.backward()
    version = layer.module.weight._version
    opt.step()
    assert layer.module.weight._version == version  # what the kernel path cannot rely on
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    assert torch.equal(state.lp, layer.module.weight.detach().bfloat16())


def test_fused_masking_bumps_the_version_counter():
    from hf_sparse.masks import apply_masks

    w, mask = torch.randn(8, 8), torch.rand(8, 8) > 0.5
    version = w._version
    apply_masks([(w, mask)])
    assert w._version > version


@pytest.mark.parametrize("sharded", [False, True])
def test_sharded_layer_rebuilds_when_the_weight_keeps_its_version(sharded):
    """FSDP2 all-gathers each step's weights into the same storage and keeps its version counter: a layer marked
    sharded rebuilds its shadows on every forward; an unsharded one (keyed on version and address) cannot see it."""
    from hf_sparse.nn.kernel_path import _LayerKernel

    model = _model(seed=4)
    pruner = prune_now(model, "64:2:8")
    layer = pruner.layers[0]
    state = _LayerKernel(layer.name, layer.module, layer.transposed, pruner, 64, 8, sharded=sharded)
    state.refresh(torch.bfloat16)
    before = state.lp.clone()
    weight = layer.module.weight
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(weight):
        weight.add_(
            torch.randn(weight.shape, generator=torch.Generator().manual_seed(9))
            * weight.masked_fill(~pruner.masks[layer.name], 0).abs().max()
        )
        weight.mul_(pruner.masks[layer.name])
    state.refresh(torch.bfloat16)
    expected = weight.detach().to(torch.bfloat16)
    assert torch.equal(state.lp, expected) == sharded
    assert torch.equal(state.lp, before) != sharded


def test_refresh_without_lp_repacks_from_the_master():
    """Once no dense choice needs the compute-dtype copy of the master, the repack reads the master itself: same
    packed values as packing the cast weight, and no copy kept."""
    from hf_sparse.nn.kernel_path import _LayerKernel
    from hf_sparse.ops import pack

    model = _model(seed=8)
    pruner = prune_now(model, "64:2:8")
    layer = pruner.layers[0]
    mask = pruner.masks[layer.name]
    state = _LayerKernel(layer.name, layer.module, layer.transposed, pruner, 64, 8)
    state.refresh(torch.bfloat16, need_lp=False)
    assert state.lp is None
    weight = layer.module.weight
    assert torch.equal(state.packed.values, pack(weight.detach().bfloat16(), mask, 64, 8, torch.bfloat16).values)
    with torch.no_grad():  # an optimizer step: new values (not representable in bf16), same mask
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * weight.abs().max())
        weight.mul_(mask)
    state.refresh(torch.bfloat16, need_lp=False)
    assert state.lp is None
    assert torch.equal(state.packed.values, pack(weight.detach().bfloat16(), mask, 64, 8, torch.bfloat16).values)
    state.refresh(torch.bfloat16)  # a dense choice appears: the copy is made without touching the packs
    assert torch.equal(state.lp, weight.detach().bfloat16())


def _on_kernel_path_after_backward(seed: int):
    """A tiny BERT pruned 64:2:8 on the kernel path (CPU references), after one bf16 backward: (model, pruner, the
    layers' kernel-path states, an AdamW over the model, not stepped yet)."""
    model = _model(seed=seed)
    pruner = prune_now(model, "64:2:8")
    enable_kernel_path(model, pruner, allow_cpu=True)
    states = [layer.module.__dict__["_hf_sparse_kernel"] for layer in pruner.layers]
    ids, labels = random_ids(4, 12, seed=seed + 1), torch.tensor([0, 1, 2, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=labels).loss.backward()
    return model, pruner, states, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_first_stale_layer_repacks_every_used_layer_at_once():
    """After an optimizer step the first kernel-path call repacks every layer that ran on the kernels since the last
    batch (one launch on CUDA), from the new master values; a layer that did not run is left to its own call."""
    from hf_sparse.ops import pack

    model, pruner, states, opt = _on_kernel_path_after_backward(seed=12)
    opt.step()
    pruner.apply()
    idle = states[-1]
    idle.used = False  # as if the last layer had taken the dense route last step
    old_idle_values = idle.packed.values.clone()
    first = pruner.layers[0].module
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first(torch.randn(3, first.in_features))
    for layer, state in zip(pruner.layers[:-1], states[:-1], strict=True):
        expected = pack(layer.weight.detach().bfloat16(), pruner.masks[layer.name], 64, 8, torch.bfloat16)
        assert torch.equal(state.packed.values, expected.values), layer.name
        assert torch.equal(state.bias_lp, layer.module.bias.detach().bfloat16()), layer.name
        assert state._weight_key == state.weight_key(torch.bfloat16)
    assert torch.equal(idle.packed.values, old_idle_values)  # not repacked: its own next call does it
    assert idle._weight_key != idle.weight_key(torch.bfloat16)


def test_a_bias_changed_in_place_reaches_the_kernel_path():
    """The bias's compute-dtype copy follows the bias's own version, not only optimizer steps."""
    model = _model(seed=14)
    pruner = prune_now(model, "64:2:8")
    enable_kernel_path(model, pruner, allow_cpu=True)
    module = pruner.layers[0].module
    x = torch.randn(5, module.in_features)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        module(x)
        module.bias.add_(torch.rand(module.bias.shape) + 1.0)
        y = module(x).float()
    expected = torch.nn.functional.linear(
        x.bfloat16().float(), module.weight.bfloat16().float(), module.bias.bfloat16().float()
    )
    assert torch.allclose(y, expected, atol=5e-2, rtol=2e-2)


def test_batched_repack_also_repacks_the_dispatchers_2to4_view():
    """A V:2:M layer the dispatcher runs on its 2:4 view: the batch repacks the view with the pack, and the next
    call finds it current (no second repack)."""
    from hf_sparse.ops import dispatch
    from hf_sparse.ops._layout import dense_from_packed

    model, pruner, states, opt = _on_kernel_path_after_backward(seed=15)
    try:
        target = states[1]
        view = dispatch._view24(target.weight(), target.packed)  # as a "sparse24" choice would build it
        opt.step()
        pruner.apply()
        first = pruner.layers[0].module
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            first(torch.randn(3, first.in_features))
        new_view = dispatch.view24_of(target.packed)
        assert new_view is not None and new_view is not view
        expected = target.weight().detach().bfloat16().float()
        assert torch.equal(dense_from_packed(new_view, torch.float32), expected)
        assert dispatch._view24(target.weight(), target.packed) is new_view  # current: not repacked again
    finally:
        dispatch.clear_cache()


def test_no_stale_bias_copy_after_the_model_moves_to_the_compute_dtype():
    """A bf16 copy of the bias made under autocast is dropped once the bias itself is bf16 (``model.bfloat16()``):
    the forward then reads the bias, with whatever values it has now."""
    model = _model(seed=17)
    pruner = prune_now(model, "64:2:8")
    enable_kernel_path(model, pruner, allow_cpu=True)
    module = pruner.layers[0].module
    state = module.__dict__["_hf_sparse_kernel"]
    x = torch.randn(5, module.in_features)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=random_ids(2, 6, seed=18))
    assert state.bias_lp is not None
    model.bfloat16()
    with torch.no_grad():
        module.bias.add_(1.0)
        y = module(x.bfloat16()).float()
    assert state.bias_lp is None
    expected = torch.nn.functional.linear(x.bfloat16().float(), module.weight.float(), module.bias.float())
    assert torch.allclose(y, expected, atol=5e-2, rtol=2e-2)
