"""``SparsityConfig``: what to prune, to which pattern, on which schedule.

A plain dataclass that validates in ``__post_init__`` (every error names the field, the value received and what is
allowed), round-trips through JSON, and carries the library version so a saved recipe says what wrote it.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from ._version import __version__
from .patterns import NM, VNM, Pattern, PatternError, Unstructured, parse_pattern
from .registry import SCHEDULES, SCORES

__all__ = ["DEFAULT_IGNORE", "DEFAULT_TARGETS", "SparsityConfig", "check_known_keys"]

#: Linear / Conv1D layers inside the repeated transformer blocks of BERT, RoBERTa, DistilBERT, GPT-2 and Llama.
DEFAULT_TARGETS: tuple[str, ...] = (r"(^|\.)(layer|layers|h|blocks?)\.\d+\.",)
#: Never pruned by default even when inside a block: gates of mixture-of-experts routers.
DEFAULT_IGNORE: tuple[str, ...] = (r"(^|\.)(router|gate)$",)

ScheduleName = Literal["oneshot", "linear", "cubic"]


def _is_number(value: Any) -> bool:
    """An int or a finite float, not a bool (``True`` is an ``int`` to Python, never a count or a fraction here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _check_step_or_fraction(name: str, value: Any) -> None:
    if not _is_number(value):
        raise ValueError(
            f"SparsityConfig.{name}={value!r}: give a fraction of training (float in [0, 1]) or a step (int)"
        )
    if isinstance(value, float) and not (0.0 <= value <= 1.0):
        raise ValueError(
            f"SparsityConfig.{name}={value!r}: a float is a fraction of training and must be in [0, 1]; "
            f"for an absolute step pass an int (e.g. {int(value)})"
        )
    if isinstance(value, int) and value < 0:
        raise ValueError(f"SparsityConfig.{name}={value!r}: a step must be >= 0")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(
            f"SparsityConfig.{name}={value!r}: must be a bool, True or False (got {type(value).__name__}); in a "
            "recipe write it unquoted: JSON true/false, YAML true/false"
        )


def _check_regexes(name: str, value: Any) -> list[str] | None:
    """``targets`` / ``ignore``: None, one regex string, or a list of them; returns the list form."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(regex, str) for regex in value):
        raise ValueError(
            f"SparsityConfig.{name}={value!r}: give a module-name regex string or a list of regex strings "
            "(or None for the default)"
        )
    for regex in value:
        try:
            re.compile(regex)
        except re.error as err:
            raise ValueError(f"SparsityConfig.{name}: {regex!r} is not a valid regex ({err})") from None
    return list(value)


def check_known_keys(keys: Any, allowed: Any, source: str) -> None:
    """Raise a ValueError naming each key of ``keys`` not in ``allowed``, with the closest allowed name (difflib) and
    the full list. ``source`` (a file name, ``"SparsityConfig"``) starts the message."""
    allowed = sorted(allowed)
    unknown = sorted(set(keys) - set(allowed), key=str)
    if not unknown:
        return
    problems = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), allowed, n=1)
        problems.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(
        f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(problems)}; valid keys: {allowed}"
    )


@dataclass
class SparsityConfig:
    """How :class:`~hf_sparse.SparseTrainer` / :class:`~hf_sparse.SparsityCallback` prune a model.

    The defaults are gradual SparseGPT (``score="sparsegpt"``, a cubic ramp from 10% to 60% of training, masks every
    100 steps, 32 calibration batches of the training data per update): across SST-2, MRPC, CoLA and SQuAD it kept
    a fine-tuned encoder closer to dense than gradual magnitude pruning at every pattern tried (the tables and their
    commands: ``examples/README.md``). Without calibration batches (a :class:`~hf_sparse.Pruner` driven by hand),
    under FSDP2 or with ``global_unstructured``, use ``score="magnitude"``.

    Args:
        pattern: ``"N:M"`` (``"2:4"``), VENOM ``"V:N:M"`` (``"64:2:8"``) or ``"unstructured:S"``.
        schedule: ``"cubic"`` (Zhu & Gupta), ``"linear"`` or ``"oneshot"`` (prune once at ``start``).
        start, end: when the ramp begins and reaches the final pattern: a float in ``[0, 1]`` is a fraction of
            the training steps, an int an absolute optimizer step.
        update_every: optimizer steps between mask updates during the ramp.
        targets: module-name regexes (``re.search``) of layers to prune; ``None`` means the Linear/Conv1D layers
            of the transformer blocks (embeddings, poolers and classifier/QA/LM heads stay dense).
        ignore: module-name regexes never pruned, applied after ``targets``.
        score: importance used to rank weights; ``"magnitude"`` (|w|), ``"obs"`` (second-order Optimal Brain
            Surgeon with an empirical Fisher: exact best subset per group and an update of the weights that stay,
            see :class:`hf_sparse.scoring.ObsScore`), ``"wanda"`` (``|W|`` times each input feature's norm) or
            ``"sparsegpt"`` (layer-wise reconstruction of each layer's outputs, moving the kept weights), both from
            calibration batches run through the model before each update (see :mod:`hf_sparse.calibration`), or
            any name registered with
            :func:`hf_sparse.scoring.register_score`.
        transposable: make 2:4 masks valid for ``W`` and ``W.T`` (exact search over the 90 patterns per 4x4 block).
        global_unstructured: rank unstructured importance across all targeted layers instead of per layer.
        obs_num_grads: ``score="obs"``: gradients (optimizer steps) averaged into the Fisher before each update.
        obs_damp: ``score="obs"``: dampening *relative* to the mean diagonal of each layer's empirical Fisher
            (``F + damp · mean(diag F) · I``, SparseGPT's convention; scale-free under clipping and loss scaling).
        obs_block_size: ``score="obs"``: length of the Fisher's diagonal blocks along a row; ``None`` = ``M`` of
            the pattern (32 for unstructured). A multiple of ``M``; beyond ``M`` the subset choice is greedy.
        dynamic: masks keep moving for the whole run (Hu et al., ICML 2024): recomputed from the *dense* weights at
            every ``update_every`` steps, including after ``end``. The forward uses ``W ⊙ mask`` while the dense
            master ``W`` receives the full gradient (straight-through); pruned positions are not zeroed in ``W``.
            Levels of a ramp need not nest. Checkpoints and ``save_model`` are as in static mode (the saved model
            holds ``W ⊙ mask``).
        masked_decay: ``dynamic`` only: ``λ`` of ``grad += λ · (1 − mask) ⊙ W``, added to the full gradient of
            each optimizer step (after clipping), pulling pruned weights towards zero so masks settle.
        dense_finetune_start: ``dynamic`` only: from this point on (fraction of training or step, after ``end``)
            the masks are dropped and the model trains dense, the final phase of Hu et al.'s pre-training recipe;
            the model saved at the end is then an ordinary dense checkpoint.
        calibration_batches: activation-aware scores (``"wanda"``, ``"sparsegpt"``) inside a Trainer: how many batches
            of the training data (a fixed, seeded draw of the train dataloader's dataset and collator) run through
            the model before each mask update. :func:`hf_sparse.oneshot` uses the batches it is given.
        sparsegpt_damp: ``score="sparsegpt"``: dampening relative to the mean diagonal of each layer's ``Xᵀ X``.
        sparsegpt_block_size: ``score="sparsegpt"``: columns per lazy-update block of the sweep.
        kernels: ``"auto"`` loads the CUDA kernels at train start on a GPU; ``"never"`` does not.
        compact: once the masks are final, the pruned layers turn compact (kept values only, see
            :mod:`hf_sparse.compaction`); ``False`` keeps the dense masked layers to the end.
        compact_fallback: whether the run times its compact layers against the masked dense ones and keeps the
            faster (see :mod:`hf_sparse.compact_fallback`): ``"auto"`` on CUDA only (on the CPU the compact layers
            run a reference path), ``"always"`` on any device, ``"never"`` keeps the compact layers unmeasured.
            Under ``TrainingArguments(torch_compile=True)`` it times the compiled step against the eager one
            instead (no recompilation) and keeps the faster. The timed steps are real training steps; under a
            DDP/FSDP wrapper no comparison runs.
        compact_fallback_steps: optimizer steps timed on each path (after a few warm-up steps per path).
    """

    pattern: str = "2:4"
    schedule: ScheduleName = "cubic"
    start: float | int = 0.1
    end: float | int = 0.6
    update_every: int = 100
    targets: list[str] | None = None
    ignore: list[str] | None = None
    score: str = "sparsegpt"
    transposable: bool = False
    global_unstructured: bool = False
    obs_num_grads: int = 32
    obs_damp: float = 1e-2
    obs_block_size: int | None = None
    dynamic: bool = False
    masked_decay: float = 0.0
    dense_finetune_start: float | int | None = None
    calibration_batches: int = 32
    sparsegpt_damp: float = 1e-2
    sparsegpt_block_size: int = 128
    kernels: Literal["auto", "never"] = "auto"
    compact: bool = True
    compact_fallback: Literal["auto", "always", "never"] = "auto"
    compact_fallback_steps: int = 10
    hf_sparse_version: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        try:
            parsed = parse_pattern(self.pattern)
        except PatternError as err:
            raise ValueError(f"SparsityConfig.pattern={self.pattern!r}: {err}") from None
        self.pattern = str(parsed)
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise ValueError(f"SparsityConfig.schedule={self.schedule!r}: allowed {SCHEDULES.names()}")
        _check_step_or_fraction("start", self.start)
        _check_step_or_fraction("end", self.end)
        if type(self.start) is type(self.end) and self.end < self.start:
            raise ValueError(f"SparsityConfig.end={self.end!r} is before start={self.start!r}")
        if isinstance(self.update_every, bool) or not isinstance(self.update_every, int) or self.update_every < 1:
            raise ValueError(f"SparsityConfig.update_every={self.update_every!r}: must be an int >= 1")
        self.targets = _check_regexes("targets", self.targets)
        self.ignore = _check_regexes("ignore", self.ignore)
        for f in fields(self):
            if f.type == "bool":  # annotations are strings here (``from __future__ import annotations``)
                _check_bool(f.name, getattr(self, f.name))
        if not isinstance(self.score, str) or self.score not in SCORES:
            raise ValueError(f"SparsityConfig.score={self.score!r}: allowed {SCORES.names()}")
        if self.transposable and not (isinstance(parsed, NM) and (parsed.n, parsed.m) == (2, 4)):
            raise ValueError(
                f"SparsityConfig.transposable=True needs pattern '2:4' (got {self.pattern!r}): transposable masks "
                "are defined for 2:4 only"
            )
        if self.global_unstructured and not isinstance(parsed, Unstructured):
            raise ValueError(
                f"SparsityConfig.global_unstructured=True needs an 'unstructured:S' pattern, got {self.pattern!r}"
            )
        self._check_obs_and_dynamic(parsed)
        self._check_calibration()
        if self.kernels not in ("auto", "never"):
            raise ValueError(f"SparsityConfig.kernels={self.kernels!r}: allowed 'auto' or 'never'")
        if not isinstance(self.compact, bool):
            raise ValueError(f"SparsityConfig.compact={self.compact!r}: must be True or False")
        self._check_compact_fallback()
        if not self.hf_sparse_version:
            self.hf_sparse_version = __version__

    def _check_compact_fallback(self) -> None:
        if self.compact_fallback not in ("auto", "always", "never"):
            raise ValueError(
                f"SparsityConfig.compact_fallback={self.compact_fallback!r}: allowed 'auto' (measure on CUDA), "
                "'always' (on any device) or 'never'"
            )
        steps = self.compact_fallback_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"SparsityConfig.compact_fallback_steps={steps!r}: must be an int >= 1")

    def _check_obs_and_dynamic(self, parsed: Pattern) -> None:
        for name in ("obs_num_grads", "obs_block_size"):
            value = getattr(self, name)
            if value is None and name == "obs_block_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SparsityConfig.{name}={value!r}: must be an int >= 1")
        if not _is_number(self.obs_damp) or not self.obs_damp > 0:
            raise ValueError(
                f"SparsityConfig.obs_damp={self.obs_damp!r}: must be a finite number > 0 (relative dampening)"
            )
        if self.obs_block_size is not None and isinstance(parsed, NM | VNM) and self.obs_block_size % parsed.m:
            raise ValueError(
                f"SparsityConfig.obs_block_size={self.obs_block_size}: must be a multiple of m={parsed.m} of "
                f"pattern {self.pattern!r} (or None for m)"
            )
        decay = self.masked_decay
        if not _is_number(decay) or decay < 0:
            raise ValueError(f"SparsityConfig.masked_decay={decay!r}: must be a finite number >= 0")
        if decay and not self.dynamic:
            raise ValueError(
                f"SparsityConfig.masked_decay={decay!r} needs dynamic=True: with static masks the pruned weights are "
                "exactly zero and the decay has nothing to act on"
            )
        if self.dense_finetune_start is not None:
            if not self.dynamic:
                raise ValueError(
                    "SparsityConfig.dense_finetune_start needs dynamic=True (a dense phase ends dynamic-mask "
                    "training); with static masks, stop pruning by training without a sparsity config"
                )
            _check_step_or_fraction("dense_finetune_start", self.dense_finetune_start)
            end = self.start if self.schedule == "oneshot" else self.end  # a one-shot schedule ends at start
            if type(self.dense_finetune_start) is type(end) and self.dense_finetune_start <= end:
                raise ValueError(
                    f"SparsityConfig.dense_finetune_start={self.dense_finetune_start!r} must be after "
                    f"{'start' if self.schedule == 'oneshot' else 'end'}={end!r}: the masks reach the final "
                    "pattern first"
                )

    def _check_calibration(self) -> None:
        for name in ("calibration_batches", "sparsegpt_block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SparsityConfig.{name}={value!r}: must be an int >= 1")
        damp = self.sparsegpt_damp
        if isinstance(damp, bool) or not isinstance(damp, int | float) or not damp > 0:
            raise ValueError(f"SparsityConfig.sparsegpt_damp={damp!r}: must be a number > 0 (relative dampening)")
        if self.global_unstructured and SCORES[self.score].needs_calibration:
            raise ValueError(
                f"SparsityConfig.global_unstructured=True with score={self.score!r}: activation-aware scores prune "
                "layer by layer (each layer sees the inputs of the already-pruned ones), so no global threshold "
                "exists; use global_unstructured=False (per-layer sparsity) or score='magnitude'"
            )

    @property
    def parsed_pattern(self) -> Pattern:
        return parse_pattern(self.pattern)

    @property
    def target_regexes(self) -> list[str]:
        return list(self.targets) if self.targets is not None else list(DEFAULT_TARGETS)

    @property
    def ignore_regexes(self) -> list[str]:
        return list(self.ignore) if self.ignore is not None else list(DEFAULT_IGNORE)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "SparsityConfig") -> SparsityConfig:
        """Build from a dict of field names; an unknown key is an error naming it and the closest valid one.

        ``source`` (e.g. the file the dict was read from) starts the error messages.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of SparsityConfig fields, got {type(data).__name__}")
        if data.get("hf_sparse_version"):
            source += f" (written by hf_sparse {data['hf_sparse_version']})"
        check_known_keys(data, (f.name for f in fields(cls)), source)
        return cls(**data)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json_string())

    @classmethod
    def from_json_file(cls, path: str | Path) -> SparsityConfig:
        """Read a JSON file of field names (booleans as JSON ``true``/``false``); unknown keys are an error."""
        return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))
