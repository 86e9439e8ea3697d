"""A stand-in for :class:`~dual_sampling.api.OptimalSamplingDual` that starts no engine: data runs (and their
benchmark) without models running, with samples made up from their seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from dual_sampling.options import derive_seed
from dual_sampling.records import DualGenerationOutput, RequestRecord, SampleRecord
from dual_sampling.roster import PAIR, THETA, Roster

__all__ = ["ScriptedSampler"]


class ScriptedSampler:
    """OptimalSamplingDual's stand-in for runs without engines.

    ``models`` is (teacher, theta) as :class:`~dual_sampling.options.DualEngineConfig` takes them: the teacher one
    folder, or ``{name: folder}`` for several teachers. Every sample is made up from its seed (three tokens, finite
    numbers, ended by token id 2), in the records of the roster: with several teachers, each teacher's α and log π
    in :attr:`SampleRecord.roster_columns`. ``script(prompt_key, sample_index)`` returns fields to change (a NaN, a
    stop string, a cut-off answer); with several teachers a roster column's name (``alpha_<teacher>``) changes that
    column. ``drawn`` lists every (prompt_key, sample_index) drawn and ``prompts`` every call's
    (θ prompts, teacher prompts), unless ``keep_drawn`` is False (a long benchmark run should not grow a list).
    """

    def __init__(
        self,
        models: tuple[str | Path | Mapping[str, str | Path], str | Path],
        script: Callable[[str, int], dict[str, Any]] | None = None,
        keep_drawn: bool = True,
    ) -> None:
        from dual_sampling.options import DualEngineConfig

        teacher, theta = models
        teacher = {k: str(v) for k, v in teacher.items()} if isinstance(teacher, Mapping) else str(teacher)
        self.config = DualEngineConfig(model_teacher=teacher, model_theta=str(theta), use_tqdm=False)
        self.script = script or (lambda key, j: {})
        self.keep_drawn = keep_drawn
        self.drawn: list[tuple[str, int]] = []
        self.prompts: list[tuple[list, Any]] = []
        self.count = 0

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.config.tokenizer_folder)

    def generate(self, prompts, teacher_prompts, prompt_keys, sampling, use_tqdm) -> DualGenerationOutput:
        roster = self.config.roster
        if self.keep_drawn:
            self.prompts.append((list(prompts), teacher_prompts))
        requests = []
        for index, key in enumerate(prompt_keys):
            samples = []
            for j in range(sampling.n):
                seed = derive_seed(sampling.seed, key, j)
                sample = SampleRecord(
                    text=f"answer {key}/{j}",
                    token_ids=[17 + (seed >> k) % 40 for k in range(3)],
                    finish_reason="stop",
                    seed=seed,
                    alpha=[0.25, 0.5, 0.75],
                    logp_teacher=[-1.0, -2.0, -0.5],
                    logp_theta=[-1.5, -1.0, -0.25],
                    logq=[-1.25, -1.5, -0.375],
                    stop_reason=2,
                )
                if roster != PAIR:
                    sample.roster_columns = _roster_columns(roster, sample)
                    sample.alpha, sample.logp_teacher = [], []
                for name, value in self.script(key, j).items():
                    if name in sample.roster_columns:
                        sample.roster_columns[name] = value
                    if name in sample.roster_columns and name not in (f"logp_{THETA}", "logq"):
                        continue
                    setattr(sample, name, value)
                samples.append(sample)
                self.count += 1
                if self.keep_drawn:
                    self.drawn.append((key, j))
            requests.append(RequestRecord(index, [], [], samples))
        return DualGenerationOutput(requests)

    def get_sync_statistics(self) -> dict[str, int]:
        return {"requests": self.count}

    def close(self) -> None:
        pass


def _roster_columns(roster: Roster, sample: SampleRecord) -> dict[str, list[float]]:
    """Made-up records of several teachers: the pair's α split evenly, teacher i's log π the pair teacher's less
    i/10, θ's and q's the pair's."""
    teachers = len(roster.teachers)
    alphas = {column: [a / teachers for a in sample.alpha] for column in roster.alpha_columns}
    logps = {f"logp_{t}": [x - i / 10 for x in sample.logp_teacher] for i, t in enumerate(roster.teachers)}
    return {**alphas, **logps, f"logp_{THETA}": list(sample.logp_theta), "logq": list(sample.logq)}
