"""Module-level ``__getattr__`` for names renamed to their W4A16-specific form (kept for one release)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any


def deprecated_names(module: str, renamed: dict[str, str], namespace: Callable[[str], Any]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module`` that resolves each old name in ``renamed`` to its new one with a
    `FutureWarning`; ``namespace`` looks a new name up."""

    def __getattr__(name: str):
        if name in renamed:
            new = renamed[name]
            warnings.warn(
                f"`{name}` is deprecated and will be removed in the next release; use `{new}` (transformers has its "
                f"own, unrelated `{name}`).",
                FutureWarning,
                stacklevel=2,
            )
            return namespace(new)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
