"""Stand-ins for the command line's Ray stage, without engines, for tests/test_ray.py.

A Ray worker unpickles a stage class by importing the module that defines it, and imports it again in each replica
Ray restarts after a death. Here that module is this one, which loads no vLLM and no transformers (about 1.5 s, where
tests/test_ray.py loads both, about 8 s), so a restart costs what Ray's own restart costs.
"""

from __future__ import annotations

import os
from pathlib import Path

from dual_sampling.datagen.ray_stage import DualSamplingStage, _run_config
from dual_sampling.testing.scripted import ScriptedSampler


class DyingSampler(ScriptedSampler):
    """A scripted sampler whose process dies on every batch holding problem p3, logging each death in $CRASH_LOG;
    after 10 deaths it draws p3 too, so a run that retries without limit ends (and fails the test)."""

    def generate(self, prompts, **kwargs):
        log = Path(os.environ["CRASH_LOG"])
        if "p3" in kwargs["prompt_keys"] and (not log.exists() or log.read_text().count("\n") < 10):
            with log.open("a") as f:
                f.write("died\n")
            os._exit(1)
        return super().generate(prompts, **kwargs)


class DyingStage(DualSamplingStage):
    """The command line's stage with a :class:`DyingSampler` instead of engines."""

    def __init__(self, settings=None, emit="records", attempts=None, models=None):
        self.cfg = _run_config(settings or {})
        self.emit, self.attempts, self.replica, self.models = emit, attempts, str(os.getpid()), {}
        self.sampler = DyingSampler((self.cfg.source.teacher, self.cfg.source.theta))


class ScriptedStage(DualSamplingStage):
    """The command line's stage with a :class:`ScriptedSampler` of the run's models instead of engines."""

    def __init__(self, settings=None, emit="records", attempts=None, models=None):
        self.cfg = _run_config(settings or {})
        self.emit, self.attempts, self.replica, self.models = emit, attempts, str(os.getpid()), models
        self.sampler = ScriptedSampler((self.cfg.source.teacher, self.cfg.source.theta))
