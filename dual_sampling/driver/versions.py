"""Weight versions: the label each engine's weights carry now, every label they have carried, and the checks of a
weight operation's arguments.

A label names one set of weights for good: records carry it (``teacher_version``,
``theta_version``), and ``best_of`` ranks only samples of one version pair. So a label a role's
weights carried before is never given to other weights.
"""

from __future__ import annotations

from dual_sampling.roster import Role

__all__ = ["UPDATE_MODES", "WeightVersions", "check_update"]

UPDATE_MODES = ("wait", "abort")
"""What a weight update does with the requests in flight: let them finish on the old weights, or abort them."""


def check_update(role: object = None, mode: object = None, version: object = None) -> None:
    """Refuse, naming the argument, a role, update mode or version label the weight operations cannot take.

    Each argument left None is not checked (a version of None asks for the default label).
    """
    if role is not None:
        Role.parse(role)
    if mode is not None and mode not in UPDATE_MODES:
        raise ValueError(f"mode must be one of {UPDATE_MODES}, got {mode!r}")
    if version is not None and (not isinstance(version, str) or not version or len(version) > 256):
        raise ValueError(f"version must be a non-empty string of at most 256 characters, got {version!r}")


class WeightVersions:
    """Each role's current label ("0" as started), the labels it has carried, and its count of updates."""

    def __init__(self) -> None:
        self.current: dict[Role, str] = {role: "0" for role in Role}
        self.used: dict[Role, set[str]] = {role: {"0"} for role in Role}
        self.updates: dict[Role, int] = {role: 0 for role in Role}

    def updated(self, role: Role, version: str | None) -> str:
        """Record an update of ``role``'s weights labelled ``version``; returns the label.

        None labels it with the count of updates, or the next count no weights of the role carried yet.
        """
        self.updates[role] += 1
        if version is None:
            count = self.updates[role]
            while str(count) in self.used[role]:
                count += 1
            version = str(count)
        self.current[role] = version
        self.used[role].add(version)
        return version

    def relabel(self, role: object, version: object) -> None:
        """Label ``role``'s current weights ``version`` without changing them.

        A label the role's weights have carried before is refused: records of two different weights would name one.
        """
        if version is None:
            raise ValueError("version must be a non-empty string of at most 256 characters, got None")
        check_update(role=role, version=version)
        role = Role(role)
        if version != self.current[role]:
            self.check_new(role, version)
        self.current[role] = version
        self.used[role].add(version)

    def check_new(self, role: object, version: str) -> None:
        """Refuse (ValueError) a label ``role``'s weights have carried, the current one included: records of two
        different weights would name one."""
        role = Role(role)
        if version in self.used[role]:
            raise ValueError(f"version {version!r} already labelled earlier {role} weights; choose a new label")

    def snapshot(self) -> dict[str, str]:
        """``{"teacher": ..., "theta": ...}``: the labels now, as plain strings."""
        return {str(role): version for role, version in self.current.items()}
