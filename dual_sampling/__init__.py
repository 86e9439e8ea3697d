"""dual-sampling: generate text from the geometric mixture of a teacher and a theta (student) model.

    from dual_sampling import OptimalSamplingDual
    with OptimalSamplingDual(model_teacher, model_theta, alpha_method="kl_symmetry") as s:
        out = s.generate(prompts, max_tokens=256)

vLLM is imported only when an engine starts.
"""

from dual_sampling.engine import DualEngineConfig, OptimalSamplingDual
from dual_sampling.outputs import DualGenerationOutput, RequestRecord, SampleRecord
from dual_sampling.sync import SyncError

__all__ = ["DualEngineConfig", "DualGenerationOutput", "OptimalSamplingDual", "RequestRecord", "SampleRecord", "SyncError"]
