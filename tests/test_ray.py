"""Data-generation runs on a local Ray cluster (started inside the test, sized to this machine).

The command line with ``--ray`` must draw the samples of a single-machine run (the same keys
and seeds, records that match re-scoring), keep every (id, sample_index) exactly once when a
replica is SIGKILLed or the driver is killed and resumed, and leave no process or /dev/shm
file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

import dual_sampling.datagen.ray_stage
from dual_sampling.api import derive_seed
from dual_sampling.datagen.ray_stage import DualSamplingStage
from dual_sampling.datagen.run import run_generation
from dual_sampling.datagen.sinks import read_records
from dual_sampling.lockstep import (
    SESSION_PREFIX,
    SyncError,
    SyncSession,
    cleanup_stale_sessions,
    listing_dir,
    session_owners,
)
from tests import processes
from tests.budget import SLOW_MACHINE
from tests.oracles import assert_written_records_match_rescoring
from tests.ray_stand_ins import DyingStage, ScriptedStage
from tests.test_datagen import ScriptedSampler, all_pairs, cli_flags, problems, tiny_config

pytestmark = pytest.mark.engine
ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parent.parent


def ray_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_DEDUP_LOGS"] = "0"
    return env


def settle(before: tuple[set[int], set[str]], files_too: bool = True) -> tuple[set[str], set[str]]:
    """This session's new processes (Ray's included) and shared-memory files, once gone or at SETTLE_S."""
    return processes.settled(before, files_too=files_too)


def drawing_a_batch(pid: int) -> bool:
    """Whether the replica ``pid`` is drawing a batch now: a slot of its session holds a request (a read-only look)."""
    for path in Path("/dev/shm").glob(f"{SESSION_PREFIX}{pid}-*"):
        with contextlib.suppress(OSError, SyncError, ValueError):
            session = SyncSession.attach(path.name)
            try:
                return bool(session.held_slots())
            finally:
                session.close()
    return False


def records_by_key(path: Path) -> dict:
    rows = read_records(str(path))
    counts = Counter((r["id"], r["sample_index"]) for r in rows)
    assert max(counts.values()) == 1, "a sample was written twice"
    return {(r["id"], r["sample_index"]): r for r in rows}


def find_replicas(driver: int) -> list[psutil.Process]:
    """The processes under ``driver`` that drive a dual engine: each has a lockstep session in /dev/shm named by its
    pid (whatever Ray titles them, and however their engines started)."""
    drivers = session_owners()
    try:
        below = psutil.Process(driver).children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in below if p.pid in drivers]


@pytest.mark.budget(
    240,
    reason=(
        "two Ray replicas each start a pair (two pairs on two cores) and draw 24 batches, one is killed and its "
        "batch drawn again: 119 s on an idle CI run"
    ),
)
def test_two_replicas_with_one_killed_give_the_local_samples_exactly_once(dual_engine, hf_models, tiny_same, tmp_path):
    src = problems(tmp_path / "in.jsonl", 48)  # 24 batches: a replica up alone must not finish them between two looks
    local = tmp_path / "local.jsonl"
    run_generation(
        tiny_config(tiny_same, tmp_path, input=str(src), output=str(local), max_tokens=16), sampler=dual_engine
    )
    before = processes.snapshot()
    out = tmp_path / "ray-run"  # a directory of Parquet parts
    flags = cli_flags(tiny_same, input=src, output=out, n=2, max_tokens=16, seed=7, batch_size=2)
    cmd = [
        sys.executable,
        "-m",
        "dual_sampling.cli",
        "generate",
        *flags,
        "--ray",
        "--replicas",
        "2",
        "--cpus-per-replica",
        "1",
    ]
    proc = subprocess.Popen(
        cmd, env=ray_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    killed = None
    seen = {"polls": 0, "replicas": 0, "with_listing": 0, "parts": 0}  # what the loop saw, for a failure's message
    # 119 s idle for the whole run, so SLOW_MACHINE times that; past it the run is stopped (its Ray cluster too) and
    # the test fails by name, before pytest-timeout's 900 s would cut it off with the cluster still running.
    deadline = time.monotonic() + SLOW_MACHINE * 150
    while proc.poll() is None and time.monotonic() < deadline:
        replicas = find_replicas(proc.pid)
        # Mid-run: some parts are written, others not yet. Replicas come up at different times (one may do
        # several batches alone), so the one killed is the first seen whose engines are up (it has listed
        # their segments). A replica killed while its engines start is not covered: see docs/scale-out.md.
        running = [p for p in replicas if list(listing_dir().glob(f"{SESSION_PREFIX}{p.pid}-*.segments"))]
        parts = len(list(out.glob("part-*.parquet"))) if out.exists() else 0
        seen = {
            "polls": seen["polls"] + 1,
            "replicas": max(seen["replicas"], len(replicas)),
            "with_listing": max(seen["with_listing"], len(running)),
            "parts": max(seen["parts"], parts),
        }
        # Killed while it holds a batch (a slot of its session holds a request), so that batch must be drawn again; a
        # replica killed between two batches holds none, and nothing would be retried. A held slot says its engines
        # are up by itself: the listing is not asked for (one CI run never saw a listing and a part at one look).
        # Once parts exist, the known replicas' slots are looked at every 5 ms for half a second: a walk of Ray's
        # process tree takes tens of ms, and a fast idle CI run drew each batch between two such walks (1,090 looks
        # in 101 s, none inside a held slot).
        watch_until = time.monotonic() + 0.5 if killed is None and parts else 0.0
        while time.monotonic() < watch_until and proc.poll() is None:
            drawing = [p for p in replicas if drawing_a_batch(p.pid)]
            if drawing:
                killed = drawing[0].pid
                os.kill(killed, signal.SIGKILL)
                break
            time.sleep(0.005)
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        raise AssertionError(
            f"the Ray run did not end in {SLOW_MACHINE * 150:.0f} s; the loop saw {seen}: {stderr[-3000:]}"
        )
    _, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    assert killed is not None, f"the run ended before a replica could be killed; the loop saw {seen}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_written"] == 96 and summary["failed_samples"] == 0
    # The killed replica's batch was started again (and no sample is missing or failed).
    assert summary["sync"]["batches_retried"] >= 1 and summary["sync"]["follower_diverged"] == 0
    written = records_by_key(out)
    assert summary["generated_tokens"] == sum(r["num_tokens"] for r in written.values())
    local_records = records_by_key(local)
    assert local_records.keys() == written.keys()
    assert all(local_records[key]["seed"] == r["seed"] for key, r in written.items())
    # Not the local run's tokens: Ray's batches differ from the local run's, and vLLM's CPU kernels may round
    # differently there (docs/reliability.md). Each record must be right for its own tokens: one in eight, re-scored.
    some = [written[key] for key in sorted(written)[::8]]
    assert assert_written_records_match_rescoring(some, dual_engine.tokenizer, *hf_models, dual_engine.vocab) > 0
    assert settle(before) == (set(), set())


@pytest.mark.budget(
    120,
    reason=(
        "a Ray cluster and a replica with a pair of its own, killed mid-run, then the wait for the killed cluster's "
        "processes to end: 45 s alone, 70 s in a full run"
    ),
)
def test_driver_killed_then_resumed_is_exactly_once(dual_engine, tiny_same, tmp_path):
    src = problems(tmp_path / "in.jsonl", 12)
    out = tmp_path / "run.jsonl"
    flags = cli_flags(tiny_same, input=src, output=out, n=2, max_tokens=16, seed=7, batch_size=2)
    cmd = [sys.executable, "-m", "dual_sampling.cli", "generate", *flags, "--ray", "--replicas", "1"]
    before = processes.snapshot()
    proc = subprocess.Popen(
        cmd, env=ray_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    # 119 s idle for the whole run, so SLOW_MACHINE times that; past it the run is stopped (its Ray cluster too) and
    # the test fails by name, before pytest-timeout's 900 s would cut it off with the cluster still running.
    deadline = time.monotonic() + SLOW_MACHINE * 150
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_text().count("\n") >= 4:
            break
        time.sleep(0.3)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the cluster it started
    proc.wait()
    written = out.read_text().count("\n")
    assert 4 <= written < 24
    # Resumed without Ray, here by the session's engine (the command line's --resume: tests/test_datagen.py): the Ray
    # settings are not part of the run's configuration, so any replica count resumes it.
    resume = tiny_config(
        tiny_same, tmp_path, input=str(src), output=str(out), n=2, max_tokens=16, seed=7, batch_size=2, resume=True
    )
    run_generation(resume, sampler=dual_engine)
    keys = records_by_key(out)
    assert keys.keys() == {(f"p{i}", j) for i in range(12) for j in range(2)}
    summary = json.loads((tmp_path / "run.jsonl.summary.json").read_text())
    assert summary["samples_already_done"] == written and summary["samples_written"] == 24 - written
    # The killed cluster's raylet and workers were in the killed group: they end on their own. Their sessions' files
    # go with the next session's cleanup (docs/reliability.md): nothing may be left that such a cleanup would not
    # remove once they are gone.
    left, _ = settle(before, files_too=False)
    assert left == set(), left
    cleanup_stale_sessions()
    assert settle(before)[1] == set()


def test_bad_input_and_an_unreachable_cluster_are_named(tiny_same, tmp_path):
    src = problems(tmp_path / "in.jsonl", 3)
    lines = src.read_text().splitlines()
    base = [sys.executable, "-m", "dual_sampling.cli", "generate", "--ray"]
    (tmp_path / "missing.jsonl").write_text(lines[0] + "\n" + json.dumps({"id": "x", "question": "?"}) + "\n")
    (tmp_path / "dup.jsonl").write_text(lines[0] + "\n" + lines[0] + "\n")
    before = processes.snapshot()
    cases = [
        ("missing.jsonl", ray_env(), "row 1 has no field 'problem'"),
        ("dup.jsonl", ray_env(), "share the id 'p0'"),
        (
            "in.jsonl",
            {**ray_env(), "RAY_ADDRESS": "127.0.0.1:1"},
            "cannot reach the Ray cluster at RAY_ADDRESS='127.0.0.1:1'",
        ),
    ]
    for name, env, message in cases:
        flags = cli_flags(tiny_same, input=tmp_path / name, output=tmp_path / f"out-{name}", n=1, max_tokens=4)
        done = subprocess.run([*base, *flags], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert settle(before) == (set(), set())


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster for the tests that run Ray inside this process (the last of the module, after every
    command-line run, which starts its own): its workers find this repository and, as $CRASH_LOG, the file where
    :class:`tests.ray_stand_ins.DyingSampler` logs its deaths."""
    crash_log = tmp_path_factory.mktemp("ray") / "crashes.log"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"CRASH_LOG": str(crash_log), "PYTHONPATH": str(ROOT)}},
    )
    try:
        yield crash_log
    finally:
        ray.shutdown()


def run_users_pipeline(tiny_same, tmp_path: Path, rows: list[dict], **settings) -> list[dict]:
    """``map_batches(DualSamplingStage, ...)`` on raw ``rows`` with the run ``settings`` (over the tiny pair's), one
    replica, batches of 3, written by Ray as Parquet; the rows it wrote."""
    import pyarrow.parquet as pq

    teacher, theta = tiny_same
    base = {
        "teacher": str(teacher),
        "theta": str(theta),
        "hint_field": "solution",
        "id_field": "id",
        "max_num_seqs": 2,
        "max_model_len": 256,
        "sync_timeout": 30,
    }
    out = ray.data.from_items(rows).map_batches(
        DualSamplingStage,
        fn_constructor_kwargs={"settings": {**base, **settings}},
        concurrency=1,
        batch_size=3,
        num_cpus=1,
    )
    out.write_parquet(str(tmp_path / "runs"))
    return pq.read_table(tmp_path / "runs").to_pylist()


def times_three(count: int) -> list[dict]:
    return [{"id": f"q{i}", "problem": f"What is {i} times 3?", "solution": f"{3 * i}"} for i in range(count)]


def test_the_stage_in_a_users_own_pipeline(ray_cluster, tiny_same, tmp_path):
    """``map_batches(DualSamplingStage, ...)`` on raw rows, written by Ray: one record per sample, seeds as locally."""
    written = run_users_pipeline(tiny_same, tmp_path, times_three(6), n=2, max_tokens=8, seed=3)
    assert sorted((r["id"], r["sample_index"]) for r in written) == [(f"q{i}", j) for i in range(6) for j in range(2)]
    assert all(r["seed"] == derive_seed(3, r["id"], r["sample_index"]) for r in written)
    assert all(json.loads(r["sampling"])["n"] == 2 and len(r["alpha"]) == r["num_tokens"] for r in written)


def test_a_beam_search_in_a_users_own_pipeline_writes_each_problems_ranked_beams(
    ray_cluster, dual_engine, hf_models, tiny_same, tmp_path
):
    """The stage with ``use_beam_search``: per problem its n beams (sample j the (j+1)-th best), distinct and ranked
    by cum log q / length^length_penalty, each record right for its own tokens by re-scoring."""
    beams = dict(n=3, max_tokens=5, use_beam_search=True, length_penalty=0.5, max_num_seqs=4)
    written = run_users_pipeline(tiny_same, tmp_path, times_three(3), **beams)
    assert sorted((r["id"], r["sample_index"]) for r in written) == [(f"q{i}", j) for i in range(3) for j in range(3)]
    for i in range(3):
        ranked = sorted((r for r in written if r["id"] == f"q{i}"), key=lambda r: r["sample_index"])
        assert len({tuple(r["token_ids"]) for r in ranked}) == 3
        lengths = [max(r["num_tokens"] - (r["finish_reason"] == "stop"), 1) for r in ranked]  # a final EOS not counted
        scores = [r["sum_logq"] / length**0.5 for r, length in zip(ranked, lengths)]
        assert scores == sorted(scores, reverse=True)
        assert all(json.loads(r["sampling"])["use_beam_search"] for r in ranked)
    assert assert_written_records_match_rescoring(written, dual_engine.tokenizer, *hf_models, dual_engine.vocab) > 0


def test_a_batch_that_always_kills_its_replica_fails_after_ray_max_retries(
    ray_cluster, tiny_same, tmp_path, monkeypatch
):
    """No engines: the replicas draw scripted samples, and the one given p3 dies each time."""
    crash_log = ray_cluster
    crash_log.unlink(missing_ok=True)  # this test's deaths alone
    monkeypatch.setattr(dual_sampling.datagen.ray_stage, "DualSamplingStage", DyingStage)
    cfg = tiny_config(tiny_same, tmp_path, ray=True, replicas=1, cpus_per_replica=1, batch_size=1, ray_max_retries=2)
    summary = run_generation(cfg)
    assert crash_log.read_text().count("\n") == 3  # the first attempt and two retries
    failed = [json.loads(line) for line in (tmp_path / "out.failed.jsonl").read_text().splitlines()]
    assert {(f["id"], f["sample_index"]) for f in failed} == {("p3", 0), ("p3", 1)}
    for f in failed:
        assert f["error"] == "replica_crashed at each of 3 attempts (ray_max_retries=2)"
        assert f["seed"] == derive_seed(7, "p3", f["sample_index"])
    assert summary["failures"] == {"replica_crashed": 2} and summary["samples_written"] == 10
    assert summary["sync"]["batches_retried"] == 1  # p3's batch alone: each replica holds one batch of one problem
    assert {(r["id"], r["sample_index"]) for r in read_records(str(tmp_path / "out.jsonl"))} == all_pairs() - {
        ("p3", 0),
        ("p3", 1),
    }


def test_a_run_of_two_teachers_on_ray_writes_what_the_same_run_writes_here(
    ray_cluster, tiny_same, tmp_path, monkeypatch
):
    """No engines (tests/test_teachers_engine.py runs a trio's): a run of two teachers, each with its own hint field,
    planned here, drawn by a Ray replica (each model's prompt crossing as a struct column) and written in the
    roster's schema, holds the same records as the same run drawn on this machine."""
    from tests.test_datagen_teachers import teachers_config

    local = teachers_config(tiny_same, tmp_path, output=str(tmp_path / "here.jsonl"))
    run_generation(local, ScriptedSampler((local.source.teacher, local.source.theta)))
    monkeypatch.setattr(dual_sampling.datagen.ray_stage, "DualSamplingStage", ScriptedStage)
    on_ray = teachers_config(
        tiny_same, tmp_path, output=str(tmp_path / "ray.parquet"), ray=True, replicas=1, cpus_per_replica=1
    )
    summary = run_generation(on_ray)
    assert summary["samples_written"] == 12 and summary["alpha_mean_by_teacher"] == pytest.approx(
        {"math": 0.25, "general": 0.25}
    )
    here = {(r["id"], r["sample_index"]): r for r in read_records(str(tmp_path / "here.jsonl"))}
    there = {(r["id"], r["sample_index"]): r for r in read_records(str(tmp_path / "ray.parquet"))}
    assert here.keys() == all_pairs() and here == there
    assert all(r["math_prompt"] != r["general_prompt"] and r["alpha_math"] for r in there.values())
