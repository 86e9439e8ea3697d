"""The fault matrix: whatever ends the driver or an engine, no process and no /dev/shm file of ours remains.

Each case starts a driver process (``tests/fault_driver.py``) on the tiny models, takes the
process table and the /dev/shm listing before it starts, applies one fault, and compares
once things settle: normal exit, an exception escaping the program, SIGINT, SIGTERM and
SIGKILL of the driver, and SIGKILL of each engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from dual_sampling.lockstep import SESSION_PREFIX, SessionLayout, SyncSession, listing_dir, mapped_shm_files
from tests import processes
from tests.budget import ENGINE_PAIR_START_S

pytestmark = [
    pytest.mark.engine,
    pytest.mark.budget(
        120,
        reason=(
            "each case starts a pair in a driver process of its own and waits out its end: 25-45 s, but the end's "
            "bounded waits (the driver's 10 s sync_timeout, the engines' 10 s exit grace, 60 s for leftovers to "
            "settle) add up under load (one fresh-clone run saw 73 s for the SIGINT case, 25 s on a rerun)"
        ),
    ),
]


def settled(before: tuple[set[int], set[str]]) -> tuple[set[str], set[str]]:
    """This session's new processes and shared-memory files (tests/processes.py), once gone or at SETTLE_S."""
    return processes.settled(before)


def start_driver(mode: str, tiny_same, sync_timeout: float = 10) -> tuple[subprocess.Popen, dict]:
    teacher, theta = tiny_same
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fault_driver", mode, str(teacher), str(theta), str(sync_timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("READY "):
            info = json.loads(line[6:])
            break
    else:
        raise AssertionError(f"the driver did not start: {proc.stderr.read()[-3000:]}")
    if mode == "hold":  # act mid-generation: once the teacher has decided rows, not after a sleep (vLLM logs too)
        for line in proc.stdout:
            if "GENERATING" in line:
                break
        else:
            raise AssertionError(f"the driver never generated: {proc.stderr.read()[-3000:]}")
    return proc, info


@pytest.mark.parametrize("mode", ["normal", "exception"])
def test_exit_leaves_nothing(tiny_same, mode):
    before = processes.snapshot()
    proc, _ = start_driver(mode, tiny_same)
    code = proc.wait(timeout=300)
    assert code == (0 if mode == "normal" else 1), proc.stderr.read()[-3000:]
    assert settled(before) == (set(), set())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_driver_interrupted_or_terminated_leaves_nothing(tiny_same, sig):
    before = processes.snapshot()
    proc, info = start_driver("hold", tiny_same)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) != 0
    assert not any(psutil.pid_exists(p) for pids in info["pids"].values() for p in pids) or settled(before)[0] == set()
    assert settled(before) == (set(), set())


def test_driver_killed_engines_exit_by_themselves_and_next_session_cleans(tiny_same):
    before = processes.snapshot()
    proc, info = start_driver("hold", tiny_same)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    engine_pids = [p for pids in info["pids"].values() for p in pids]
    deadline = time.monotonic() + 10  # sync_timeout of the driver's engines
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in engine_pids):
        assert time.monotonic() < deadline, "the engines outlived their driver"
        time.sleep(0.2)
    assert any(f.startswith(info["session"]) for f in os.listdir("/dev/shm")), "nothing was left for the next session"
    SyncSession.create(SessionLayout(8, 2, 4, 1)).close()  # a new session removes what dead drivers left
    assert settled(before) == (set(), set())


@pytest.mark.parametrize("victim", ["teacher", "theta"])
def test_engine_killed_fails_fast_names_it_and_leaves_nothing(tiny_same, victim):
    before = processes.snapshot()
    # sync_timeout is 10 minutes: a driver that left the failure to it would miss the ENGINE_PAIR_START_S (5 min)
    # deadline below, whatever the failure then says (the driver closes the other engine and exits: ~15 s idle).
    proc, info = start_driver("hold", tiny_same, sync_timeout=600)
    os.kill(info["pids"][victim][0], signal.SIGKILL)
    out, err = proc.communicate(timeout=ENGINE_PAIR_START_S)
    assert proc.returncode == 0, err[-3000:]
    failed = [line for line in out.splitlines() if line.startswith("FAILED ")]
    # Named as the engine's death, by the driver's watch on its processes, not found later as a sync timeout.
    assert failed and f"the {victim} engine failed" in failed[0] and "sync_timeout" not in failed[0]
    refused = [line for line in out.splitlines() if line.startswith("REFUSED ")]  # the instance refuses later calls
    assert (
        refused and f"the {victim} engine failed" in refused[0] and "this OptimalSamplingDual is closed" in refused[0]
    )
    assert settled(before) == (set(), set())
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(SESSION_PREFIX) and info["session"] in f]
    # The dead engine's message-queue segment, removed by the driver, is forgotten by its resource tracker too: no
    # "leaked shared_memory objects" warning at the driver's exit, no failed unlink of a file already gone.
    assert "leaked shared_memory" not in err and "No such file or directory" not in err, err[-3000:]


def test_driver_killed_while_engines_start_leaves_nothing_after_the_next_session(tiny_same, tmp_path):
    """A cluster manager kills the driver and its resource trackers before both engines are up (Ray does).

    The kill lands once both EngineCores map shared-memory files the driver has listed. What the engines made before
    the kill only the driver's start-up listing names; what they make after it, each engine removes itself when it
    sees its driver gone (a forked one watches from its first line: the next test).
    """
    teacher, theta = tiny_same
    before = processes.snapshot()
    out = tmp_path / "driver.out"
    with out.open("w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fault_driver", "hold", str(teacher), str(theta), "10"],
            stdout=stdout,
            stderr=subprocess.DEVNULL,
        )
    listing_glob = f"{SESSION_PREFIX}{proc.pid}-*.segments"
    deadline = time.monotonic() + ENGINE_PAIR_START_S
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the engines' files were not listed while starting"
        with contextlib.suppress(psutil.Error, FileNotFoundError, ValueError):
            # The driver's fork server's children (dual_sampling.driver.engine_start), or its own when spawned.
            tree = psutil.Process(proc.pid).children(recursive=True)
            cores = [p for p in tree if p.name().startswith("VLLM::EngineCore")]
            core_files = [{n for n in mapped_shm_files([p.pid]) if n.startswith("psm_")} for p in cores]
            listed = {n for path in listing_dir().glob(listing_glob) for n in json.loads(path.read_text())}
            if len(cores) == 2 and all(core_files) and set().union(*core_files) <= listed:
                break
        time.sleep(0.05)
    tree = psutil.Process(proc.pid).children(recursive=True)
    for p in [psutil.Process(proc.pid), *(p for p in tree if "resource_tracker" in " ".join(p.cmdline()))]:
        p.kill()
    proc.wait()
    assert "READY" not in out.read_text(), "the engines were up before the kill: nothing was tested"
    _, alive = psutil.wait_procs(tree, timeout=ENGINE_PAIR_START_S)
    assert not alive, f"engine processes outlived their driver: {alive}"
    SyncSession.create(SessionLayout(8, 2, 4, 1)).close()  # a new session removes what dead drivers left
    assert settled(before) == (set(), set())


def test_forked_engines_whose_driver_dies_mid_start_exit_with_their_workers():
    """An EngineCore forked from the fork server is not its driver's child: wherever its start is when the driver dies
    (vLLM's handshake, loading, before our scheduler exists), it and its worker exit within seconds.

    Two stand-in engines that never finish starting (``tests/fault_driver.py stuck``), forked as the pair's are, each
    with a forked worker. The second's EngineCore is killed first, so its worker must see the driver's death itself.
    """
    from dual_sampling.driver import engine_start

    if not engine_start.forkserver_available():
        pytest.skip("engines do not start from the fork server here (DUAL_SAMPLING_ENGINE_START=spawn)")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fault_driver", "stuck"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    engines: list[list[psutil.Process]] = []
    try:
        for _ in range(2):
            line = proc.stdout.readline()
            if not line.startswith("STARTED "):
                proc.kill()
                raise AssertionError(f"no stand-in engine started: {proc.communicate()[1][-3000:]}")
            engines.append([psutil.Process(int(pid)) for pid in line.split()[1:]])
        (core, worker), (orphaned_core, orphaned_worker) = engines
        orphaned_core.kill()
        orphaned_core.wait(10)
        proc.kill()
        proc.wait()
        assert orphaned_worker.is_running(), "the worker ended with its EngineCore: its own watch was not tested"
        _, alive = psutil.wait_procs([core, worker, orphaned_worker], timeout=20)
        assert not alive, f"forked engine processes outlived their driver: {alive}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        for p in (p for pair in engines for p in pair):  # the stand-ins sleep for an hour should a check fail
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_an_exception_inside_a_live_engine_core_fails_everything_at_once(tiny_same):
    """After an exception inside an EngineCore, vLLM raises EngineDeadError to every call; its process lives on.

    The exception is injected by sending the teacher engine a request that the driver did not
    build: its scheduler plugin refuses it (no pairing) inside the EngineCore's loop. The
    EngineCore's process exits only seconds later; the driver must fail at once, naming the engine.
    """
    import asyncio
    import threading
    from multiprocessing import resource_tracker

    from vllm import SamplingParams
    from vllm.v1.engine.exceptions import EngineDeadError

    from dual_sampling import OptimalSamplingDual, SyncError

    teacher, theta = tiny_same
    resource_tracker.ensure_running()  # this test process's own, which outlives the test by design
    before = processes.snapshot()
    # sync_timeout is 10 minutes: a driver that waited for it instead of acting on vLLM's verdict misses the
    # 30 s join below, whatever name its failure then carries.
    dual = OptimalSamplingDual(teacher, theta, max_num_seqs=2, max_model_len=256, sync_timeout=600, use_tqdm=False)
    try:
        outcome: dict = {}

        def generate() -> None:
            try:
                dual.generate(["tell me a long story"] * 40, max_tokens=200, min_tokens=200)
            except SyncError as exc:
                outcome["error"] = str(exc)

        worker = threading.Thread(target=generate)
        worker.start()
        deadline = time.monotonic() + 60
        while dual.get_sync_statistics()["teacher_rows"] < 10:  # mid-generation
            assert time.monotonic() < deadline and worker.is_alive(), outcome
            time.sleep(0.05)

        async def intrude() -> None:
            prompt = {"prompt_token_ids": [1, 2, 3]}
            async for _ in dual.driver.engines.teacher.generate(prompt, SamplingParams(), "intruder"):
                pass

        with pytest.raises(EngineDeadError):
            asyncio.run_coroutine_threadsafe(intrude(), dual.driver.loop).result(60)
        worker.join(timeout=30)
        assert not worker.is_alive(), "generate() still waits: the failure was left to sync_timeout"
        assert outcome.get("error", "").startswith("the teacher engine failed"), outcome
        # Seen as vLLM's verdict (at once), not later as the process's exit or as a sync timeout: by the failure's name.
        assert not dual.driver.alive and "EngineDeadError" in str(dual.driver.failure), dual.driver.failure
        with pytest.raises(SyncError, match="the teacher engine failed"):
            dual.generate(["later"], max_tokens=4)
    finally:
        dual.close()
    assert settled(before) == (set(), set())
