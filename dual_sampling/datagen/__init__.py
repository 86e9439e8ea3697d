"""Distillation data runs: inputs, plan, sinks and the run itself; Ray as one more way to draw.

The public names are :class:`~dual_sampling.datagen.run.RunConfig`,
:func:`~dual_sampling.datagen.run.run_generation` and :func:`~dual_sampling.datagen.run.read_records`.
"""

from dual_sampling.datagen.run import RunConfig, read_records, run_generation

__all__ = ["RunConfig", "read_records", "run_generation"]
