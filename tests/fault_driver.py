"""A driver process for the fault matrix (tests/test_faults.py): starts a dual engine, then misbehaves as told.

Usage: ``python -m tests.fault_driver stuck`` starts two engine-like processes forked as engines are, that never
finish starting (:func:`stand_in_engine`). ``python -m tests.fault_driver MODE TEACHER THETA SYNC_TIMEOUT`` prints one
line ``READY {json}`` (the session name and the engines' pids) once the engines run, then:

- ``normal``: generates and exits through the context manager;
- ``exception``: generates, then raises out of the program without closing anything;
- ``hold``: generates for a long time (the test sends a signal to it or to an engine), printing
  ``GENERATING`` once the teacher has decided 10 rows, so the test acts mid-generation by state, not after a
  sleep; an engine failure is printed as ``FAILED <message>``, and a later call's refusal as ``REFUSED <message>``.
"""

import json
import os
import sys
import threading
import time

from dual_sampling.driver import engine_start


def stand_in_engine() -> None:
    """An engine that never finishes starting (stuck in vLLM's handshake, say), with a worker forked from it: prints
    both pids, then sleeps."""
    worker = os.fork()
    if worker == 0:
        time.sleep(3600)
        os._exit(0)
    print(f"STARTED {os.getpid()} {worker}", flush=True)
    time.sleep(3600)


if __name__ == "__main__" and sys.argv[1] == "stuck":
    # Forked from the fork server as the pair's EngineCores are, but with no engine to build: the server imports
    # only what the stand-ins use (vLLM's engine modules would add 10 s here).
    import vllm.v1.engine.utils as launcher

    engine_start.PRELOAD = ("dual_sampling.lockstep", engine_start.__name__)
    with engine_start.engine_start({}, []):
        for _ in range(2):
            launcher.get_mp_context().Process(target=stand_in_engine, daemon=False).start()
    time.sleep(3600)

if __name__ == "__main__":
    engine_start.start_early()  # as the command line does: the engines' imports run beside this process's
    from dual_sampling import OptimalSamplingDual, SyncError

    mode, teacher, theta, sync_timeout = sys.argv[1:5]
    s = OptimalSamplingDual(
        teacher, theta, max_num_seqs=2, max_model_len=256, sync_timeout=float(sync_timeout), use_tqdm=False
    )
    print("READY " + json.dumps({"session": s.session.name, "pids": s.engine_pids()}), flush=True)
    if mode == "normal":
        with s:
            s.generate(["a short one"] * 3, max_tokens=8)
        sys.exit(0)
    if mode == "exception":
        s.generate(["a short one"] * 3, max_tokens=8)
        raise RuntimeError("the program fails with the engines still open")

    def announce() -> None:  # a daemon thread: the main thread stays in generate(), where signals land
        while s.get_sync_statistics()["teacher_rows"] < 10:
            time.sleep(0.05)
        sys.stdout.write("GENERATING\n")  # one write: vLLM logs to the same stream from other threads
        sys.stdout.flush()

    threading.Thread(target=announce, daemon=True).start()
    try:
        s.generate(["tell me a long story"] * 40, max_tokens=200, min_tokens=200)
    except SyncError as exc:
        print(f"FAILED {exc}", flush=True)
        try:
            s.generate(["a later call"], max_tokens=4)
        except SyncError as later:
            print(f"REFUSED {later}", flush=True)
        s.close()
        sys.exit(0)
    sys.exit(5)
