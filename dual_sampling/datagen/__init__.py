"""Distillation data runs: inputs, plan, sinks and the run itself; Ray as one more way to draw.

The public names are :class:`~dual_sampling.datagen.run_config.RunConfig`,
:func:`~dual_sampling.datagen.run.run_generation` and :func:`~dual_sampling.datagen.sinks.read_records`.
"""

from dual_sampling.datagen.run import run_generation
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.datagen.sinks import read_records

__all__ = ["RunConfig", "read_records", "run_generation"]
