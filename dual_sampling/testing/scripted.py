"""A stand-in for :class:`~dual_sampling.api.OptimalSamplingDual` that starts no engine: data runs (and their
benchmark) without models running, with samples made up from their seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dual_sampling.api import derive_seed
from dual_sampling.records import DualGenerationOutput, RequestRecord, SampleRecord

__all__ = ["ScriptedSampler"]


class ScriptedSampler:
    """OptimalSamplingDual's stand-in for runs without engines.

    Every sample is made up from its seed (three tokens, finite numbers, ended by token id 2);
    ``script(prompt_key, sample_index)`` returns fields to change (a NaN, a stop string, a cut-off answer).
    ``drawn`` lists every (prompt_key, sample_index) drawn (unless ``keep_drawn`` is False: a long benchmark run
    should not grow a list).
    """

    def __init__(
        self,
        models: tuple[str | Path, str | Path],
        script: Callable[[str, int], dict[str, Any]] | None = None,
        keep_drawn: bool = True,
    ) -> None:
        teacher, theta = models
        self.config = SimpleNamespace(model_teacher=str(teacher), model_theta=str(theta))
        self.script = script or (lambda key, j: {})
        self.keep_drawn = keep_drawn
        self.drawn: list[tuple[str, int]] = []
        self.count = 0

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.config.model_teacher)

    def generate(self, prompts, teacher_prompts, prompt_keys, sampling, use_tqdm) -> DualGenerationOutput:
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
                for name, value in self.script(key, j).items():
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
