"""Lockstep: the shared memory through which the driver and every engine's two plugins meet.

Shared by the driver and the engines, so it imports nothing above it (only numpy and the
standard library):

- :mod:`~dual_sampling.lockstep.layout`: the session's words, who writes each, the finish
  and error codes;
- :mod:`~dual_sampling.lockstep.session`: one session mapped (slots, doorbells, plans, records);
- :mod:`~dual_sampling.lockstep.engine_config`: the typed settings that cross to each engine;
- :mod:`~dual_sampling.lockstep.janitor`: cleanup of what a crashed driver left in /dev/shm;
- :mod:`~dual_sampling.lockstep.driver_watch`: an engine process's watch on its driver.
"""

from dual_sampling.lockstep.driver_watch import watch_driver
from dual_sampling.lockstep.engine_config import CONFIG_KEY, LockstepConfig
from dual_sampling.lockstep.janitor import (
    cleanup_stale_sessions,
    listing_dir,
    mapped_shm_files,
    pid_alive,
    process_start_time,
    segments_listing,
    session_owners,
    write_listing,
)
from dual_sampling.lockstep.layout import (
    MODEL_WRITERS,
    PLAN_RING,
    RECORD_FIELDS,
    SESSION_PREFIX,
    SHM_DIR,
    TOP_LOGPROBS_MAX,
    WRITERS,
    Bell,
    EnginePairDead,
    ErrorCode,
    Finish,
    Header,
    ModelSlot,
    ModelWord,
    Phase,
    RequestFailed,
    SessionLayout,
    Slot,
    Stat,
    SyncError,
    Writer,
    check_host,
    slot_word,
)
from dual_sampling.lockstep.session import SyncSession

__all__ = [
    "CONFIG_KEY",
    "MODEL_WRITERS",
    "PLAN_RING",
    "RECORD_FIELDS",
    "SESSION_PREFIX",
    "SHM_DIR",
    "TOP_LOGPROBS_MAX",
    "WRITERS",
    "Bell",
    "EnginePairDead",
    "ErrorCode",
    "Finish",
    "Header",
    "LockstepConfig",
    "ModelSlot",
    "ModelWord",
    "Phase",
    "RequestFailed",
    "SessionLayout",
    "Slot",
    "Stat",
    "SyncError",
    "SyncSession",
    "Writer",
    "check_host",
    "cleanup_stale_sessions",
    "listing_dir",
    "mapped_shm_files",
    "pid_alive",
    "process_start_time",
    "segments_listing",
    "session_owners",
    "slot_word",
    "watch_driver",
    "write_listing",
]
