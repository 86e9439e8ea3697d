"""The vLLM plugins that keep a teacher and a theta engine in lockstep.

- ``processors.scheduler``: scheduler classes (``scheduler_cls``) that make both engines run
  the same requests at every step;
- ``processors.teacher`` / ``processors.theta``: logits processors that move one logits row
  and one decided token per request per step;
- ``processors.weights_reload``: a worker extension (``worker_extension_cls``) whose weight
  reload also refreshes tied output projections.
"""

from processors.base import BaseSyncLogitsProcessor
from processors.scheduler import LockstepScheduler, TeacherLockstepScheduler, ThetaLockstepScheduler
from processors.teacher import TeacherSyncLogitsProcessor
from processors.theta import ThetaSyncLogitsProcessor
from processors.weights_reload import WeightsReloadExtension

__all__ = [
    "BaseSyncLogitsProcessor",
    "LockstepScheduler",
    "TeacherLockstepScheduler",
    "TeacherSyncLogitsProcessor",
    "ThetaLockstepScheduler",
    "ThetaSyncLogitsProcessor",
    "WeightsReloadExtension",
]
