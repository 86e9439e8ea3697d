"""The configuration of a data-generation run: :class:`RunConfig`, its flat keys (CLI flags, run.yaml) and the
settings that decide what its records contain (its identity, which ``--resume`` compares).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dual_sampling.checks import need_int, need_number
from dual_sampling.datagen.schema import record_fields
from dual_sampling.options import RUNTIME_ONLY, EngineOptions, SamplingOptions
from dual_sampling.roster import THETA, Roster
from dual_sampling.run_settings import (
    ModelsAndPrompts,
    PerTeacher,
    compose_settings,
    flat_settings,
    identity_settings,
    per_teacher,
    runtime_only,
)

__all__ = ["RunConfig"]


@dataclass
class RunConfig:
    """One data-generation run.

    It composes :class:`ModelsAndPrompts` (the models, the prompt's fields), :class:`SamplingOptions`
    (how to sample) and :class:`EngineOptions` (how to run the engines). On the command line and in
    ``--config run.yaml`` every field of all four is one flat key (``--max-tokens 128``,
    ``alpha_method: ess_balance``); see :meth:`from_settings`.
    """

    input: str
    """Problems: a .jsonl or .parquet file, or a local Hugging Face datasets folder."""
    output: str = field(metadata=RUNTIME_ONLY)
    """Records: a .jsonl or .parquet file, or a directory (Parquet parts, for runs of any size)."""
    id_field: str | None = None
    """Field holding a unique id; None uses the row number."""
    system_prompt_teacher: PerTeacher | None = None
    """System message for the teacher's chat; with several teachers, one for all or ``{teacher: message}``
    (``--system-prompt-teacher NAME=TEXT``)."""
    system_prompt_theta: str | None = None
    """System message for theta's chat."""
    teacher_template: PerTeacher | None = None
    """Jinja template (string or file) of the teacher's user message; sees problem, hint, row. With several teachers,
    one for all or ``{teacher: template}`` (``--teacher-template NAME=TEMPLATE``)."""
    theta_template: str | None = None
    """Jinja template (string or file) of theta's user message; sees problem, hint, row (its hint is the teachers'
    when they share one hint field, as in a pair; None when each teacher has its own)."""
    format: str = "records"
    """"records" (everything) or "messages" (a TRL-ready chat view)."""
    keep_truncated: bool = False
    """With format "messages": keep answers cut off at max_tokens (finish_reason "length") as training targets,
    marked ``truncated``; by default they are left out, logged to OUT.truncated.jsonl and counted in the summary."""
    shard: str = "0/1"
    """"i/N": this machine's deterministic share of the dataset."""
    resume: bool = field(default=False, metadata=RUNTIME_ONLY)
    """Continue an interrupted run in place (failed samples are drawn again)."""
    batch_size: int = field(default=32, metadata=RUNTIME_ONLY)
    """Problems per generate() call (with --ray: per replica batch); records are fsync'd after each."""
    ray: bool = field(default=False, metadata=RUNTIME_ONLY)
    """Draw the samples on a Ray cluster (RAY_ADDRESS, or a local one started for the run) with Ray Data."""
    replicas: int = field(default=1, metadata=RUNTIME_ONLY)
    """With --ray: dual engines running at once, one per Ray actor."""
    cpus_per_replica: float = field(default=2.0, metadata=RUNTIME_ONLY)
    """With --ray: CPUs each replica reserves (its two engines' model threads share them)."""
    gpus_per_replica: float = field(default=0.0, metadata=RUNTIME_ONLY)
    """With --ray: GPUs each replica reserves (2 puts each engine on its own GPU)."""
    ray_max_retries: int = field(default=3, metadata=RUNTIME_ONLY)
    """With --ray: how often a batch whose replica died is drawn again (on the restarted replica); after that its
    samples fail as replica_crashed (drawn again by --resume), so a batch that always kills its replica ends."""
    source: ModelsAndPrompts = field(default_factory=ModelsAndPrompts)
    """The models and the fields of a problem's row; its fields are flat keys (teacher, theta, prompt_field, ...)."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    """How to sample; its fields are flat keys of the run (n, max_tokens, temperature, seed, ...)."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """How to run the engines; its fields are flat keys of the run (alpha_method, max_num_seqs, ...)."""

    def __post_init__(self) -> None:
        if self.format not in ("records", "messages"):
            raise ValueError(f"format must be 'records' or 'messages', got {self.format!r}")
        if self.keep_truncated and self.format != "messages":
            raise ValueError("keep_truncated applies to format 'messages' only; records keep every answer")
        if Path(self.output).suffix not in (".jsonl", ".parquet", ""):
            raise ValueError(f"output must be a .jsonl or .parquet file, or a directory, got {self.output!r}")
        if self.sampling.dense_logprobs:
            # Refused rather than dropped: a run's records have no column for them yet.
            raise ValueError(
                "dense_logprobs is not written by data runs; ask for it through the Python API or the server"
            )
        self.shard_index, self.shard_count = _parse_shard(self.shard)
        for name in ("system_prompt_teacher", "teacher_template"):
            per_teacher(name, getattr(self, name), self.roster)
        self.engine.check_roster(self.roster)
        record_fields(self.format, self.roster)  # column names the teachers' names make must be new ones
        for name, least in (("batch_size", 1), ("replicas", 1), ("ray_max_retries", 0)):
            need_int(name, getattr(self, name), least)
        for name in ("cpus_per_replica", "gpus_per_replica"):
            setattr(self, name, need_number(name, getattr(self, name)))

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> RunConfig:
        """Build from flat keys (CLI flags, run.yaml): each goes to the run, its sampling or its engine options."""
        return compose_settings(cls, settings)

    @property
    def roster(self) -> Roster:
        """The run's models by name (its :attr:`source`'s): what the records' columns follow."""
        return self.source.roster

    def templates(self) -> dict[str, str | None]:
        """Each model's user-message template by roster name (None: the default)."""
        return {**per_teacher("teacher_template", self.teacher_template, self.roster), THETA: self.theta_template}

    def system_prompts(self) -> dict[str, str | None]:
        """Each model's system message by roster name (None: none)."""
        teachers = per_teacher("system_prompt_teacher", self.system_prompt_teacher, self.roster)
        return {**teachers, THETA: self.system_prompt_theta}

    def flat(self) -> dict[str, Any]:
        """Every setting as one flat mapping (the inverse of :meth:`from_settings`)."""
        return flat_settings(self)

    def identity(self) -> dict[str, Any]:
        """The settings that decide what the records contain (compared on --resume)."""
        return identity_settings(self, _NOT_IDENTITY)


_NOT_IDENTITY = runtime_only(RunConfig)
"""Settings that do not change what a record contains (so --resume may change them): those marked RUNTIME_ONLY."""


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"shard must look like 'i/N', got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"shard must satisfy 0 <= i < N, got {text!r}")
    return i, n
