"""Module settings for benchmark arms: parse ``NAME=VALUE,...`` and set them on a module for one arm."""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType


def parse_settings(text: str, module: ModuleType, allowed: tuple[str, ...] | None = None,
                   positive: bool = False) -> dict[str, int]:  # fmt: skip
    """``"NAME=VALUE,NAME=VALUE"`` -> integer settings of ``module``; names it lacks (or outside ``allowed``), values
    that are not integers (or, with ``positive``, not above zero) are refused with a message naming ``--variants``."""
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        known = hasattr(module, name) and (allowed is None or name in allowed)
        number = value.isdigit() if positive else value.lstrip("-").isdigit()
        if not known or not number or (positive and int(value) <= 0):
            names = f" (one of {', '.join(allowed)})" if allowed else ""
            kind = "POSITIVE_INTEGER" if positive else "INTEGER"
            raise SystemExit(f"--variants: {item!r} is not NAME={kind} for a setting of {module.__name__}{names}")
        values[name] = int(value)
    return values


@contextmanager
def module_settings(module: ModuleType, values: dict[str, object]):
    """``values`` set on ``module`` inside the block (read at each launch), the old ones restored after it."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def arm_cells(arms: dict[str, dict[str, float]], tolerance: float) -> str:
    """Markdown cells of µs per arm (``{"us", "rel_err"}``), the error appended where it exceeds ``tolerance``."""
    return " | ".join(f"{v['us']:.1f}" + ("" if v["rel_err"] < tolerance else f" (err {v['rel_err']:.1e})")
                      for v in arms.values())  # fmt: skip
