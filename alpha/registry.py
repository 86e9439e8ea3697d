"""Name → alpha-computer registry, open to third-party packages.

Built-in methods register themselves with :func:`register_alpha_computer`. Another
package adds a method without editing this one by declaring an entry point in the
group ``dual_sampling.alpha_computers`` whose value is an ``AlphaComputer`` subclass::

    [project.entry-points."dual_sampling.alpha_computers"]
    my_method = "my_package.alpha:MyAlpha"

Entry points are read lazily, the first time a name is not found among the
registered ones.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from alpha.base import AlphaComputer, several_teacher_methods

__all__ = [
    "ENTRY_POINT_GROUP",
    "alpha_methods_for_several_teachers",
    "available_alpha_methods",
    "get_alpha_computer",
    "register_alpha_computer",
]

ENTRY_POINT_GROUP = "dual_sampling.alpha_computers"

_REGISTRY: dict[str, type[AlphaComputer]] = {}
_entry_points_loaded = False

C = TypeVar("C", bound=type[AlphaComputer])


def register_alpha_computer(name: str) -> Callable[[C], C]:
    """Class decorator: make ``cls`` available as ``get_alpha_computer(name, ...)``."""

    def decorate(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, AlphaComputer)):
            raise TypeError(f"alpha computer {name!r} must be an AlphaComputer subclass, got {cls!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"alpha method {name!r} is already registered by {existing.__module__}.{existing.__qualname__}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        register_alpha_computer(ep.name)(ep.load())


def available_alpha_methods() -> list[str]:
    """Sorted names of every registered method, including third-party entry points."""
    _load_entry_points()
    return sorted(_REGISTRY)


def alpha_methods_for_several_teachers() -> list[str]:
    """Sorted names of the registered methods that weight more than one teacher."""
    _load_entry_points()
    return several_teacher_methods()


def get_alpha_computer(method: str, **config: Any) -> AlphaComputer:
    """Build the alpha computer registered as ``method`` with the given configuration fields.

    Raises ValueError naming the method and the known ones if ``method`` is unknown, or
    naming the field if a configuration value is invalid.
    """
    if method not in _REGISTRY:
        _load_entry_points()
    cls = _REGISTRY.get(method)
    if cls is None:
        raise ValueError(f"unknown alpha method {method!r}; available: {', '.join(available_alpha_methods())}")
    try:
        return cls(**config)
    except TypeError as exc:
        raise ValueError(f"bad configuration for alpha method {method!r}: {exc}") from None
