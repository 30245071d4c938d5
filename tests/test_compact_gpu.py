"""GPU: compact layers (``SparseLinear.from_dense``) train and infer on their own kernel state, against the masked
dense layer, and hold no dense copy of their weight."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from helpers import prune_now
from ops._helpers import poison_allocator

from hf_sparse.masks import compute_mask
from hf_sparse.nn import SparseLinear
from hf_sparse.nn.compact import positions
from hf_sparse.nn.refresh import kept_index_of
from hf_sparse.ops import spmm_reference
from hf_sparse.patterns import parse_pattern

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [("2:4", False), ("2:4", True), ("64:2:8", False)]
PLANS = [
    None,
    ("sparse", "sparse", "gemm"),
    ("sparse", "dense", "sddmm"),
    ("dense", "dense", "gemm"),
    ("sparse24", "dense", "sddmm"),
    ("sparse24", "dense", "gemm"),
]


def _pair(spec: str, transposable: bool, rows: int = 192, cols: int = 320, seed: int = 0, dtype=torch.float32):
    """A compact layer and the masked dense ``nn.Linear`` it replaces, on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.nn.Linear(cols, rows)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(rows, cols, generator=gen) * 0.05)
        dense.bias.copy_(torch.randn(rows, generator=gen) * 0.05)
    mask = compute_mask(dense.weight.detach().abs(), parse_pattern(spec), transposable=transposable)
    with torch.no_grad():
        dense.weight.mul_(mask)
    dense = dense.to("cuda", dtype)
    ref = torch.nn.Linear(cols, rows, device="cuda", dtype=dtype)
    ref.load_state_dict(dense.state_dict())
    return SparseLinear.from_dense(dense, mask.cuda(), spec), ref


def _close(a, b, tol=2e-2):
    a, b = a.detach().float(), b.detach().float()
    assert not bool(torch.isnan(a).any())
    assert float((a - b).abs().max()) <= tol * float(b.abs().max()), float((a - b).abs().max())


@pytest.mark.parametrize("plan", PLANS, ids=["measured" if p is None else "-".join(p) for p in PLANS])
@pytest.mark.parametrize(("spec", "transposable"), CASES, ids=["2:4", "2:4T", "64:2:8"])
def test_training_step_matches_masked_dense(spec, transposable, plan):
    """fp32 master under bf16 autocast, 37 tokens, fresh random inputs on every call: output and every gradient
    against the masked ``nn.Linear`` under the same autocast."""
    layer, ref = _pair(spec, transposable)
    k = layer.kernel_state(torch.bfloat16)
    if plan is not None:
        if plan[1] == "sparse" and not transposable:
            pytest.skip("a sparse input gradient needs a transposable mask")
        if plan[0] == "sparse24" and spec == "2:4":
            pytest.skip("the 2:4 view is a V:2:M layer's")
        k._ensure_transposed(layer)
        if plan[0] == "sparse24":
            k._ensure_view24(layer)
        k.plans[(64, True)] = plan
    for step in range(3):
        x = torch.randn(37, 320, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        g = torch.randn(37, 192, device="cuda", dtype=torch.bfloat16)
        outs = []
        for mod in (layer, ref):
            mod.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = mod(xx)
            y.backward(g)
            outs.append((y, xx.grad))
        (ys, dxs), (yr, dxr) = outs
        assert ys.dtype == yr.dtype == torch.bfloat16
        _close(ys, yr)
        _close(dxs, dxr)
        assert layer.weight.grad.shape == layer.weight.shape and layer.weight.grad.dtype == torch.float32
        _close(layer.weight.grad.reshape(-1), ref.weight.grad.reshape(-1)[layer.kept_index])
        _close(layer.bias.grad, ref.bias.grad)
        with torch.no_grad():  # an optimizer-like change: the next call must run on the new values
            new = torch.randn_like(layer.weight) * 0.05
            layer.weight.copy_(new)
            ref.weight.view(-1)[layer.kept_index] = new.view(-1)
    assert transposable == (k.packed_t is not None) or plan is None
    if plan is None:  # measured: what the plan saves against the masked dense layer (either sign at 37 tokens)
        saving = k.training_saving_ms()
        assert saving is not None and math.isfinite(saving)
    if plan is not None and plan[0] == "sparse24":  # the native call ran on the view: its metadata is kept
        assert k.packed24 is not None
    # the packs were made inside each call from the values (the changed ones above included): none is held
    assert k.buf is None and all(q is None or q.values.numel() == 0 for q in (k.packed_t, k.packed24))


@pytest.mark.parametrize("plan", [("sparse24", "dense", "gemm"), ("sparse", "dense", "gemm")])
def test_inference_on_the_2to4_view(plan):
    """A 64:2:8 bf16 layer whose inference plan runs on its 2:4 view (or its own pack): outputs match; the view is
    made per call from the layer's own pack, which is all the layer keeps."""
    layer, ref = _pair("64:2:8", False, dtype=torch.bfloat16)
    layer.weight.requires_grad_(False)
    k = layer.kernel_state(torch.bfloat16)
    k._ensure_view24(layer)
    k.plans[(256, False)] = plan
    k._drop_unused(layer, trains=False)
    x = torch.randn(4, 37, 320, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _close(layer(x), ref(x))
        assert k.buf is not None and k.packed24 is None
        new = torch.randn_like(layer.weight) * 0.05  # a changed weight is picked up on the view too
        layer.weight.copy_(new)
        ref.weight.view(-1)[layer.kept_index] = new.view(-1)
        _close(layer(x), ref(x))


def test_fused_adamw_steps_refresh_the_packs():
    """Fused AdamW writes the values without bumping their version: the optimizer-step count makes the refresh."""
    layer, ref = _pair("2:4", True, seed=1)
    ref.weight.register_hook(lambda grad: grad * (ref.weight != 0))  # the masked run
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (layer, ref)]
    for step in range(5):
        x = torch.randn(64, 320, device="cuda")
        losses = []
        for mod, opt in zip((layer, ref), opts, strict=True):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = mod(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[1]), (step, losses)
    _close(layer.weight, ref.weight.view(-1)[layer.kept_index].view_as(layer.weight), 5e-2)


@pytest.mark.parametrize(("spec", "transposable"), CASES, ids=["2:4", "2:4T", "64:2:8"])
def test_inference_in_bf16_holds_no_dense_copy(spec, transposable):
    """A bf16 compact layer (as ``from_pretrained(dtype=bfloat16)`` builds): outputs match, and the memory left
    allocated after its forwards is its values, positions and packs only."""
    layer, ref = _pair(spec, transposable, dtype=torch.bfloat16)
    layer.weight.requires_grad_(False)
    # the sparse forward: a measured dense one would keep the int32 kept index (4 bytes per kept value) to rebuild
    # the transient dense weight from
    layer.kernel_state(torch.bfloat16).plans[(256, False)] = ("sparse", "dense", "gemm")
    x = torch.randn(4, 37, 320, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # the kernel state is built: what the forwards add is measured
    with torch.no_grad():
        for _ in range(3):
            y = layer(x)
        del y
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        k = layer._kernel
        state = sum(t.numel() * t.element_size() for t in (k.buf, k.packed.meta, k.packed.columns))
        assert k.packed_t is None  # inference never builds the transposed pack
        assert layer._index is None  # no index either
        assert held <= 4096, held  # the kernel state existed before: the forwards added nothing (no dense copy)
        _close(layer(x), ref(x))
    own = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    dense = sum(t.numel() * t.element_size() for t in ref.parameters())
    values = layer.weight.numel() * layer.weight.element_size()
    # the pack is the values again in fragment order (plus padding): at 2:4 the layer is about 1.1x dense, at
    # 64:2:8 about 0.6x
    assert own + state <= 2 * values + 0.2 * dense
    if spec == "64:2:8":
        assert own + state < dense


@pytest.mark.parametrize(("spec", "forward"), [("2:4", "sparse"), ("64:2:8", "sparse"), ("64:2:8", "sparse24")])
def test_inference_memory_is_the_checkpoint_tensors(spec, forward):
    """A bf16 layer in inference holds its weights once: after its forwards the memory it takes is at most 1.05x
    the bytes of its on-disk tensors (the pack holds the values and positions: ``CompactKernel.adopt``; a V:2:M
    layer run on its 2:4 view makes the view per call from that pack), and saving gives those tensors back exactly.
    The count covers the layer alone: it starts once the layer, its reference output and everything the test built
    to make them exist (mask selection, cuBLAS's workspaces)."""
    torch.manual_seed(0)
    rows, cols = 2048, 4096
    x = torch.randn(2, 256, cols, device="cuda", dtype=torch.bfloat16)
    dense = torch.nn.Linear(cols, rows, device="cuda", dtype=torch.bfloat16)
    mask = compute_mask(dense.weight.detach().float().abs(), parse_pattern(spec))
    layer = SparseLinear.from_dense(dense, mask, spec)
    expected = torch.nn.functional.linear(x, torch.where(mask, dense.weight.detach(), 0.0), dense.bias.detach())
    on_disk = {name: t.clone() for name, t in layer.state_dict().items()}
    disk_bytes = sum(t.numel() * t.element_size() for t in on_disk.values())
    del dense, mask
    torch.cuda.synchronize()
    # no cached free blocks: a large request served from a larger cached block counts that block's whole size (the
    # allocator splits large blocks only above 1 MiB of remainder), so the count would depend on the tests before
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()  # the layer's on-disk tensors are in it
    k = layer.kernel_state(torch.bfloat16)
    k.plans[(512, False)] = (forward, "dense", "gemm")
    with torch.inference_mode():
        for _ in range(3):
            y = layer(x)
        # the output leaves the GPU before the count: the allocator may have served it from a larger cached block
        # (a kernel's freed scratch), whose whole size memory_allocated() would count
        y = y.cpu()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base + disk_bytes
    assert layer._resident is k and k.packed24 is None
    # what the layer's tensors hold (each storage once): its Parameters and buffers, its kernel state
    storages = {}
    for t in [*layer.parameters(), *layer.buffers(), *_tensors_of(vars(k))]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(storages.values()) <= 1.05 * disk_bytes, (sum(storages.values()), disk_bytes)
    # and what the allocator counts, which may add one unsplit remainder (up to 1 MiB) to a large block it reused
    assert held <= 1.05 * disk_bytes + 2**20, (held, disk_bytes)
    _close(y, expected.cpu())
    for name, t in layer.state_dict().items():
        assert torch.equal(t, on_disk[name]), name


def _tensors_of(values) -> list[torch.Tensor]:
    """The CUDA tensors in an object's attributes (tensors, tuples and dicts of them)."""
    out = []
    for value in values.values() if isinstance(values, dict) else values:
        if isinstance(value, torch.Tensor) and value.is_cuda:
            out.append(value)
        elif isinstance(value, (tuple, list, dict)):
            out += _tensors_of(value)
    return out


# odd shapes: rows % 16 == 8 and groups % 8 != 0 reach the pack's padding
REFRESH_LAYERS = [
    ("2:4", True, 40, 72),
    ("2:4", False, 192, 320),
    ("64:2:8", False, 128, 200),
    ("128:2:16", False, 256, 96),
    ("2:4", True, 200, 136),
    ("2:4", True, 64, 96),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("spec", "forward"), [("2:4", "sparse"), ("64:2:8", "sparse"), ("64:2:8", "sparse24")])
def test_resident_inference_is_one_extension_call_with_the_general_paths_result(spec, forward, bias):
    """A resident layer (its pack holds its values) in a measured token bucket runs ``resident_forward``: the same
    kernel on the same pack as the general path (``"sparse24"``: on the 2:4 view made in the same call), so
    bit-identical output; it leaves every other call (grad mode, autocast, another dtype, a new bucket) to the
    general path, and still refuses a weight written in place."""
    torch.manual_seed(0)
    rows, cols = 1024, 2048
    x = torch.randn(3, 40, cols, device="cuda", dtype=torch.bfloat16)
    dense = torch.nn.Linear(cols, rows, bias=bias, device="cuda", dtype=torch.bfloat16)
    mask = compute_mask(dense.weight.detach().float().abs(), parse_pattern(spec))
    layer = SparseLinear.from_dense(dense, mask, spec)
    b = dense.bias.detach() if bias else None
    expected = torch.nn.functional.linear(x, torch.where(mask, dense.weight.detach(), 0.0), b)
    k = layer.kernel_state(torch.bfloat16)
    k.plans[(128, False)] = (forward, "dense", "gemm")  # set, not measured (a measurement may pick either)
    with torch.inference_mode():
        general = k(layer, x)  # adopts the pack
        assert layer._resident is k and set(k.resident_calls) == {128}
        assert k.packed24 is None  # a V:2:M layer holds no view between calls
        short = k.resident_forward(layer, x)
        assert short is not None and torch.equal(short, general)
        assert torch.equal(layer(x), general)
        assert k.resident_forward(layer, x[:, :5]) is None  # 15 tokens: bucket 16, not measured
        assert k.resident_forward(layer, x.float()) is None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert k.resident_forward(layer, x) is None
    with torch.enable_grad():
        assert k.resident_forward(layer, x) is None
    _close(general, expected)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="written in place while torch.inference_mode"):
        with torch.inference_mode():
            layer(x)


def test_one_launch_refreshes_every_stale_layer_like_the_torch_ops():
    """``refresh_stale`` writes the packs inference holds (own pack, bias cast) of every stale layer in one launch of
    the extension: the same bytes as the torch ops of ``run_refresh_entries``, the layout's padding included (the
    packs are poisoned with NaN first), and layers whose values did not change are not touched. The packs made
    from them (the transposed pack, the 2:4 view: their bytes are ``test_packs_made_in_a_call_are_the_torch_ops_bytes``)
    compute the new layer. A table entry of another kind is refused before it reaches the kernel."""
    from hf_sparse.nn.compact import refresh_stale
    from hf_sparse.nn.refresh import COPY, PACK, TRANSPOSED, VIEW24, run_refresh_entries

    layers = []
    for i, (spec, transposable, rows, cols) in enumerate(REFRESH_LAYERS):
        layer, _ = _pair(spec, transposable, rows, cols, seed=10 + i)
        k = layer.kernel_state(torch.bfloat16)
        if k.refresher is None:
            pytest.skip("the loaded extension has no refresh_packs")
        k._ensure_transposed(layer)  # as on the first call that trains: the transposed pack's metadata
        if spec != "2:4":
            k._ensure_view24(layer)
        layers.append((layer, k))
    k_untouched = layers[-1][1]
    for layer, _ in layers[:-1]:
        with torch.no_grad():
            layer.weight.copy_(torch.randn_like(layer.weight))
            layer.bias.copy_(torch.randn_like(layer.bias))
    expected = []
    for layer, k in layers[:-1]:
        entries = k.refresh_entries(layer)
        assert {e.kind for e in entries} == {PACK, COPY}
        if k.packed_t is not None:
            shape = (*k.packed_t.meta.shape[:2], 32, 8)
            transposed = k.pack_entry(layer, TRANSPOSED, torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
            with pytest.raises(ValueError, match="not PACK"):
                transposed.words(0)
        copies = [e._replace(dst=torch.empty_like(e.dst)) for e in entries]
        for e in copies:
            e.dst.fill_(float("nan"))
            if e.kind == 0:  # torch's _fill leaves the padding alone: start it at zero like a fresh pack
                e.dst.zero_()
        run_refresh_entries(copies)
        expected.append((entries, copies))
        for e in entries:
            e.dst.fill_(float("nan"))
    before = k_untouched.buf.clone()
    refresh_stale(torch.device("cuda", torch.cuda.current_device()))
    for entries, copies in expected:
        for e, c in zip(entries, copies, strict=True):
            assert torch.equal(e.dst, c.dst), e.kind
    assert torch.equal(k_untouched.buf, before)
    for layer, k in layers:  # and the refreshed packs compute the new layer (the format's own reference SpMM)
        x = torch.randn(24, layer.in_features, device="cuda")
        w = layer.dense_weight().detach().bfloat16().float()
        ref = torch.nn.functional.linear(x, layer.dense_weight().detach(), layer.bias.detach())
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            _close(layer(x), ref)
        xb = x.bfloat16()
        if k.packed24 is not None:
            _close(spmm_reference(xb, k._made(layer, VIEW24)).float(), xb.float() @ w.t(), 1e-2)
        if k.packed_t is not None:
            dy = torch.randn(24, layer.out_features, device="cuda").bfloat16()
            _close(spmm_reference(dy, k._made(layer, TRANSPOSED)).float(), dy.float() @ w, 1e-2)


@pytest.mark.parametrize(
    ("spec", "transposable", "rows", "cols"), [*REFRESH_LAYERS[:5], ("64:2:16", False, 192, 208)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_packs_made_in_a_call_are_the_torch_ops_bytes(spec, transposable, rows, cols, dtype, src_dtype):
    """The extension's ``pack_in_call`` (what a training call computes on; bound as ``pack_values``) writes, into
    poisoned memory, the bytes of the torch ops' reference (``CompactKernel._made``) for the layer's own pack, its
    transposed pack and its 2:4 view: odd shapes, M = 4, 8, 16, fp32 and bf16 values, bf16 and fp16 packs."""
    from hf_sparse.nn.refresh import PACK, TRANSPOSED, VIEW24

    layer, _ = _pair(spec, transposable, rows, cols, seed=20, dtype=src_dtype)
    with torch.no_grad():  # fresh values everywhere (not the small scale of _pair), so no two slots look alike
        layer.weight.copy_(torch.randn_like(layer.weight))
    k = layer.kernel_state(dtype)
    if k.refresher is None or not hasattr(k.refresher, "pack_values"):
        pytest.skip("the loaded extension has no pack_values")
    k._ensure_transposed(layer)
    if spec != "2:4":
        k._ensure_view24(layer)
    packs = {PACK: k.packed, TRANSPOSED: k.packed_t, VIEW24: k.packed24}
    kinds = [kind for kind, packed in packs.items() if packed is not None]
    assert kinds == ([PACK, TRANSPOSED] if transposable else [PACK, VIEW24] if spec != "2:4" else [PACK])
    sel, sel_columns, v = positions(layer)
    for kind in kinds:
        expected = k._made(layer, kind).values
        poison_allocator()
        made = k.refresher.pack_values(
            kind, layer.weight.detach(), packs[kind].meta, sel, sel_columns, rows, cols, v, k.m, dtype
        )
        assert made.shape == expected.shape and made.dtype == dtype
        assert torch.equal(made.view(torch.int16), expected.view(torch.int16)), kind
    with pytest.raises(RuntimeError, match="is not a pack"):  # a bad argument raises in Python
        k.refresher.pack_values(7, layer.weight.detach(), k.packed.meta, sel, sel_columns, rows, cols, v, k.m, dtype)


@pytest.mark.parametrize(
    ("spec", "rows", "cols"), [("2:4", 40, 72), ("64:2:8", 128, 200), ("128:2:16", 256, 96), ("64:2:32", 192, 352)]
)
@pytest.mark.parametrize(
    ("src_dtype", "dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
    ],
)
def test_gather_and_scatter_at_the_kept_positions(spec, rows, cols, src_dtype, dtype):
    """``gather_kept`` (the GEMM weight gradient's gather) and ``scatter_kept`` (a transient dense weight) read the
    positions in their on-disk form: on fresh random data and odd shapes, into poisoned memory, they equal
    ``index_select`` / ``index_put`` at the reference kept index, cast to ``dtype``."""
    from hf_sparse.ops._build import load_extension

    ext = load_extension()
    layer = _pair(spec, False, rows, cols, seed=5)[0]
    sel, sel_columns, v = positions(layer)
    m = 4 if spec == "2:4" else parse_pattern(spec).m
    index = kept_index_of(sel, sel_columns, rows, cols, v, m).view(-1)
    src = torch.randn(rows, cols, device="cuda", dtype=src_dtype)
    poison_allocator()
    got = ext.gather_kept(src, sel, sel_columns, rows, cols, v, m, dtype)
    assert got.shape == (rows, 2 * (cols // m)) and got.dtype == dtype
    assert torch.equal(got.view(-1), src.view(-1).index_select(0, index).to(dtype))
    values = torch.randn(rows, 2 * (cols // m), device="cuda", dtype=src_dtype)
    poison_allocator()
    dense = ext.scatter_kept(values, sel, sel_columns, rows, cols, v, m, dtype)
    expected = torch.zeros(rows * cols, device="cuda", dtype=dtype).index_put_((index,), values.view(-1).to(dtype))
    assert dense.shape == (rows, cols) and torch.equal(dense.view(-1), expected)


def test_layers_reading_one_input_under_autocast_save_one_cast_of_it():
    """Three compact layers fed the same fp32 input under bf16 autocast (a decoder's q, k and v) save one bf16 copy
    of it for their weight gradients, not three; their outputs and every gradient still match the masked dense
    layers, and an input written in place between two calls is cast again."""
    pairs = [_pair("2:4", False, rows=64, cols=1024, seed=20 + i) for i in range(3)]
    x = torch.randn(512, 1024, device="cuda", requires_grad=True)
    g = torch.randn(512, 64, device="cuda")
    for layer, _ in pairs:  # plans measured, packs made: the count below sees the calls' own tensors only
        with torch.autocast("cuda", dtype=torch.bfloat16):
            layer(x).float().mul(g).sum().backward()
    x.grad = None
    outs = []
    for mods in ([p[0] for p in pairs], [p[1] for p in pairs]):
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_()
        h = xx * 1.0  # not a leaf, as a hidden state is (autocast caches the casts of leaves)
        torch.cuda.synchronize()
        # No collection inside the window: one would free earlier tests' tensors held in reference cycles and
        # take them off the count (it once read -33 MB for the dense layers)
        gc.collect()
        gc.disable()
        try:
            before = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ys = [mod(h) for mod in mods]
            held = torch.cuda.memory_allocated() - before
        finally:
            gc.enable()
        sum(y.float().mul(g).sum() for y in ys).backward()
        outs.append((ys, xx.grad, [mod.weight.grad for mod in mods], held))
    (ys, dx, dws, held), (yr, dxr, dwr, held_dense) = outs
    cast = x.numel() * 2
    outputs = sum(y.numel() * y.element_size() for y in ys)
    assert held <= cast + outputs + 2**20, (held, cast, outputs)  # one cast (the dense layers: three)
    assert held_dense >= 3 * cast, held_dense
    for a, b in zip(ys, yr, strict=True):
        _close(a, b)
    _close(dx, dxr)
    for (layer, _), dw, dw_ref in zip(pairs, dws, dwr, strict=True):
        _close(dw.reshape(-1), dw_ref.reshape(-1)[layer.kept_index])
    plain = torch.randn(512, 1024, device="cuda")  # written in place between two calls: a new cast
    (layer, ref), (layer2, ref2) = pairs[0], pairs[1]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        first = layer(plain)
        plain.mul_(-2.0)
        second = layer2(plain)
        _close(first, ref(plain / -2.0))
        _close(second, ref2(plain))


@pytest.mark.parametrize(
    ("spec", "rows", "cols"), [("64:2:8", 192, 200), ("128:2:16", 256, 112), ("64:2:32", 64, 160), ("64:2:8", 64, 64)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_view24_of_a_vnm_pack_is_the_2to4_pack_of_the_same_weight(spec, rows, cols, dtype):
    """The extension's ``view24`` (the 2:4 view a V:2:M layer makes per call in inference) is, byte for byte, what
    ``pack`` makes of the same weight as 2:4: fresh random weights, odd group counts (the layouts' padding), outputs
    into NaN-poisoned memory. A 2:4 pack is refused with an error that reaches Python."""
    from hf_sparse.ops import pack
    from hf_sparse.ops._build import load_extension

    ext = load_extension()
    pattern = parse_pattern(spec)
    gen = torch.Generator().manual_seed(rows + cols)
    w = torch.randn(rows, cols, generator=gen)
    mask = compute_mask(w.abs(), pattern).cuda()
    w = w.cuda()
    vnm = pack(w, mask, pattern.v, pattern.m, dtype)
    poison_allocator()
    values, meta = ext.view24(vnm.values, vnm.meta, vnm.columns, rows, cols, pattern.m)
    expected = pack(w, mask, 64, 4, dtype)
    assert values.shape == expected.values.shape and meta.shape == expected.meta.shape
    assert torch.equal(values, expected.values)
    assert torch.equal(meta, expected.meta)
    twofour = pack(w, compute_mask(w.abs(), parse_pattern("2:4")), 64, 4, dtype)
    with pytest.raises(RuntimeError, match="view24"):
        ext.view24(twofour.values, twofour.meta, twofour.columns, rows, cols, 4)


@pytest.mark.parametrize("spec", ["2:4", "64:2:8"])
def test_the_optimizer_step_saves_in_proportion_to_the_elements_not_held(spec):
    """``compaction.optimizer_saving_ms``: the fused AdamW step's GPU time per element, times the elements that four
    compact 4096 x 8192 layers do not hold (half at 2:4, three quarters at 64:2:8), against the step over one such
    whole weight timed here: at least half and at most twice the share it predicts."""
    from hf_sparse import compaction
    from hf_sparse.ops import dispatch

    model = torch.nn.Sequential(*[torch.nn.Linear(8192, 4096) for _ in range(4)]).cuda()
    pruner = prune_now(model, spec, targets=[r"^\d+$"])
    compaction.make_compact(model, pruner)
    assert sum(layer.compact for layer in pruner.layers) == 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    saving = compaction.optimizer_saving_ms(pruner, optimizer)
    param = torch.nn.Parameter(torch.zeros(4096 * 8192, device="cuda"))
    param.grad = torch.randn_like(param)
    whole = dispatch.measure({"whole": torch.optim.AdamW([param], lr=1e-3, fused=True).step})["whole"][0]
    expected = 4 * whole * (0.5 if spec == "2:4" else 0.75)
    assert saving is not None
    assert 0.5 * expected < saving < 2 * expected, (saving, expected)
