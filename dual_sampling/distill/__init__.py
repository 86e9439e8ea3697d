"""On-policy distillation with the mixture: sample from q with the current θ, train θ on the samples (importance
weights π_θ/q), push the new weights into the running theta engine, evaluate on held-out prompts."""

from dual_sampling.distill.config import DistillConfig
from dual_sampling.distill.loop import Distiller, run_distillation
from dual_sampling.distill.mismatch import Mismatch, SamplerMismatchError, sampler_trainer_mismatch

__all__ = [
    "DistillConfig",
    "Distiller",
    "Mismatch",
    "SamplerMismatchError",
    "run_distillation",
    "sampler_trainer_mismatch",
]
