"""The vLLM plugins that keep the engines of a roster in lockstep: one leader (the teacher's engine in a pair) and
its followers (θ's).

- ``processors.scheduler``: scheduler classes (``scheduler_cls``) that make every engine run
  the same requests at every step;
- ``processors.leader`` / ``processors.follower``: logits processors that move one logits row
  per follower and one decided token per request per step;
- ``processors.model_runner``: the one module that speaks vLLM's model-runner interface (V1's); a port to
  Model Runner V2 changes it alone;
- ``processors.worker_extension``: the worker extension (``worker_extension_cls``) the driver
  calls between requests: a weight reload that also refreshes tied output projections
  (``processors.weights_reload``), and a new alpha computer for the leader's processor.
"""

from processors.base import BaseSyncLogitsProcessor
from processors.follower import FollowerLogitsProcessor
from processors.leader import LeaderLogitsProcessor
from processors.scheduler import FollowerScheduler, LeaderScheduler, LockstepScheduler
from processors.worker_extension import DualSamplingWorkerExtension

__all__ = [
    "BaseSyncLogitsProcessor",
    "DualSamplingWorkerExtension",
    "FollowerLogitsProcessor",
    "FollowerScheduler",
    "LeaderLogitsProcessor",
    "LeaderScheduler",
    "LockstepScheduler",
]
