"""Calibration passes: run batches through a model block by block, and give each targeted layer its inputs just
before it is pruned.

What :class:`~hf_sparse.Pruner` does with an activation-aware score (SparseGPT's sequential procedure):

1. one forward pass of every batch records what each transformer block is called with (its keyword arguments:
   attention mask, rotary embeddings, ...), and the hidden states entering the first block that holds a targeted
   layer;
2. block by block, for each group of the block's targeted layers that read the same input (query, key and value;
   Llama's gate and up projections), in the order the block calls them: the block runs on every batch until that
   layer's input exists (a forward pre-hook hands it to the score, padding tokens left out, and stops the block
   there), then the group's layers are pruned. Layers later in the block therefore see the outputs of the layers
   already pruned;
3. the block, now pruned, runs on every batch; its outputs are the next block's inputs.

Targeted layers outside the repeated blocks (a pooler, a head named in ``targets``) are done last, one at a time,
with full forward passes of the pruned model.

**Memory.** One block's inputs for all calibration batches (``tokens · hidden · 4`` bytes in float32: 25 MB for
128 sequences of 128 tokens at MiniLM's 384, 50 MB at BERT-base's 768; 128 × 2048 tokens of a 7B-class model in
bf16: 2.1 GB) plus the statistics of one group of layers: Wanda ``in_features`` floats, SparseGPT ``Xᵀ X`` in float32
(2.4 MB for a 768-wide input, 36 MB for BERT-base's 3072-wide FFN output layer, 485 MB for a 7B-class
11008-wide ``down_proj``; about as much again while it is pruned, see :mod:`hf_sparse.sparsegpt`).

**Time.** ``1 + (groups per block) + 1`` forward passes of each block per mask update, a few of them stopped
early: about 4-5 forward passes of the model over the calibration batches for BERT and Llama blocks.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .modeling import TargetLayer, unwrap_model

__all__ = ["CalibrationSource", "prepare_batches", "run_calibration"]

logger = logging.getLogger(__name__)

#: Batches: an iterable of dicts of tensors (a DataLoader), or a function returning one (called at each update).
CalibrationSource = Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]]
#: Batch keys never passed to the model during calibration (no loss is needed).
_LABEL_KEYS = frozenset({"labels", "label", "label_ids", "start_positions", "end_positions"})


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the input it waited for has been seen."""


def prepare_batches(model: nn.Module, source: CalibrationSource, max_batches: int | None = None) -> list[dict]:
    """The model's inputs from up to ``max_batches`` batches of ``source``, on the model's device: tensors only,
    keys that ``model.forward`` names (labels dropped), ``use_cache=False`` where the model takes it."""
    model = unwrap_model(model)
    batches_in = source() if callable(source) else source
    params = inspect.signature(model.forward).parameters
    device = next(model.parameters()).device
    batches: list[dict] = []
    for batch in batches_in:
        if max_batches is not None and len(batches) >= max_batches:
            break
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"calibration batches must be dicts of tensors (as a DataLoader with a Transformers collator yields), "
                f"got {type(batch).__name__}"
            )
        inputs = {
            k: v.to(device) for k, v in batch.items() if isinstance(v, Tensor) and k in params and k not in _LABEL_KEYS
        }
        if not inputs:
            raise ValueError(
                f"calibration batch with keys {sorted(batch)} has no tensor that {type(model).__name__}.forward takes "
                "(input_ids, attention_mask, ...)"
            )
        if "use_cache" in params:
            inputs["use_cache"] = False
        batches.append(inputs)
    if not batches:
        raise ValueError("the calibration data yielded no batch")
    return batches


def _find_blocks(model: nn.Module, layers: list[TargetLayer]) -> tuple[str, nn.ModuleList] | None:
    """The ``nn.ModuleList`` (its name and itself) whose children hold the most targeted layers."""
    best, best_count = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name:
            count = sum(layer.name.startswith(name + ".") for layer in layers)
            if count > best_count:
                best, best_count = (name, module), count
    return best


def _token_rows(x: Tensor, token_mask: Tensor | None) -> Tensor:
    """``(tokens, features)`` from a layer input, without padding tokens when the mask fits its leading dims."""
    if token_mask is not None and x.dim() == 3 and x.shape[:2] == token_mask.shape:
        return x[token_mask]
    return x.reshape(-1, x.shape[-1])


def _hidden(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden: Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _first(output: Any) -> Tensor:
    return output if isinstance(output, Tensor) else output[0]


class _Collector:
    """Forward pre-hooks that feed one layer's inputs to ``observe`` (and stop the pass), with the current batch's
    token mask."""

    def __init__(self, observe: Callable[[str, Tensor], None]) -> None:
        self.observe = observe
        self.token_mask: Tensor | None = None

    def hook(self, name: str):
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict):
            x = args[0] if args else next(iter(kwargs.values()))
            self.observe(name, _token_rows(x, self.token_mask))
            raise _Stop

        return pre_hook

    def collect(self, layer: TargetLayer, runs: Iterable[tuple[Tensor | None, Callable[[], Any]]]) -> None:
        handle = layer.module.register_forward_pre_hook(self.hook(layer.name), with_kwargs=True)
        try:
            for token_mask, run in runs:
                self.token_mask = token_mask
                try:
                    run()
                except _Stop:
                    pass
        finally:
            handle.remove()
            self.token_mask = None


@torch.no_grad()
def run_calibration(
    model: nn.Module,
    layers: list[TargetLayer],
    batches: list[dict],
    *,
    observe: Callable[[str, Tensor], None],
    share: Callable[[str, str], None],
    prune: Callable[[TargetLayer], None],
    progress: bool = False,
) -> None:
    """Prune every layer of ``layers`` in the order of the module docstring: ``observe(name, inputs)`` with its
    ``(tokens, in_features)`` calibration inputs, ``share(name, source)`` for a layer reading the same input as
    ``source``, then ``prune(layer)``. ``batches`` come from :func:`prepare_batches`. The model runs in eval mode
    (no dropout) and is put back in the mode it was in."""
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    try:
        _run(model, layers, batches, observe, share, prune, progress)
    finally:
        model.train(was_training)


def _run(model, layers, batches, observe, share, prune, progress) -> None:
    from tqdm.auto import tqdm

    masks = [b["attention_mask"].bool() if "attention_mask" in b else None for b in batches]
    collector = _Collector(observe)
    found = _find_blocks(model, layers)
    done: set[str] = set()
    if found is not None:
        prefix, blocks = found
        block_layers = [[la for la in layers if la.name.startswith(f"{prefix}.{i}.")] for i in range(len(blocks))]
        used = [i for i, group in enumerate(block_layers) if group]
        calls = _capture_block_calls(model, blocks, batches, used[0])
        hidden = [_hidden(args, kwargs) for args, kwargs in calls[used[0]]]
        bar = tqdm(range(used[0], used[-1] + 1), desc="hf_sparse calibration", unit="block", disable=not progress)
        for i in bar:
            block, per_batch = blocks[i], calls[i]
            inputs = [_with_hidden(args, kwargs, h) for (args, kwargs), h in zip(per_batch, hidden, strict=True)]
            runs = [(mask, _call(block, a, k)) for mask, (a, k) in zip(masks, inputs, strict=True)]
            for group in _input_groups(block, block_layers[i], inputs[0]):
                collector.collect(group[0], runs)
                for layer in group[1:]:
                    share(layer.name, group[0].name)
                for layer in group:
                    prune(layer)
                    done.add(layer.name)
            hidden = [_first(block(*a, **k)) for a, k in inputs]
            calls[i] = []  # this block's keyword arguments are not needed again
        del hidden, calls
    rest = [layer for layer in layers if layer.name not in done]
    if rest:
        logger.info("hf_sparse: calibrating %d layer(s) outside the repeated blocks with full passes", len(rest))
    for layer in tqdm(rest, desc="hf_sparse calibration", unit="layer", disable=not progress or not rest):
        collector.collect(layer, [(mask, _call(model, (), b)) for mask, b in zip(masks, batches, strict=True)])
        prune(layer)


def _call(module: nn.Module, args: tuple, kwargs: dict) -> Callable[[], Any]:
    return lambda: module(*args, **kwargs)


def _capture_block_calls(
    model: nn.Module, blocks: nn.ModuleList, batches: list[dict], first: int
) -> list[list[tuple[tuple, dict]]]:
    """Per block, per batch: the ``(args, kwargs)`` it is called with in a forward pass of the model, the hidden
    states kept for block ``first`` only (later blocks get them from the pruned blocks before them)."""
    calls: list[list[tuple[tuple, dict]]] = [[] for _ in blocks]

    def recorder(index: int):
        def pre_hook(module, args, kwargs):
            if index == first:
                calls[index].append((args, dict(kwargs)))
            else:
                calls[index].append(_with_hidden(args, kwargs, None))
            if index == len(blocks) - 1:
                raise _Stop

        return pre_hook

    handles = [block.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, block in enumerate(blocks)]
    try:
        for batch in batches:
            try:
                model(**batch)
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i, c in enumerate(calls) if len(c) != len(batches)]
    if missing:
        raise RuntimeError(
            f"hf_sparse calibration: blocks {missing} were not called once per batch in a forward pass; this model "
            "calls its layers in a way the block-by-block calibration does not follow"
        )
    return calls


def _input_groups(block: nn.Module, layers: list[TargetLayer], inputs: tuple[tuple, dict]) -> list[list[TargetLayer]]:
    """``layers`` grouped by the input tensor they read, groups in the order the block calls them (one probe pass
    of the first batch); layers the probe did not reach come last, one per group."""
    seen: list[tuple[TargetLayer, Tensor]] = []

    def probe(layer: TargetLayer):
        def pre_hook(module, args, kwargs):
            if all(la is not layer for la, _ in seen):
                seen.append((layer, args[0] if args else next(iter(kwargs.values()))))

        return pre_hook

    handles = [layer.module.register_forward_pre_hook(probe(layer), with_kwargs=True) for layer in layers]
    try:
        block(*inputs[0], **inputs[1])
    finally:
        for handle in handles:
            handle.remove()
    groups: list[list[TargetLayer]] = []
    sources: list[Tensor] = []
    for layer, x in seen:  # the tensors stay referenced here, so equal ids mean the same tensor
        for group, source in zip(groups, sources, strict=True):
            if source is x:
                group.append(layer)
                break
        else:
            groups.append([layer])
            sources.append(x)
    reached = {la.name for la, _ in seen}
    return groups + [[layer] for layer in layers if layer.name not in reached]
