"""Weight versions: the label each engine's weights carry now, every label they have carried, and the checks of a
weight operation's arguments.

A label names one set of weights for good: records carry it (``teacher_version``,
``theta_version``), and ``best_of`` ranks only samples of one version pair. So a label a model's
weights carried before is never given to other weights. Versions are kept per model of the roster, by name.
"""

from __future__ import annotations

from dual_sampling.roster import PAIR, Role, Roster

__all__ = ["PAUSE_MODES", "UPDATE_MODES", "WeightVersions", "check_update"]

UPDATE_MODES = ("wait", "abort")
"""What a weight update does with the requests in flight: let them finish on the old weights, or abort them."""
PAUSE_MODES = (*UPDATE_MODES, "keep")
"""What a pause does with them: also ``keep``, hold them where they are, to go on under whatever weights the engines
hold at the resume (each token's record names the θ version that drew it)."""


def check_update(
    role: object = None, mode: object = None, version: object = None, modes: tuple[str, ...] = UPDATE_MODES
) -> None:
    """Refuse, naming the argument, a role, update mode or version label the weight operations cannot take.

    Each argument left None is not checked (a version of None asks for the default label).
    """
    if role is not None:
        Role.parse(role)
    if mode is not None and mode not in modes:
        raise ValueError(f"mode must be one of {modes}, got {mode!r}")
    if version is not None and (not isinstance(version, str) or not version or len(version) > 256):
        raise ValueError(f"version must be a non-empty string of at most 256 characters, got {version!r}")


class WeightVersions:
    """Each model's current label ("0" as started), the labels it has carried, and its count of updates, by the
    model's name in :attr:`roster`."""

    def __init__(self, roster: Roster = PAIR) -> None:
        self.roster = roster
        self.current: dict[str, str] = {name: "0" for name in roster.names}
        self.used: dict[str, set[str]] = {name: {"0"} for name in roster.names}
        self.updates: dict[str, int] = {name: 0 for name in roster.names}

    def check_model(self, model: object) -> str:
        """``model`` as the name of a model of the roster; ValueError naming the roster otherwise. (The two-model
        front door passes its :class:`~dual_sampling.roster.Role`, equal to the model's name.)"""
        if model not in self.roster.names:
            raise ValueError(f"role must be one of {self.roster.names}, got {model!r}")
        return str(model)

    def updated(self, model: object, version: str | None) -> str:
        """Record an update of ``model``'s weights labelled ``version``; returns the label.

        None labels it with the count of updates, or the next count no weights of the model carried yet.
        """
        model = self.check_model(model)
        self.updates[model] += 1
        if version is None:
            count = self.updates[model]
            while str(count) in self.used[model]:
                count += 1
            version = str(count)
        self.current[model] = version
        self.used[model].add(version)
        return version

    def relabel(self, model: object, version: object) -> None:
        """Label ``model``'s current weights ``version`` without changing them.

        A label the model's weights have carried before is refused: records of two different weights would name one.
        """
        if version is None:
            raise ValueError("version must be a non-empty string of at most 256 characters, got None")
        check_update(version=version)
        model = self.check_model(model)
        if version != self.current[model]:
            self.check_new(model, version)
        self.current[model] = version
        self.used[model].add(version)

    def check_new(self, model: object, version: str) -> None:
        """Refuse (ValueError) a label ``model``'s weights have carried, the current one included: records of two
        different weights would name one."""
        model = self.check_model(model)
        if version in self.used[model]:
            raise ValueError(f"version {version!r} already labelled earlier {model} weights; choose a new label")

    def snapshot(self) -> dict[str, str]:
        """``{name: label}`` per model (a pair: ``{"teacher": ..., "theta": ...}``): the labels now."""
        return dict(self.current)
