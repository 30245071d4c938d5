"""The compact layer's kernel state, checked on CPU: its packs against the layout the kernels are specified by
(``values_to_kernel``, ``pack``), the SpMM reference on them against the dense products, and the autograd function
of the CUDA path (run here on the ops' CPU references) against the masked dense layer, for every plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_sparse.masks import compute_mask
from hf_sparse.nn import SparseLinear
from hf_sparse.nn.compact import kernel_pattern, positions
from hf_sparse.nn.compiled import compact_linear
from hf_sparse.nn.refresh import PACK, TRANSPOSED, VIEW24, kept_index_of
from hf_sparse.ops import pack, spmm_reference
from hf_sparse.ops._layout import dense_from_packed, values_to_kernel
from hf_sparse.patterns import parse_pattern

# odd-ish shapes: rows % 16 == 8 and groups % 8 != 0 exercise every piece of the strided refresh
SHAPES = [("2:4", 40, 72), ("2:4", 192, 320), ("64:2:8", 128, 200), ("128:2:16", 128, 96), ("64:2:8", 192, 320)]


def _layer(spec: str, rows: int, cols: int, transposable: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.nn.Linear(cols, rows)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(rows, cols, generator=gen))
        dense.bias.copy_(torch.randn(rows, generator=gen))
    mask = compute_mask(dense.weight.detach().abs(), parse_pattern(spec), transposable=transposable)
    layer = SparseLinear.from_dense(dense, mask, spec)
    return layer, torch.where(mask, dense.weight.detach(), 0.0), mask


@pytest.mark.parametrize(("spec", "rows", "cols"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pack_is_the_kernel_layout_of_the_values(spec, rows, cols, dtype):
    layer, dense, _ = _layer(spec, rows, cols)
    k = layer.kernel_state(dtype)
    assert torch.equal(k.packed.values, values_to_kernel(layer.weight.detach(), dtype))
    assert torch.equal(dense_from_packed(k.packed, torch.float32), dense.to(dtype).float())
    assert k.buf.numel() == k.packed.values.numel() and layer.kernel_state(dtype) is k
    held = k.buf.data_ptr()
    with torch.no_grad():  # new values: the next inference call refreshes the same pack in place
        layer.weight.mul_(-2.0)
        layer(torch.randn(2, cols))  # the CPU reference path does not refresh the kernel state
        k(layer, torch.randn(2, cols))
    assert k.buf.data_ptr() == held
    assert torch.equal(k.packed.values, values_to_kernel(layer.weight.detach(), dtype))
    assert torch.equal(dense_from_packed(k.packed, torch.float32), (-2 * dense).to(dtype).float())


@pytest.mark.parametrize(("spec", "rows", "cols"), SHAPES)
def test_a_call_that_trains_holds_no_pack_and_inference_makes_it_again(spec, rows, cols):
    """Training computes on packs made in the call from the values: the layer keeps no pack values between its
    training calls (an evaluation's pack is freed by the next training call), and an inference call after training
    makes the pack from the values as they are then."""
    layer, dense, _ = _layer(spec, rows, cols, seed=5)
    k = layer.kernel_state(torch.bfloat16)
    x = torch.randn(3, cols, requires_grad=True)
    k(layer, x).sum().backward()
    assert k.buf is None and k.packed.values.untyped_storage().nbytes() <= 2
    assert all(q is None or q.values.numel() == 0 for q in (k.packed_t, k.packed24))
    with torch.no_grad():
        layer.weight.mul_(3.0)
        k(layer, x)
    assert torch.equal(k.packed.values, values_to_kernel(layer.weight.detach(), torch.bfloat16))
    assert torch.equal(dense_from_packed(k.packed, torch.float32), (3 * dense).bfloat16().float())
    k(layer, x)
    assert k.buf is None


@pytest.mark.parametrize(("rows", "cols"), [(40, 72), (192, 320)])
def test_transposed_pack_of_a_transposable_mask(rows, cols):
    layer, dense, mask = _layer("2:4", rows, cols, transposable=True, seed=1)
    k = layer.kernel_state(torch.bfloat16)
    x = torch.randn(3, cols, requires_grad=True)
    k(layer, x)  # the first call that trains makes the transposed pack's metadata; its values are made per call
    assert k.transposable and k.packed_t.values.numel() == 0
    expected = pack(dense.t().contiguous(), mask.t().contiguous(), 64, 4, torch.bfloat16)
    assert torch.equal(k._made(layer, TRANSPOSED).values, expected.values)
    assert torch.equal(k.packed_t.meta, expected.meta)
    with torch.no_grad():
        layer.weight.add_(1.0)
    made = k._made(layer, TRANSPOSED)
    assert torch.equal(made.values, pack((dense + mask).t().contiguous(), mask.t(), 64, 4, torch.bfloat16).values)
    # the SpMM reference on the packs gives the forward and the input-gradient products
    w = torch.where(mask, dense + 1.0, 0.0).bfloat16().float()
    xb = torch.randn(5, cols).bfloat16()
    dy = torch.randn(5, rows).bfloat16()
    own = k._made(layer, PACK)
    torch.testing.assert_close(spmm_reference(xb, own).float(), (xb.float() @ w.t()).bfloat16().float())
    torch.testing.assert_close(spmm_reference(dy, made).float(), (dy.float() @ w).bfloat16().float())


def test_plain_2to4_mask_is_not_transposed():
    layer, _, _ = _layer("2:4", 64, 64)
    k = layer.kernel_state(torch.bfloat16)
    k(layer, torch.randn(2, 64, requires_grad=True))
    assert k.transposable is False and k.packed_t is None


@pytest.mark.parametrize(("spec", "rows", "cols"), [("64:2:8", 128, 200), ("128:2:16", 128, 96), ("64:2:8", 192, 320)])
def test_view24_is_the_2to4_pack_of_the_vnm_weight(spec, rows, cols):
    """A V:2:M weight keeps at most 2 of every 4 aligned columns: its 2:4 view is ``pack`` of the dense weight as
    2:4 (padding where a chunk keeps fewer), made from the kept positions and the values as they are."""
    layer, dense, mask = _layer(spec, rows, cols, seed=3)
    k = layer.kernel_state(torch.bfloat16)
    k._ensure_view24(layer)
    expected = pack(dense, mask, 64, 4, torch.bfloat16)
    assert k.packed24.values.numel() == 0  # only the metadata is held
    assert torch.equal(k._made(layer, VIEW24).values, expected.values) and torch.equal(k.packed24.meta, expected.meta)
    assert k.packed24.m == 4
    with torch.no_grad():
        layer.weight.add_(1.0)
    w = torch.where(mask, dense + 1.0, 0.0)
    view = k._made(layer, VIEW24)
    assert torch.equal(view.values, pack(w, mask, 64, 4, torch.bfloat16).values)
    xb = torch.randn(5, cols).bfloat16()
    ref = (xb.float() @ w.bfloat16().float().t()).bfloat16().float()
    torch.testing.assert_close(spmm_reference(xb, view).float(), ref)
    k.plans[(8, False)] = ("sparse24", "dense", "gemm")  # an inference call on the view made from the values
    with torch.no_grad():
        y = k(layer, xb.float()[:5])
    ref_b = F.linear(xb.float(), w.bfloat16().float(), layer.bias.detach().bfloat16().float())
    assert float((y.float() - ref_b).abs().max()) <= 2e-2 * float(ref_b.abs().max())


def test_inference_on_the_view_frees_the_vnm_values():
    """An inference plan on the 2:4 view keeps the view only (the layer's own pack values are freed, the metadata
    stays for the SDDMM); a later change of the values is still picked up."""
    layer, dense, mask = _layer("64:2:8", 128, 200, seed=4)
    k = layer.kernel_state(torch.bfloat16)
    k._ensure_view24(layer)
    k.plans[(8, False)] = ("sparse24", "dense", "gemm")
    k._drop_unused(layer, trains=False)
    assert k.buf is None and k.packed24 is not None and layer._index is None
    assert k.packed.values.untyped_storage().nbytes() == 2  # a zero standing for the freed values
    x = torch.randn(8, 200).bfloat16()
    with torch.no_grad():
        layer.weight.mul_(-1.0)
        y = k(layer, x)
    w = torch.where(mask, -dense, 0.0).bfloat16().float()
    ref = F.linear(x.float(), w, layer.bias.detach().bfloat16().float())
    assert float((y.float() - ref).abs().max()) <= 2e-2 * float(ref.abs().max())
    assert k.buf is None and layer._index is None


PLANS = [
    ("sparse", "sparse", "gemm"),
    ("sparse", "sparse", "sddmm"),
    ("dense", "dense", "gemm"),
    ("sparse", "dense", "sddmm"),
    ("sparse24", "dense", "sddmm"),
    ("sparse24", "dense", "gemm"),
]


@pytest.mark.parametrize("plan", PLANS, ids=["-".join(p) for p in PLANS])
@pytest.mark.parametrize(("spec", "rows", "cols"), [("2:4", 40, 72), ("2:4", 192, 320), ("64:2:8", 192, 320)])
def test_autograd_function_matches_masked_dense(plan, spec, rows, cols):
    """Forward, input, weight and bias gradients of the kernel path (ops on their CPU references, bf16) against the
    masked dense layer in fp32 on the same bf16-rounded operands."""
    transposable = spec == "2:4" and rows == 192
    if plan[1] == "sparse" and not transposable:
        pytest.skip("the sparse input gradient needs a transposable mask")
    if plan[0] == "sparse24" and spec == "2:4":
        pytest.skip("the 2:4 view is a V:2:M layer's")
    layer, dense, _ = _layer(spec, rows, cols, transposable=transposable, seed=2)
    k = layer.kernel_state(torch.bfloat16)
    if plan[0] == "sparse24":
        k._ensure_view24(layer)
    x = torch.randn(37, cols).bfloat16()
    g = torch.randn(37, rows).bfloat16()
    k.plans[(64, True)] = plan
    xs = x.clone().requires_grad_()
    y = k(layer, xs)
    y.backward(g)
    assert y.dtype == torch.bfloat16 and xs.grad.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.float32 and layer.weight.grad.shape == layer.weight.shape

    wr = dense.bfloat16().float().requires_grad_()
    br = layer.bias.detach().bfloat16().float().requires_grad_()
    xr = x.float().requires_grad_()
    yr = F.linear(xr, wr, br)
    yr.backward(g.float())

    def close(a, b, tol=2e-2):
        a, b = a.detach().float(), b.detach()
        assert float((a - b).abs().max()) <= tol * float(b.abs().max()), (a, b)

    close(y, yr)
    close(xs.grad, xr.grad)
    close(layer.weight.grad.reshape(-1), wr.grad.reshape(-1)[layer.kept_index])
    close(layer.bias.grad, br.grad)
    assert k.plans[(64, True)] == plan


@pytest.mark.parametrize("forward", ["sparse", "sparse24"])
def test_inference_call_without_autograd_and_gelu(forward):
    layer, dense, _ = _layer("64:2:8", 128, 64)
    layer.activation = "gelu"
    k = layer.kernel_state(torch.bfloat16)
    if forward == "sparse24":
        k._ensure_view24(layer)
        k.plans[(32, False)] = (forward, "dense", "gemm")
    x = torch.randn(4, 6, 64).bfloat16()
    with torch.no_grad():
        y = k(layer, x)
    assert y.shape == (4, 6, 128) and not y.requires_grad and k.plans[(32, False)][0] == forward
    ref = F.gelu(F.linear(x.float(), dense.bfloat16().float(), layer.bias.detach().bfloat16().float()))
    assert float((y.float() - ref).abs().max()) <= 2e-2 * float(ref.abs().max())
    layer.activation = None  # a different activation: a new kernel state
    assert layer.kernel_state(torch.bfloat16) is not k


def test_kernel_state_is_not_in_the_state_dict_and_dropped_by_to():
    layer, _, _ = _layer("2:4", 64, 64)
    keys = set(layer.state_dict())
    layer.kernel_state(torch.bfloat16)
    assert set(layer.state_dict()) == keys == {"weight", "weight_indices", "bias"}
    layer.to(torch.float64)
    assert layer._kernel is None


def test_compiles_without_graph_breaks():
    """The reference path (CPU), and the kernel path as torch.compile traces it (``compact_linear``: one
    ``hf_sparse::compact_linear`` op per layer, run here on its CPU reference): no graph break, and the compiled
    forward and backward (AOTAutograd, so the op's registered backward runs) equal the eager kernel path's."""
    layer, _, _ = _layer("2:4", 64, 128, transposable=True)
    x = torch.randn(8, 128)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    k = layer.kernel_state(torch.bfloat16)
    xb = x.bfloat16().requires_grad_()
    y_eager = k(layer, xb)  # eager first call: transposed pack and plan exist
    y_eager.float().square().sum().backward()
    expected = (xb.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    layer.zero_grad()
    xb.grad = None

    def call(t):
        return compact_linear(layer, t, torch.bfloat16)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(call)(xb)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    y = torch.compile(call, backend="aot_eager", fullgraph=True)(xb)
    y.float().square().sum().backward()
    assert torch.equal(y, y_eager)
    for got, want in zip((xb.grad, layer.weight.grad, layer.bias.grad), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("spec", ["2:4", "64:2:8"])
def test_compiled_layers_guard_on_their_tensors_not_on_shared_objects(spec):
    """What a compiled graph checks on every call: torch.compile guards each object the traced code reads, and an
    object reached from several layers (their shared pattern, the pack's namedtuple class) is guarded by identity
    between them, in Python, on every call. Two compact layers traced in one graph: no guard on a pattern or on a
    pack's class, and no tensor reached by two paths."""
    first, _, _ = _layer(spec, 64, 128, transposable=spec == "2:4")
    second, _, _ = _layer(spec, 128, 64, transposable=spec == "2:4", seed=1)
    second.pattern = first.pattern  # as in a pruned model: one pattern object for every layer
    for layer, cols in ((first, 128), (second, 64)):
        k = layer.kernel_state(torch.bfloat16)
        k(layer, torch.randn(8, cols).bfloat16().requires_grad_())  # its training plan and transposed pack

    def call(t):
        return compact_linear(second, compact_linear(first, t, torch.bfloat16), torch.bfloat16)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(call)(torch.randn(8, 128).bfloat16().requires_grad_())
    assert explained.graph_break_count == 0, explained.break_reasons
    names = [guard.name for guard in explained.out_guards]
    assert any("_kernel" in name for name in names)  # the kernel state is what the graph reads
    shared = [n for n in names if "pattern" in n or "_replace" in n or "_make" in n or "__class__" in n]
    assert not shared, shared
    aliased = [g for g in explained.out_guards if "DUPLICATE_INPUT" in str(g.create_fn_name()) and "L[" in g.name]
    assert not aliased, [g.name for g in aliased]


def test_a_compiled_graph_serves_one_token_bucket():
    """The plan is a constant of the compiled graph, so a graph must serve one token bucket only: token counts in
    one bucket share a graph (also once the shapes turn dynamic), another bucket traces again and measures its own
    plan; every call equals the eager layer (activation included), forward and backward, with no graph break."""
    layer, dense, _ = _layer("2:4", 64, 128)
    layer.activation = "gelu"
    compiled = torch.compile(lambda t: compact_linear(layer, t, torch.bfloat16), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    traced = []
    for tokens in (8, 5, 6, 7, 16, 3):
        x = torch.randn(tokens, 128).bfloat16().requires_grad_()
        y = compiled(x)
        y.float().sum().backward()
        ref_w = dense.bfloat16().float().requires_grad_()
        x_ref = x.detach().float().requires_grad_()
        ref = F.gelu(F.linear(x_ref, ref_w, layer.bias.detach().bfloat16().float()))
        ref.sum().backward()
        ref = ref.detach()
        assert float((y.detach().float() - ref).abs().max()) <= 2e-2 * float(ref.abs().max()), tokens
        torch.testing.assert_close(x.grad.float(), x_ref.grad, atol=5e-2, rtol=2e-2)
        traced.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # 8: a graph; 5: dynamic shapes, bucket 8 again; 6, 7: the same graph; 16, 3: a graph each
    assert traced[2:4] == [traced[1]] * 2 and traced[4] > traced[3] and traced[5] > traced[4], traced


def test_compiles_on_the_view_without_graph_breaks():
    """A V:2:M layer whose plan runs the forward on its 2:4 view, traced and run compiled."""
    layer, dense, _ = _layer("64:2:8", 128, 64)
    k = layer.kernel_state(torch.bfloat16)
    k._ensure_transposed(layer)
    k._ensure_view24(layer)
    k.plans[(8, True)] = ("sparse24", "dense", "sddmm")
    x = torch.randn(8, 64).bfloat16().requires_grad_()

    def call(t):
        return compact_linear(layer, t, torch.bfloat16)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(call)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    y = torch.compile(call, backend="aot_eager", fullgraph=True)(x)
    ref = F.linear(x.detach().float(), dense.bfloat16().float(), layer.bias.detach().bfloat16().float())
    assert float((y.detach().float() - ref).abs().max()) <= 2e-2 * float(ref.abs().max())
    y.float().sum().backward()
    assert x.grad is not None and layer.weight.grad.shape == layer.weight.shape


def test_index_is_kept_only_for_plans_that_read_it():
    layer, _, _ = _layer("2:4", 64, 64)
    k = layer.kernel_state(torch.bfloat16)
    k.plans = {(32, False): ("sparse", "dense", "gemm"), (32, True): ("sparse", "sparse", "sddmm")}
    assert not k.uses_index()  # inference plans ignore the gradient parts
    k.plans[(64, True)] = ("sparse", "dense", "gemm")
    assert k.uses_index()


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


def test_what_runs_after_each_optimizer_step():
    """The compact layers' refresh rides on the global optimizer post-step hook (compiled code relies on it): a
    function given to ``after_optimizer_step`` runs once after every step of any torch optimizer, fused or not, after
    the step count moved; ``refresh_all`` is among them."""
    from hf_sparse.nn import compact, optimizer_steps

    assert compact.refresh_all in optimizer_steps._after
    seen = []

    def record():
        seen.append(optimizer_steps.optimizer_steps())

    optimizer_steps.watch_optimizer_steps()
    optimizer_steps.after_optimizer_step(record)
    optimizer_steps.after_optimizer_step(record)  # once only
    try:
        w = torch.nn.Parameter(torch.randn(4))
        for opt in (torch.optim.SGD([w], lr=0.1), torch.optim.AdamW([w], lr=0.1, foreach=False)):
            before = optimizer_steps.optimizer_steps()
            w.sum().backward()
            opt.step()
            opt.step()
            assert seen[-2:] == [before + 1, before + 2]
    finally:
        optimizer_steps._after.remove(record)
    assert len(seen) == 4


@pytest.mark.parametrize(("spec", "rows", "cols"), [*SHAPES, ("128:2:8", 256, 64), ("64:2:32", 64, 128)])
def test_kept_positions_in_their_on_disk_form_give_the_kept_index(spec, rows, cols):
    """What the extension's dense choices read instead of a kept index (``positions``: the layer's own on-disk
    buffers, decoded in place by ``gather_kept`` / ``scatter_kept``): its reference decoding equals the layer's kept
    index, which the on-disk format defines, for 2:4 and V:2:M at several V and M."""
    layer, _, mask = _layer(spec, rows, cols, seed=3)
    v, m = (1, 4) if spec == "2:4" else (parse_pattern(spec).v, parse_pattern(spec).m)
    sel, sel_columns, v_g = positions(layer)
    assert v_g == v and (sel_columns is None) == (spec == "2:4")
    index = kept_index_of(sel, sel_columns, rows, cols, v, m)
    assert index.shape == layer.weight.shape
    assert torch.equal(index.view(-1), layer.kept_index)
    assert torch.equal(torch.zeros(rows * cols, dtype=torch.bool).index_fill_(0, index.view(-1), True), mask.view(-1))


def test_refresh_table_entries_have_the_extensions_layout():
    """A ``PACK`` or ``COPY`` entry is as many 64-bit words as ``csrc/kernels.h`` says its ``RefreshEntry`` is, with
    the pointers first and the kind and dtypes in the last two; the packs a training call makes by their own kernels
    (``TRANSPOSED``, ``VIEW24``) are refused, so a table cannot send them to a kernel that no longer reads them."""
    import re
    from pathlib import Path

    from hf_sparse.nn.refresh import COPY, RefreshEntry

    header = (Path(__file__).resolve().parents[1] / "csrc" / "kernels.h").read_text()
    words = int(re.search(r"constexpr int kRefreshWords = (\d+);", header).group(1))
    layer, _, _ = _layer("2:4", 40, 72, transposable=True, seed=3)
    k = layer.kernel_state(torch.bfloat16)
    src, dst = layer.weight.detach(), torch.empty(k.n, dtype=torch.bfloat16)
    pack_words = RefreshEntry(PACK, src, dst, k.rows, k.groups, k.shape[1]).words(7)
    assert len(pack_words) == words
    assert pack_words[:2] == [src.data_ptr(), dst.data_ptr()]
    assert pack_words[2:7] == [dst.numel(), 40, 72 // 4, k.shape[1], 7]
    assert pack_words[7:] == [PACK | 0 << 32, 1]  # kRefreshF32 source, kRefreshBF16 destination
    bias = layer.bias.detach()
    assert RefreshEntry(COPY, bias, bias.bfloat16()).words(0)[7:] == [COPY, 1]
    for kind in (TRANSPOSED, VIEW24):
        with pytest.raises(ValueError, match="not PACK"):
            RefreshEntry(kind, src, dst, 72, 10, 2).words(0)
