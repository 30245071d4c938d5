"""The names a :class:`~hf_sparse.SparsityConfig` may give for its pluggable parts: scores and schedules.

The tables sit below :mod:`hf_sparse.config`, so a config checks a name without importing the modules that fill
them: :func:`hf_sparse.scoring.register_score` and :func:`hf_sparse.schedules.register_schedule` write here, and
``import hf_sparse`` imports both (through the pruner) before any config can be built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SCHEDULES", "SCORES", "Registry"]


class Registry(dict):
    """``name -> object`` for one kind of pluggable part; :meth:`register` refuses a name given twice."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[Any], Any]:
        """A decorator that registers what it decorates under ``name``."""

        def decorator(obj: Any) -> Any:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = obj
            return obj

        return decorator

    def names(self) -> list[str]:
        return sorted(self)


SCORES = Registry("score")
SCHEDULES = Registry("schedule")
