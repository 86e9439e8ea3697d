"""The vLLM plugins that keep a teacher and a theta engine in lockstep.

- ``processors.scheduler``: scheduler classes (``scheduler_cls``) that make both engines run
  the same requests at every step;
- ``processors.teacher`` / ``processors.theta``: logits processors that move one logits row
  and one decided token per request per step;
- ``processors.model_runner``: the one module that speaks vLLM's model-runner interface (V1's); a port to
  Model Runner V2 changes it alone;
- ``processors.worker_extension``: the worker extension (``worker_extension_cls``) the driver
  calls between requests: a weight reload that also refreshes tied output projections
  (``processors.weights_reload``), and a new alpha computer for the teacher's processor.
"""

from processors.base import BaseSyncLogitsProcessor
from processors.scheduler import LockstepScheduler, TeacherLockstepScheduler, ThetaLockstepScheduler
from processors.teacher import TeacherSyncLogitsProcessor
from processors.theta import ThetaSyncLogitsProcessor
from processors.worker_extension import DualSamplingWorkerExtension

__all__ = [
    "BaseSyncLogitsProcessor",
    "DualSamplingWorkerExtension",
    "LockstepScheduler",
    "TeacherLockstepScheduler",
    "TeacherSyncLogitsProcessor",
    "ThetaLockstepScheduler",
    "ThetaSyncLogitsProcessor",
]
