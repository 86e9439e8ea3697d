"""vLLM logits-processor plugins that keep a teacher and a theta engine in lockstep.

See ``processors.base`` for the protocol each engine follows.
"""

from processors.base import BaseSyncLogitsProcessor
from processors.teacher import TeacherSyncLogitsProcessor
from processors.theta import ThetaSyncLogitsProcessor

__all__ = ["BaseSyncLogitsProcessor", "TeacherSyncLogitsProcessor", "ThetaSyncLogitsProcessor"]
