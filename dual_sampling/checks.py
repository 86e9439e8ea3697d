"""Checks of single setting values, each refusing a bad value with a ValueError that names the field.

One home for the checks every config shares (engine, sampling, run, serve and session
settings): a count is an ``int`` (never a ``bool``, which Python counts as one), and a number
is an ``int`` or ``float`` (never a ``bool``), finite unless said otherwise. Values arrive from
JSON, YAML and command lines, so a string "3" is refused rather than converted.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_COUNT", "is_count", "is_int", "is_number", "need_int", "need_number", "require"]

MAX_COUNT = 2**31 - 1
"""Largest token count, top-k or token id a request may give: the engines keep them in int32 and int64 tensors."""


def require(ok: bool, message: str) -> None:
    """ValueError(``message``) unless ``ok``: for checks whose message names the field its own way."""
    if not ok:
        raise ValueError(message)


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: Any, least: int) -> bool:
    """An int (not a bool) in [least, MAX_COUNT]."""
    return is_int(value) and least <= value <= MAX_COUNT


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def need_int(name: str, value: Any, least: int, most: int | None = None) -> int:
    """``value`` if it is an integer >= ``least`` (and <= ``most`` when given); else ValueError:
    "<name> must be an integer >= <least>" or "<name> must be an integer in [<least>, <most>]"."""
    if not (is_int(value) and value >= least and (most is None or value <= most)):
        bound = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def need_number(name: str, value: Any, *, least: float = 0.0, positive: bool = False, finite: bool = True) -> float:
    """``value`` as a float if it is a number >= ``least`` (> 0 with ``positive``; inf allowed unless ``finite``);
    else ValueError naming ``name`` and the bound."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (value > 0 if positive else value >= least) and (math.isfinite(value) or not finite)
    if not ok:
        bound = "a positive number" if positive else f"a number >= {least:g}"
        raise ValueError(f"{name} must be {bound}{'' if finite else ' (inf allowed)'}, got {value!r}")
    return float(value)
