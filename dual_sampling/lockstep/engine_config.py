"""What an engine's plugins need to join a lockstep session, as one typed value that crosses to the engine.

The driver builds one :class:`LockstepConfig` per engine from the user's settings and hands it
to vLLM as ``additional_config["dual_sampling"]`` (a plain dict: vLLM hashes and ships it to the
engine's processes). Each plugin reads it back with :meth:`LockstepConfig.from_vllm`, which
refuses a missing, unknown or ill-typed key by name, so a plugin never guesses at a setting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dual_sampling.checks import is_int, need_number
from dual_sampling.lockstep.row_channel import ROW_TRANSPORTS
from dual_sampling.roster import PAIR, Roster

__all__ = ["CONFIG_KEY", "LockstepConfig"]

CONFIG_KEY = "dual_sampling"
"""The key of vLLM's ``additional_config`` (and of each request's ``extra_args``) that holds our settings."""


@dataclass(frozen=True)
class LockstepConfig:
    """One engine's lockstep settings; validated when built, on either side of the process boundary."""

    role: str
    """This engine's model: its name in :attr:`roster` ("teacher" or "theta" in a pair)."""
    session: str
    """The shared-memory session's name (``SyncSession.create`` made it)."""
    sync_timeout: float
    """Seconds a plugin waits for its partner before the row (and only its request) fails."""
    alpha_method: str = "kl_symmetry"
    """The alpha computer's registry name (``alpha.get_alpha_computer``), checked where the user gave it
    (``EngineOptions``); the leader's processor builds the computer from it."""
    alpha_config: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the alpha computer."""
    mix_helper_cpus: tuple[int, ...] = ()
    """CPUs the leader's processor may borrow for half of each step's rows (a follower's, idle while the leader
    decides); empty: none."""
    row_transport: str = "host"
    """How the followers' rows reach the leader (``lockstep.row_channel``), resolved by the driver: host, pinned or
    device (never "auto" here)."""
    roster: tuple[str, ...] = PAIR.names
    """The session's models by name, the leader first (``dual_sampling.roster.Roster.names``)."""

    def __post_init__(self) -> None:
        try:
            roster = Roster(tuple(self.roster) if isinstance(self.roster, (list, tuple)) else self.roster)
        except ValueError as exc:
            raise ValueError(f"roster must list the session's models, the leader first: {exc}") from None
        object.__setattr__(self, "roster", roster.names)
        if roster.names[0] == roster.student and len(roster.names) == 2:
            # A pair's fused kernels take the teacher's rows as raw logits (its engine leads); θ leads several
            # teachers only (Roster.of_teachers), whose decision is the torch reference's.
            raise ValueError(f"roster must have its one teacher first (its engine leads), got {roster.names}")
        if self.role not in roster.names:
            raise ValueError(f"role must be a model of the roster {roster.names}, got {self.role!r}")
        if not isinstance(self.session, str):
            raise ValueError(f"session must be a string, got {self.session!r}")
        object.__setattr__(self, "sync_timeout", need_number("sync_timeout", self.sync_timeout, positive=True))
        if not isinstance(self.alpha_config, Mapping):
            raise ValueError(f"alpha_config must be a mapping of keyword arguments, got {self.alpha_config!r}")
        cpus = tuple(self.mix_helper_cpus or ())
        if not all(is_int(c) and c >= 0 for c in cpus):
            raise ValueError(f"mix_helper_cpus must be CPU numbers, got {self.mix_helper_cpus!r}")
        object.__setattr__(self, "mix_helper_cpus", cpus)
        if self.row_transport not in ROW_TRANSPORTS[1:]:
            raise ValueError(f"row_transport must be one of {ROW_TRANSPORTS[1:]}, got {self.row_transport!r}")

    def with_session(self, session: str) -> LockstepConfig:
        """The same settings for another session."""
        return dataclasses.replace(self, session=session)

    def to_engine(self) -> dict[str, Any]:
        """``additional_config`` for vLLM: ``{CONFIG_KEY: {field: value}}`` of plain JSON values."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(
            alpha_config=dict(self.alpha_config), mix_helper_cpus=list(self.mix_helper_cpus), roster=list(self.roster)
        )
        return {CONFIG_KEY: values}

    @property
    def position(self) -> int:
        """This engine's roster position: 0 leads, every other follows."""
        return self.roster.index(self.role)

    @property
    def leads(self) -> bool:
        return self.position == 0

    @classmethod
    def from_vllm(cls, vllm_config: Any, leads: bool, plugin: str) -> LockstepConfig:
        """The settings the driver put in ``vllm_config.additional_config``, for the plugin named ``plugin`` (a
        leader's if ``leads``, else a follower's); ValueError naming what is missing, unknown or wrong."""
        values = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
        if not values:
            raise ValueError(
                f"{plugin} needs LLM(..., additional_config={{'{CONFIG_KEY}': {{...}}}}) naming the session; "
                "build engines through dual_sampling.OptimalSamplingDual"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"{plugin}: additional_config['{CONFIG_KEY}'] has unknown keys {unknown}")
        try:
            config = cls(**values)
        except TypeError as exc:  # a required key is missing
            raise ValueError(f"{plugin}: additional_config['{CONFIG_KEY}'] is incomplete: {exc}") from None
        if config.leads != leads:
            kind, other = ("leader", "follows") if leads else ("follower", "leads")
            raise ValueError(
                f"{plugin} is a {kind}'s plugin but the engine's model {config.role!r} {other} (roster {config.roster})"
            )
        return config
