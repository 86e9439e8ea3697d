"""The shared-memory protocol's pieces, one at a time (no engines): layout, doorbells, slots, plans, settings checks."""

from __future__ import annotations

import collections
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from stat import S_IMODE, S_ISDIR

import numpy as np
import pytest

from dual_sampling.driver import engine_processes
from dual_sampling.driver.engine_processes import engine_cpus, reap, split_cpu_binding
from dual_sampling.driver.pair import EnginePair
from dual_sampling.lockstep import (
    MODEL_WRITERS,
    SESSION_PREFIX,
    WRITERS,
    Bell,
    ErrorCode,
    Header,
    ModelSlot,
    ModelWord,
    Phase,
    SessionLayout,
    Slot,
    Stat,
    SyncError,
    SyncSession,
    Writer,
    cleanup_stale_sessions,
    segments_listing,
    slot_word,
)
from dual_sampling.lockstep.layout import HEADER_WORDS, MAX_MODELS, MODEL_WORDS, SLOT_WORDS, STATS_BASE
from dual_sampling.options import DualEngineConfig


@pytest.fixture
def session():
    with SyncSession.create(SessionLayout(vocab=8, slots=3, max_steps=4, plan_width=2)) as s:
        yield s


def test_every_slot_word_has_named_writers_and_no_words_overlap():
    assert set(WRITERS) == set(Slot) and set(MODEL_WRITERS) == set(ModelSlot)
    # __members__ holds aliases too (iterating an IntEnum skips them): two names for one word are an overlap.
    slot_words = [int(w) for w in Slot.__members__.values()]
    assert len(set(slot_words)) == len(slot_words) and max(slot_words) < SLOT_WORDS
    for models in (2, 3, MAX_MODELS):
        layout = SessionLayout(vocab=8, slots=1, max_steps=1, plan_width=1, models=models)
        model_words = [slot_word(w, p) for p in range(models) for w in ModelSlot.__members__.values()]
        assert len(set(slot_words + model_words)) == len(slot_words) + len(model_words)
        assert max(model_words) < layout.control_words
    assert max(int(w) for w in ModelWord.__members__.values()) < MODEL_WORDS
    header_words = [int(w) for w in Header.__members__.values()]
    stat_words = [int(w) for w in Stat.__members__.values()]
    assert len(set(header_words + stat_words)) == len(header_words) + len(stat_words)
    assert max(header_words) < STATS_BASE <= min(stat_words) and max(stat_words) < HEADER_WORDS


def test_a_bell_rung_by_many_writers_at_once_never_loses_a_wake(session):
    """Three waiters and two ringers, 100 rounds: in each, every waiter has read the bell before either rings, and
    each must wake. A lost wake leaves a waiter asleep (its wait is 60 s) and breaks the round's barrier."""
    waiters, rounds = 3, 100
    start, done = threading.Barrier(waiters + 1, timeout=30), threading.Barrier(waiters + 1, timeout=30)
    woken = [0] * waiters

    def waiter(k: int) -> None:
        for _ in range(rounds):
            seen = session.bell_value(Bell.TO_LEADER)
            start.wait()
            while session.bell_value(Bell.TO_LEADER) == seen:  # it may return early; it must not sleep through
                session.wait_bell(Bell.TO_LEADER, seen, 60.0)
            woken[k] += 1
            done.wait()

    threads = [threading.Thread(target=waiter, args=(k,)) for k in range(waiters)]
    for t in threads:
        t.start()
    for r in range(rounds):
        start.wait()
        ringers = [
            threading.Thread(target=session.ring, args=(Bell.TO_LEADER, w))
            for w in ((Writer.DRIVER, Writer.SCHEDULER.at(1)) if r % 2 else (Writer.SCHEDULER.at(1), Writer.DRIVER))
        ]
        for t in ringers:
            t.start()
        for t in ringers:
            t.join()
        done.wait()  # BrokenBarrierError after 30 s if a waiter slept through the rings
    for t in threads:
        t.join()
    assert woken == [rounds] * waiters


@pytest.mark.timeout(60)  # a wait that ignores its cap hangs: the timeout fails it
def test_wait_returns_on_the_cap_without_a_ring(session):
    start = time.monotonic()
    session.wait_bell(Bell.PLAN, session.bell_value(Bell.PLAN), 0.05)
    assert time.monotonic() - start >= 0.04, "returned before its cap with no ring"


def test_slot_is_reused_only_after_both_sides_released_and_the_driver_read_it(session):
    assert session.slot_free(0)
    session.open_slot(0, key=7, prompt_lens=(5, 3))
    assert not session.slot_free(0) and session.control[0, Slot.PHASE] == Phase.SUBMITTED
    with pytest.raises(Exception, match="still in use"):
        session.open_slot(0, key=8, prompt_lens=(1, 1))
    session.release(0, 7, 0)
    session.release(0, 7, 1)
    assert not session.slot_free(0)  # the driver has not read it yet
    session.close_slot(0)
    assert session.slot_free(0)
    session.open_slot(0, key=8, prompt_lens=(1, 1))
    session.release(0, 7, 1)  # a late release of the previous occupant
    assert int(session.control[0, slot_word(ModelSlot.RELEASED, 1)]) == 0, "a stale release marked the next occupant"


def test_errors_are_one_store_first_wins_and_name_the_step(session):
    session.open_slot(1, key=3, prompt_lens=(1, 1))
    session.fail_slot(1, 3, ErrorCode.BAD_LOGITS, 5, Writer.PROCESSOR.at(1))
    session.fail_slot(1, 3, ErrorCode.SYNC_TIMEOUT, 9, Writer.PROCESSOR.at(0))
    assert session.error(1) == (ErrorCode.BAD_LOGITS, 5)
    session.fail_slot(1, 4, ErrorCode.DIVERGED, 0, Writer.DRIVER)  # not its key: ignored
    assert session.error(1) == (ErrorCode.BAD_LOGITS, 5)


def test_abort_requests_are_key_tagged(session):
    session.open_slot(2, key=11, prompt_lens=(1, 1))
    session.request_abort(2, 10, Writer.DRIVER)
    assert not session.abort_requested(2, 11)
    session.request_abort(2, 11, Writer.DRIVER)
    assert session.abort_requested(2, 11)


def test_plans_are_read_only_once_published_and_never_torn(session):
    assert session.read_plan(0) is None
    session.publish_plan(0, [5, 6])
    assert session.read_plan(0) == [5, 6] and session.read_plan(1) is None
    session.publish_plan(1, [])
    assert session.read_plan(1) == [] and int(session.header[Header.PLANS_PUBLISHED]) == 2
    with pytest.raises(Exception, match="more than max_num_seqs=2"):
        session.publish_plan(2, [1, 2, 3])


def test_stale_sessions_and_their_engine_files_are_removed(tmp_path):
    dead = 999_999_99
    (tmp_path / f"dual-sampling-{dead}-abc123").write_bytes(b"x")
    (tmp_path / "psm_left_by_engine").write_bytes(b"x")
    (tmp_path / "psm_someone_elses").write_bytes(b"x")
    segments_listing(f"dual-sampling-{dead}-abc123", tmp_path).write_text('["psm_left_by_engine"]')
    live = tmp_path / f"dual-sampling-{os.getpid()}-def456"
    live.write_bytes(b"x")
    removed = cleanup_stale_sessions(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, "psm_someone_elses"])
    assert "psm_left_by_engine" in removed


def test_scratch_folders_of_a_dead_process_are_removed_and_a_live_ones_kept(tmp_path):
    from dual_sampling.lockstep import listing_dir
    from dual_sampling.lockstep.janitor import OWNER_FILE, owner_tag, scratch_dir

    private = listing_dir(tmp_path)
    mine = [scratch_dir(kind, tmp_path) for kind in ("weights", "ipc")]  # this process's: alive
    for folder in mine:
        (folder / "model.safetensors").write_bytes(b"x")
    dead = [private / "weights-99999997-abc123", private / "ipc-99999997-abc124"]
    for folder in dead:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(b"x")
    (private / "weights-99999996-def456").symlink_to(elsewhere)  # a symlink is never followed
    (private / "other-99999997-abc125").mkdir()  # not a kind of ours
    # Tagged as scratch_dir tags them (an owner file: boot, PID namespace, start time): another container's folder
    # whose pid is free here is left alone; one of an earlier boot, or of a process whose pid was taken again, is stale.
    boot, namespace, start = owner_tag()
    tags = {
        "foreign": (DEAD_PID, boot, namespace + 1, start),
        "earlier_boot": (os.getpid(), boot + 1, namespace, start),
        "pid_reused": (os.getpid(), boot, namespace, start + 1),
    }
    tagged = {}
    for i, (what, (pid, *tag)) in enumerate(tags.items()):
        tagged[what] = private / f"weights-{pid}-abc12{i}f"
        tagged[what].mkdir()
        (tagged[what] / OWNER_FILE).write_text(" ".join(map(str, tag)))
    being_made = private / f"ipc-{DEAD_PID}-abc130.new"  # no owner file yet: left alone while young
    being_made.mkdir()
    assert all((folder / OWNER_FILE).read_text().split() == [str(w) for w in owner_tag()] for folder in mine)
    removed = cleanup_stale_sessions(tmp_path)
    stale = [tagged["earlier_boot"].name, tagged["pid_reused"].name]
    assert sorted(removed) == sorted(["ipc-99999997-abc124", "weights-99999997-abc123", *stale])
    assert being_made.exists()
    assert tagged["foreign"].exists()
    assert not any(folder.exists() for folder in dead) and (elsewhere / "keep").exists()
    assert all((folder / "model.safetensors").exists() for folder in mine)
    assert (private / "other-99999997-abc125").exists()
    with pytest.raises(ValueError, match="kind must be one of"):
        scratch_dir("../x", tmp_path)


def test_a_pairs_socket_folder_leaves_room_for_vllms_socket_names():
    """vLLM binds each ZMQ socket at <VLLM_RPC_BASE_PATH>/<uuid4>, and a Unix socket path may not pass
    zmq.IPC_PATH_MAX_LEN (107) characters: the ipc scratch folder must leave room for 1 + 36 more, in /dev/shm, in the
    plain listing directory and in a random-named one (a taken plain name), for a pid and uid of 7 digits."""
    import zmq

    from dual_sampling.lockstep.janitor import scratch_dir
    from dual_sampling.lockstep.layout import SHM_DIR

    folder = scratch_dir("ipc")
    try:
        longest = len(str(folder)) + (7 - len(str(os.getpid()))) + (7 - len(str(os.getuid())))
        longest += len(".abcdef012345")  # the random-named listing directory
        assert str(folder).startswith(str(SHM_DIR)) and longest + 1 + 36 <= zmq.IPC_PATH_MAX_LEN, (folder, longest)
    finally:
        shutil.rmtree(folder)


def test_a_listed_file_still_mapped_stays_listed_until_it_is_free(tmp_path):
    """An engine of a dead driver may still be exiting: its files survive one cleanup and go with the next."""
    import mmap

    dead, name = 999_999_98, f"psm_dstest_{os.getpid()}"
    shm = Path("/dev/shm") / name  # mapped_shm_files reads /proc/<pid>/maps, so the mapping must be real
    shm.write_bytes(b"\0" * 4096)
    (tmp_path / name).write_bytes(b"x")
    listing = segments_listing(f"dual-sampling-{dead}-abc123", tmp_path)
    listing.write_text(json.dumps([name, "psm_gone_already"]))
    try:
        with shm.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
            assert cleanup_stale_sessions(tmp_path) == []
            assert (tmp_path / name).exists() and json.loads(listing.read_text()) == [name]
        assert cleanup_stale_sessions(tmp_path) == [name, listing.name]
        assert not (tmp_path / name).exists() and not listing.exists()
    finally:
        shm.unlink(missing_ok=True)


def test_split_binding_halves_the_cpus(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 0, 2})
    assert split_cpu_binding() == {"teacher": "0,2", "theta": "4"}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})
    assert split_cpu_binding() == {}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert split_cpu_binding() == {}, "the user's own binding must win"


def test_engine_cpus_sets_and_restores_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")
    with engine_cpus("1"):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "7"
    with engine_cpus(None):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "7"


def test_bad_engine_options_are_named(tiny_same):
    with pytest.raises(ValueError, match="cpu_binding must be 'split' or 'vllm', got 'both'"):
        DualEngineConfig(*tiny_same, cpu_binding="both")
    with pytest.raises(ValueError, match="sync_timeout must be a positive number"):
        DualEngineConfig(*tiny_same, sync_timeout=0)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        DualEngineConfig(*tiny_same, max_num_seqs=0)


class _FakeEngine:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config


def _verify(tiny_same, change) -> str:
    """EnginePair.verify on two real vLLM configs (no engine), after ``change(role, config)``."""
    from vllm.config.weight_transfer import WeightTransferConfig

    from dual_sampling.testing.sim_engines import sim_configs

    configs = sim_configs(4, 96, 96, 10.0)
    for role, cfg in configs.items():
        cfg.scheduler_config.scheduler_cls = (
            "processors.scheduler.LeaderScheduler" if role == "teacher" else "processors.scheduler.FollowerScheduler"
        )
        cfg.parallel_config.worker_extension_cls = "processors.worker_extension.DualSamplingWorkerExtension"
        cfg.weight_transfer_config = WeightTransferConfig(backend="dual_sampling_shm")
        cfg.cache_config.block_size = 16
        cfg.cache_config.num_gpu_blocks = 4 * 6 + 1  # 4 seats of 96 tokens in blocks of 16, and the null block
        change(role, cfg)
    pair = EnginePair.__new__(EnginePair)
    pair.config = DualEngineConfig(*tiny_same)
    pair.engines = {role: _FakeEngine(cfg) for role, cfg in configs.items()}
    try:
        pair.verify()
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r, c: None, ""),
        (lambda r, c: setattr(c.scheduler_config, "max_num_seqs", 8) if r == "theta" else None, "max_num_seqs differs"),
        (
            lambda r, c: setattr(c.scheduler_config, "async_scheduling", True) if r == "teacher" else None,
            "teacher: async_scheduling is on",
        ),
        (
            lambda r, c: setattr(c.scheduler_config, "enable_chunked_prefill", True) if r == "theta" else None,
            "theta: chunked prefill is on",
        ),
        (lambda r, c: setattr(c.scheduler_config, "max_num_batched_tokens", 64), "max_num_batched_tokens=64 is below"),
        (
            lambda r, c: setattr(c.parallel_config, "tensor_parallel_size", 2) if r == "teacher" else None,
            "teacher: tensor_parallel_size=2",
        ),
        (
            lambda r, c: setattr(c.cache_config, "num_gpu_blocks", 24) if r == "theta" else None,
            "theta: the KV cache has 24 blocks of 16 tokens, fewer than the 25",
        ),
        (
            lambda r, c: setattr(c.scheduler_config, "scheduler_cls", None) if r == "theta" else None,
            "theta: scheduler_cls is Scheduler, not FollowerScheduler",
        ),
        (
            lambda r, c: setattr(c.model_config, "max_model_len", 80) if r == "theta" else None,
            "max_model_len differs between the engines ({'teacher': 96, 'theta': 80})",
        ),
        (
            lambda r, c: setattr(c.parallel_config, "pipeline_parallel_size", 2) if r == "theta" else None,
            "theta: pipeline_parallel_size=2",
        ),
        (
            lambda r, c: setattr(c.parallel_config, "data_parallel_size", 2) if r == "teacher" else None,
            "teacher: data_parallel_size=2",
        ),
        (
            lambda r, c: setattr(c, "speculative_config", object()) if r == "theta" else None,
            "theta: speculative decoding is on",
        ),
        (
            # a property of vLLM's config (from the platform and the environment): this config's class answers True
            lambda r, c: (
                setattr(c, "__class__", type("V2", (type(c),), {"use_v2_model_runner": True}))
                if r == "teacher"
                else None
            ),
            "teacher: Model Runner V2 is on",
        ),
        (
            lambda r, c: setattr(c.scheduler_config, "policy", "priority") if r == "theta" else None,
            "theta: scheduling_policy is priority, not fcfs",
        ),
        (
            lambda r, c: setattr(c.parallel_config, "worker_extension_cls", "") if r == "theta" else None,
            "theta: worker_extension_cls is '', not 'processors.worker_extension.DualSamplingWorkerExtension'",
        ),
        (
            lambda r, c: setattr(c, "weight_transfer_config", None) if r == "teacher" else None,
            "teacher: weight_transfer_config's backend is None, not 'dual_sampling_shm'",
        ),
    ],
)
def test_settings_that_break_lockstep_are_refused_by_name(tiny_same, change, message):
    got = _verify(tiny_same, change)
    assert (message in got) if message else got == "", got


def test_hosts_without_x86_store_ordering_are_refused(monkeypatch):
    from dual_sampling.lockstep import SyncError

    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    with pytest.raises(SyncError, match="Linux x86-64 only .*aarch64"):
        SyncSession.create(SessionLayout(vocab=8, slots=1, max_steps=2, plan_width=1))


# ---------------------------------------------------------------------- shared-memory and process hygiene

DEAD_PID = 999_999_97  # above any pid_max: never a live process


def test_listed_names_outside_the_directory_or_of_unknown_kinds_are_never_removed(tmp_path, caplog):
    shm = tmp_path / "shm"
    shm.mkdir()
    outside, target = tmp_path / "outside", tmp_path / "target"
    for path in (outside, target, shm / "notes.txt", shm / "psm_ours"):
        path.write_bytes(b"x")
    (shm / "sub").mkdir()
    (shm / "sub" / "psm_x").write_bytes(b"x")
    (shm / "psm_link").symlink_to(target)
    listing = segments_listing(f"dual-sampling-{DEAD_PID}-abc123", shm)
    names = ["../outside", str(outside), "sub/psm_x", "..", "notes.txt", "psm_link", "psm_ours", "psm_\0x", 7]
    listing.write_text(json.dumps(names))
    assert cleanup_stale_sessions(shm) == ["psm_ours", listing.name]
    assert outside.exists() and target.exists() and (shm / "sub" / "psm_x").exists() and (shm / "notes.txt").exists()
    assert (shm / "psm_link").is_symlink(), "a listed symlink was removed (or followed)"
    assert "'../outside', not a shared-memory segment name" in caplog.text and "not a regular file" in caplog.text


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's files needs root")
def test_another_users_leftovers_are_left_alone_with_a_warning(tmp_path, caplog):
    """Old-style listings lay in /dev/shm itself, where any user can leave one: only our own are acted on."""
    other = 4242
    theirs = [
        tmp_path / f"dual-sampling-{DEAD_PID}-abc123",
        tmp_path / f"dual-sampling-{DEAD_PID}-abc123.segments",
        tmp_path / "psm_theirs",
        tmp_path / "psm_theirs_in_our_listing",
    ]
    theirs[1].write_text('["psm_theirs"]')
    for path in theirs:
        path.touch()
        os.chown(path, other, other)
    (tmp_path / "psm_ours").write_bytes(b"x")
    segments_listing(f"dual-sampling-{DEAD_PID}-def456", tmp_path).write_text(
        '["psm_theirs_in_our_listing", "psm_ours"]'
    )
    assert cleanup_stale_sessions(tmp_path) == ["psm_ours", f"dual-sampling-{DEAD_PID}-def456.segments"]
    assert all(path.exists() for path in theirs)
    assert f"is left to its owner, uid {other}" in caplog.text


def test_listings_are_kept_in_a_private_directory_that_no_one_can_take_first(tmp_path, caplog):
    """/dev/shm is everyone's: another user who made dual-sampling.<uid> first (or a symlink by that name, or a folder
    open to others) blocked every session and state-dict update of this user until reboot. Now such a name is left
    alone, never read, and a private folder with a random name serves instead."""
    from dual_sampling.lockstep import listing_dir
    from dual_sampling.lockstep.janitor import scratch_dir

    name = f"dual-sampling-{DEAD_PID}-abc123"
    private = segments_listing(name, tmp_path).parent
    st = os.lstat(private)
    assert private == tmp_path / f"dual-sampling.{os.getuid()}"
    assert S_ISDIR(st.st_mode) and S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    private.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / f"{name}.segments").write_text('["psm_planted"]')
    (tmp_path / "psm_planted").write_bytes(b"x")
    others = 65534  # nobody: the folder another user made first
    takes = [lambda: private.symlink_to(elsewhere), lambda: (private.mkdir(), private.chmod(0o777))]
    if os.getuid() == 0:  # making another user's folder needs root
        takes.append(lambda: (private.mkdir(mode=0o700), os.chown(private, others, others)))
    for take in takes:
        take()
        caplog.clear()
        used = listing_dir(tmp_path)
        assert used != private and used.name.startswith(private.name + ".") and used.parent == tmp_path
        st = os.lstat(used)
        assert S_ISDIR(st.st_mode) and S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert "is left alone" in caplog.text
        assert segments_listing(name, tmp_path).parent == used and scratch_dir("weights", tmp_path).parent == used
        with SyncSession.create(SessionLayout(vocab=8, slots=1, max_steps=2, plan_width=1), tmp_path):
            pass
        # Nothing behind the taken name is acted on: its planted listing stays, and so does the file it names.
        cleanup_stale_sessions(tmp_path)
        assert (tmp_path / "psm_planted").exists() and (elsewhere / f"{name}.segments").exists()
        assert os.path.lexists(private), "the taken name was removed"
        shutil.rmtree(used)
        private.unlink() if private.is_symlink() else private.rmdir()


def test_a_session_reserves_its_space_and_a_full_shm_dir_is_refused_naming_the_sizes(tmp_path, monkeypatch):
    layout = SessionLayout(vocab=8, slots=3, max_steps=4, plan_width=2)
    size = layout.offsets["total"]
    with SyncSession.create(layout) as session:
        assert os.stat(session.path).st_blocks * 512 >= size, "the session file is sparse: a full /dev/shm is a SIGBUS"

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SyncError, match=rf"^{re.escape(str(tmp_path))} has \d+ bytes .* less than the {size} bytes \("):
        SyncSession.create(layout, tmp_path)
    assert not list(tmp_path.glob(SESSION_PREFIX + "*")), "a failed create left its file behind"


def test_a_session_larger_than_a_real_tmpfs_is_refused_before_it_starts(tmp_path):
    """Docker's /dev/shm is a 64 MiB tmpfs; this one holds 1 MiB."""
    mount = tmp_path / "shm"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        layout = SessionLayout(vocab=4096, slots=80, max_steps=16, plan_width=4)  # 1.25 MiB of rows
        with pytest.raises(SyncError, match=rf"less than the {layout.offsets['total']} bytes \(1\.\d MiB\)"):
            SyncSession.create(layout, mount)
        assert not list(mount.glob(SESSION_PREFIX + "*"))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _own_start_time() -> int:
    return int(Path("/proc/self/stat").read_bytes().rsplit(b")", 1)[1].split()[19])


def test_stale_sessions_are_judged_by_their_drivers_namespace_boot_and_start_time(tmp_path, caplog):
    """Containers sharing /dev/shm see each other's sessions, but not each other's processes."""
    with SyncSession.create(SessionLayout(vocab=8, slots=1, max_steps=2, plan_width=1), tmp_path) as session:
        header = np.array(session.header)
    assert int(header[Header.OWNER_PID_NS]) == os.stat("/proc/self/ns/pid").st_ino
    assert int(header[Header.OWNER_START]) == _own_start_time()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
    assert int(header[Header.OWNER_BOOT]) == int(boot[:15], 16)

    def session(token: str, pid: int, **changes: int) -> str:
        words = header.copy()
        words[Header.OWNER_PID] = pid
        for word, value in changes.items():
            words[Header[word]] = value
        name = f"dual-sampling-{pid}-{token}"
        (tmp_path / name).write_bytes(words.tobytes())
        (tmp_path / f"psm_{token}").write_bytes(b"x")
        segments_listing(name, tmp_path).write_text(json.dumps([f"psm_{token}"]))
        return name

    own_ns, start = int(header[Header.OWNER_PID_NS]), int(header[Header.OWNER_START])
    foreign = session("aa", DEAD_PID, OWNER_PID_NS=own_ns + 1)
    dead = session("bb", DEAD_PID)
    reused = session("cc", os.getpid(), OWNER_START=start + 1)
    live = session("dd", os.getpid())
    older_boot = session("ee", os.getpid(), OWNER_BOOT=int(header[Header.OWNER_BOOT]) + 1)
    removed = set(cleanup_stale_sessions(tmp_path))
    gone = {dead, reused, older_boot}
    assert removed == gone | {f"{n}.segments" for n in gone} | {f"psm_{n[-2:]}" for n in gone}
    assert (tmp_path / foreign).exists() and (tmp_path / "psm_aa").exists() and (tmp_path / live).exists()
    assert "its maker ran in another PID namespace" in caplog.text


def test_statistics_and_aborts_are_safe_while_and_after_the_session_closes():
    """/metrics and abort() run on other threads than close(): they must not read unmapped arrays."""
    session = SyncSession.create(SessionLayout(vocab=8, slots=2, max_steps=4, plan_width=2))
    session.open_slot(0, key=5, prompt_lens=(1, 1))
    session.add_model_stat(0, ModelWord.ROWS, 3)
    errors: list[BaseException] = []
    stop = threading.Event()

    polls = [0, 0]

    def poll(k: int) -> None:
        while not stop.is_set():
            try:
                assert session.statistics()["teacher_rows"] == 3
                session.request_abort(0, 5, Writer.DRIVER)
            except BaseException as exc:
                errors.append(exc)
                return
            polls[k] += 1

    def until_each_polled(more: int) -> None:  # by the pollers' progress, not by a sleep
        start, deadline = list(polls), time.monotonic() + 60
        while any(p < s + more for p, s in zip(polls, start)) and not errors:
            assert time.monotonic() < deadline, polls
            time.sleep(0.001)

    threads = [threading.Thread(target=poll, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    try:
        until_each_polled(100)
        session.close()
        until_each_polled(100)  # every poller ran 100 times more after the close
    finally:
        stop.set()
    for t in threads:
        t.join()
    assert errors == []
    expected = {name: 0 for name in session.statistics()}
    assert session.statistics() == {**expected, "teacher_rows": 3}


def test_reap_ends_an_engine_process_that_vllm_lost_track_of_without_waiting_out_its_deadline():
    """An idle EngineCore whose fork server a cluster manager killed: vLLM's shutdown thinks it gone, so nothing told
    it to stop. reap stops it with SIGTERM at once, as vLLM would have, not after its deadline with SIGKILL."""
    proc = subprocess.Popen(["sleep", "60"])
    started = time.monotonic()
    reap([proc.pid], 30)
    assert proc.wait(5) == -signal.SIGTERM and time.monotonic() - started < 15


def test_reap_kills_an_engine_process_that_does_not_exit():
    proc = subprocess.Popen(["bash", "-c", "trap '' TERM; exec sleep 60"])  # ignores SIGTERM, as a hung process may
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
        time.sleep(0.01)  # the trap is set once bash has exec'd sleep
    reap([proc.pid], 0.1)
    assert proc.wait(5) == -signal.SIGKILL


def test_reap_never_kills_a_pid_that_now_names_another_process(monkeypatch):
    proc = subprocess.Popen(["sleep", "60"])
    real, looks = engine_processes.process_start_time, collections.Counter()

    def reused(pid: int) -> int | None:  # after the first look, the pid names a later process
        start, looks[pid] = real(pid), looks[pid] + 1
        return start + 1 if start is not None and looks[pid] > 1 else start

    monkeypatch.setattr(engine_processes, "process_start_time", reused)
    try:
        reap([proc.pid], 0.1)
        assert proc.poll() is None, "a process that merely reused an engine's pid was killed"
    finally:
        proc.kill()
        proc.wait()


def test_lockstep_config_round_trips_through_vllm_and_refuses_by_name():
    from types import SimpleNamespace

    from dual_sampling.lockstep import LockstepConfig

    config = LockstepConfig("theta", "dual-sampling-x", 30, "fixed", {"alpha": 0.3}, (2, 3))
    assert config.role == "theta" and config.sync_timeout == 30.0 and isinstance(config.sync_timeout, float)
    assert config.roster == ("teacher", "theta") and config.position == 1 and not config.leads
    engine = SimpleNamespace(additional_config=config.to_engine())
    assert json.loads(json.dumps(engine.additional_config)) == engine.additional_config  # plain JSON for vLLM
    assert LockstepConfig.from_vllm(engine, False, "P") == config
    with pytest.raises(ValueError, match=r"P is a leader's plugin but the engine's model 'theta' follows"):
        LockstepConfig.from_vllm(engine, True, "P")
    with pytest.raises(ValueError, match=r"needs LLM\(\.\.\., additional_config="):
        LockstepConfig.from_vllm(SimpleNamespace(additional_config=None), False, "P")
    engine.additional_config["dual_sampling"]["spare"] = 1
    with pytest.raises(ValueError, match=r"unknown keys \['spare'\]"):
        LockstepConfig.from_vllm(engine, False, "P")
    with pytest.raises(ValueError, match="incomplete"):
        LockstepConfig.from_vllm(SimpleNamespace(additional_config={"dual_sampling": {"role": "theta"}}), False, "P")
    assert LockstepConfig("theta", "s", 1.0, roster=("theta", "teacher", "coach")).leads  # several teachers' runs
    three = LockstepConfig("coach", "s", 1.0, roster=("teacher", "theta", "coach"))
    assert (
        three.position == 2
        and LockstepConfig.from_vllm(SimpleNamespace(additional_config=three.to_engine()), False, "P") == three
    )
    for field, value, name in (
        ("sync_timeout", 0, "sync_timeout"),
        ("role", "student", "role"),
        ("roster", ("teacher", "coach"), "roster"),
        ("roster", ("theta", "teacher"), "roster"),  # a pair: its one teacher leads
        ("mix_helper_cpus", (-1,), "mix_helper_cpus"),
    ):
        with pytest.raises(ValueError, match=f"^{name} must"):
            LockstepConfig(**{"role": "theta", "session": "s", "sync_timeout": 1.0, field: value})
