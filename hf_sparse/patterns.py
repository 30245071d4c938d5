"""Sparsity patterns as small value objects.

A pattern says which weights of a ``(rows, cols)`` matrix may be non-zero. Everything in hf_sparse works on the
*logical* weight: ``(out_features, in_features)``, groups running along the input dimension, which is the reduction
dimension of ``Y = X @ W.T`` and the one Sparse Tensor Cores compress. GPT-2's ``Conv1D`` stores its weight
transposed; :mod:`hf_sparse.modeling` hands its transpose to everything below.

Patterns are parsed from the strings users write (``"2:4"``, ``"64:2:8"``, ``"unstructured:0.9"``) and are
hashable, so they can key caches and appear in configs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["NM", "VNM", "Pattern", "PatternError", "Unstructured", "parse_pattern"]

#: The largest group size we accept: column offsets inside a group are stored as ``uint8`` on disk.
MAX_M = 256
#: Sparse Tensor Cores keep 2 of every 4 (``mma.sp``); VENOM blocks pick 4 columns, rows keep 2 of those.
SPTC_GROUP = 4


class PatternError(ValueError):
    """A pattern string or value that hf_sparse cannot use; the message says what is allowed."""


@dataclass(frozen=True)
class NM:
    """Keep ``n`` of every ``m`` consecutive weights of each row (``2:4`` is what Sparse Tensor Cores run)."""

    n: int
    m: int

    def __post_init__(self) -> None:
        if not (2 <= self.m <= MAX_M):
            raise PatternError(f"N:M pattern '{self}': m={self.m} must be in [2, {MAX_M}]")
        if not (1 <= self.n < self.m):
            raise PatternError(
                f"N:M pattern '{self}': n={self.n} must be in [1, m-1={self.m - 1}] (keep n of every m weights, fewer than all m; e.g. '2:4')"
            )

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"

    @property
    def sparsity(self) -> float:
        return 1.0 - self.n / self.m

    @property
    def sptc_runnable(self) -> bool:
        """True when Sparse Tensor Cores can run it directly: exactly 2:4."""
        return self.m == SPTC_GROUP and self.n == 2

    def fit_error(self, rows: int, cols: int) -> str | None:
        if cols % self.m:
            return f"in_features={cols} is not a multiple of m={self.m}"
        return None

    def at_level(self, keep: int) -> NM:
        """The pattern of a gradual ramp that keeps ``keep`` of every ``m`` (see :mod:`hf_sparse.schedules`)."""
        return NM(keep, self.m)


@dataclass(frozen=True)
class VNM:
    """VENOM ``V:N:M``: blocks of ``v`` rows x ``m`` columns share 4 kept columns; each row keeps ``n`` of those 4.

    With ``n=2`` the 4-column sub-block is a 2:4 pattern, so Sparse Tensor Cores run it after the kernels gather
    the 4 columns; sparsity is ``1 - n/m``. ``n > 4`` (used by gradual ramps, see :mod:`hf_sparse.schedules`) means
    each block keeps ``n`` whole columns and every row keeps all of them: :attr:`keep_cols` is ``max(n, 4)``.
    """

    v: int
    n: int
    m: int

    def __post_init__(self) -> None:
        if self.v < 1:
            raise PatternError(f"V:N:M pattern '{self}': v={self.v} must be >= 1 (64 or 128 for the kernels)")
        if not (SPTC_GROUP <= self.m <= MAX_M):
            raise PatternError(f"V:N:M pattern '{self}': m={self.m} must be in [{SPTC_GROUP}, {MAX_M}]")
        if not (1 <= self.n < self.m):
            raise PatternError(
                f"V:N:M pattern '{self}': n={self.n} must be in [1, m-1={self.m - 1}] (keep n of every m, fewer than all m; 2 for the kernels)"
            )

    def __str__(self) -> str:
        return f"{self.v}:{self.n}:{self.m}"

    @property
    def keep_cols(self) -> int:
        """Columns each block keeps: 4 (rows pick ``n`` of them), or ``n`` when ``n > 4`` (rows keep all)."""
        return max(self.n, SPTC_GROUP)

    @property
    def sparsity(self) -> float:
        return 1.0 - self.n / self.m

    @property
    def sptc_runnable(self) -> bool:
        return self.n == 2 and self.v in (64, 128)

    def fit_error(self, rows: int, cols: int) -> str | None:
        problems = []
        if rows % self.v:
            problems.append(f"out_features={rows} is not a multiple of v={self.v}")
        if cols % self.m:
            problems.append(f"in_features={cols} is not a multiple of m={self.m}")
        return "; ".join(problems) or None

    def at_level(self, keep: int) -> VNM:
        """The ramp pattern keeping ``keep`` of every ``m`` per row (every level is a subset of the one before)."""
        return VNM(self.v, keep, self.m)


@dataclass(frozen=True)
class Unstructured:
    """Keep the largest ``1 - sparsity`` fraction of weights, anywhere (per layer, or globally across layers)."""

    sparsity: float

    def __post_init__(self) -> None:
        if not (0.0 < self.sparsity < 1.0):  # False for NaN too
            raise PatternError(
                f"unstructured sparsity {self.sparsity!r} must be in (0, 1): the fraction of weights pruned, e.g. 0.75"
            )

    def __str__(self) -> str:
        return f"unstructured:{self.sparsity:g}"

    @property
    def sptc_runnable(self) -> bool:
        return False

    def fit_error(self, rows: int, cols: int) -> str | None:
        return None


Pattern = NM | VNM | Unstructured

#: V:N:M row blocks are a multiple of this many rows. The mask, OBS and checkpoint code take any such ``v``; the
#: Sparse Tensor Core kernels run ``v`` = 64 and 128 (``hf_sparse.ops``).
V_MULTIPLE = 4

_ALLOWED = (
    "'N:M' with 0 < N < M (e.g. '2:4', '2:8'), 'V:N:M' with V a multiple of "
    f"{V_MULTIPLE} and 0 < N < M (e.g. '64:2:8', '128:2:16'; the kernels run V = 64 or 128) or 'unstructured:S' "
    "with 0 < S < 1 (e.g. 'unstructured:0.75')"
)


def _unquoted_yaml(number: int) -> str | None:
    """The pattern whose unquoted YAML 1.1 spelling reads as ``number`` (``124`` for ``2:4``, base 60), if any."""
    for groups in (2, 3):
        rest, digits = number, []
        for _ in range(groups - 1):
            rest, digit = divmod(rest, 60)
            digits.insert(0, str(digit))
        text = ":".join([str(rest), *digits])
        try:
            if rest >= 1 and parse_pattern(text):
                return text
        except PatternError:
            continue
    return None


def _not_a_string(spec: object) -> PatternError:
    message = f"pattern must be a string, got {type(spec).__name__} {spec!r}"
    if isinstance(spec, int) and not isinstance(spec, bool):
        text = _unquoted_yaml(spec)
        read = f"an unquoted {text} as the base-60 number {spec}" if text else "an unquoted N:M as a number"
        message += f': YAML reads {read}; quote the pattern, e.g. pattern: "{text or "2:4"}"'
    return PatternError(f"{message}. Allowed: {_ALLOWED}")


def parse_pattern(spec: str | Pattern) -> Pattern:
    """Parse ``"2:4"``, ``"64:2:8"`` or ``"unstructured:0.9"`` into a pattern object.

    Patterns that prune nothing (``"4:4"``, ``"unstructured:0"``) or everything are errors, and so is a ``V:N:M``
    whose ``V`` is not a multiple of :data:`V_MULTIPLE` (``"2:4:8"`` is a typo, not a pattern).

    >>> parse_pattern("64:2:8")
    VNM(v=64, n=2, m=8)
    """
    if isinstance(spec, NM | VNM | Unstructured):
        return spec
    if not isinstance(spec, str):
        raise _not_a_string(spec)
    text = spec.strip().lower()
    if text.startswith("unstructured"):
        match = re.fullmatch(r"unstructured:([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)", text)
        if not match:
            raise PatternError(f"pattern {spec!r} is not valid; use {_ALLOWED}")
        return Unstructured(float(match.group(1)))
    parts = text.split(":")
    if not all(p.isdigit() for p in parts) or len(parts) not in (2, 3):
        raise PatternError(f"pattern {spec!r} is not valid; use {_ALLOWED}")
    numbers = [int(p) for p in parts]
    if len(numbers) == 2:
        return NM(*numbers)
    if numbers[0] % V_MULTIPLE or numbers[0] == 0:
        raise PatternError(
            f"pattern {spec!r}: V:N:M with v={numbers[0]}, but v (rows per block) must be a positive multiple of "
            f"{V_MULTIPLE}; use {_ALLOWED}"
        )
    return VNM(*numbers)
