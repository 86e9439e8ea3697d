"""The vLLM plugins that keep a teacher and a theta engine in lockstep.

- ``processors.scheduler``: scheduler classes (``scheduler_cls``) that make both engines run
  the same requests at every step;
- ``processors.teacher`` / ``processors.theta``: logits processors that move one logits row
  and one decided token per request per step.
"""

from processors.base import BaseSyncLogitsProcessor
from processors.scheduler import LockstepScheduler, TeacherLockstepScheduler, ThetaLockstepScheduler
from processors.teacher import TeacherSyncLogitsProcessor
from processors.theta import ThetaSyncLogitsProcessor

__all__ = [
    "BaseSyncLogitsProcessor",
    "LockstepScheduler",
    "TeacherLockstepScheduler",
    "TeacherSyncLogitsProcessor",
    "ThetaLockstepScheduler",
    "ThetaSyncLogitsProcessor",
]
