"""Load and isolation: nothing lost, nothing hung, nothing shared by accident (faults: tests/test_faults.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from dual_sampling import OptimalSamplingDual
from tests import processes
from tests.oracles import assert_records_match_rescoring

pytestmark = pytest.mark.engine


def session_files() -> set[str]:
    """This test session's shared-memory files (another test session's are not counted: tests/processes.py)."""
    return processes.our_shm_files()


@pytest.fixture(scope="module")
def load_engine(tiny_same):
    teacher, theta = tiny_same
    with OptimalSamplingDual(
        teacher, theta, alpha_method="ess_balance", max_num_seqs=8, max_model_len=512, sync_timeout=30, use_tqdm=False
    ) as s:
        yield s


def test_load_300_requests_no_timeouts_flat_memory(load_engine):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    stats0 = load_engine.get_sync_statistics()
    procs = [psutil.Process()] + [psutil.Process(p) for pids in load_engine.engine_pids().values() for p in pids]
    procs += [c for p in procs[1:] for c in p.children(recursive=True)]
    files0 = session_files()

    def rss() -> int:
        return sum(p.memory_info().rss for p in procs)

    load_engine.generate(["warm up"], max_tokens=4)
    rss_start = rss()
    total = 0
    for call in range(10):
        prompts, teacher_prompts = [], []
        for i in range(10):
            short = " ".join(rng.choice(words) for _ in range(3))
            long = " ".join(rng.choice(words) for _ in range(30))
            theta_p, teacher_p = (short, long) if (call + i) % 2 else (long, short)
            prompts.append(theta_p)
            teacher_prompts.append(teacher_p)
        max_tokens = rng.randint(5, 60)
        out = load_engine.generate(
            prompts,
            teacher_prompts=teacher_prompts,
            n=3,
            seed=call,
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, min(4, max_tokens)),
            stop=[rng.choice(["th", "an", "er", "on"])],
            stop_token_ids=[rng.randrange(49152)],
        )
        for req in out.requests:
            for sample in req.samples:
                assert sample.error is None and sample.teacher_token_ids == sample.theta_token_ids == sample.token_ids
                assert len(sample.logq) == len(sample.token_ids)
                total += 1
    rss_end = rss()
    stats1 = load_engine.get_sync_statistics()
    print(f"load: {total} requests, RSS start {rss_start / 2**20:.0f} MiB, end {rss_end / 2**20:.0f} MiB")
    assert total == 300
    assert (
        stats1["teacher_timeouts"] == stats0["teacher_timeouts"]
        and stats1["theta_timeouts"] == stats0["theta_timeouts"]
    )
    assert stats1["split_steps"] == stats0["split_steps"] and stats1["follower_diverged"] == stats0["follower_diverged"]
    assert session_files() == files0
    assert rss_end <= rss_start * 1.10 + 64 * 2**20


def test_two_instances_in_one_process_do_not_cross_talk(dual_engine, load_engine, hf_models):
    prompts = ["one two three", "the sea is", "numbers: 1 2 3", "x y z"]
    results = {}

    def run(name, engine):
        results[name] = engine.generate(prompts, max_tokens=16, seed=5)

    threads = [threading.Thread(target=run, args=(n, e)) for n, e in (("kl", dual_engine), ("ess", load_engine))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert dual_engine.session.name != load_engine.session.name
    for name, method in (("kl", "kl_symmetry"), ("ess", "ess_balance")):
        for req in results[name].requests:
            assert assert_records_match_rescoring(req, *hf_models, dual_engine.vocab, method) > 0


def test_two_processes_do_not_cross_talk(dual_engine, tiny_same, hf_models, tmp_path):
    """Another driver process samples while this one does; each gets its own session and its own records.

    The other process says when its engines are up, and both then sample at once: the overlap is checked from the
    two processes' clocks, not assumed. It runs the entropy method (its one real-engine run); its records are
    re-scored here.
    """
    teacher, theta = tiny_same
    script = textwrap.dedent(f"""
        import json, sys, time
        from dual_sampling import start_engine_server_early
        if __name__ == "__main__":
            start_engine_server_early()  # a program's first lines, as docs/install.md says
            from dual_sampling import OptimalSamplingDual
            with OptimalSamplingDual({str(teacher)!r}, {str(theta)!r}, max_num_seqs=2, max_model_len=256,
                                     sync_timeout=30, use_tqdm=False, alpha_method="entropy") as s:
                print("UP", flush=True)
                start = time.time()
                out = s.generate(["other process"] * 6, max_tokens=48, seed=9)
                window = [start, time.time()]
                requests = [{{"teacher_prompt_token_ids": r.teacher_prompt_token_ids,
                              "theta_prompt_token_ids": r.theta_prompt_token_ids,
                              "samples": [{{k: getattr(x, k) for k in ("error", "token_ids", "alpha", "logp_teacher",
                                                                       "logp_theta", "logq")}} for x in r.samples]}}
                             for r in out.requests]
                print("RESULT " + json.dumps({{"session": s.session.name, "tokens": out.generated_ids,
                                               "stats": s.get_sync_statistics(), "requests": requests,
                                               "window": window}}))
    """)
    log = tmp_path / "child.log"  # vLLM's log, in a file: a pipe nobody reads while the child starts could fill
    with log.open("w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines = iter(child.stdout.readline, "")  # vLLM prints to stdout too
    assert any(line.strip() == "UP" for line in lines), log.read_text()[-3000:]
    ours = []
    while child.poll() is None and len(ours) < 200:
        start = time.time()
        ours.append((dual_engine.generate(["this process"] * 4, max_tokens=16, seed=len(ours)), start, time.time()))
    stdout, _ = child.communicate(timeout=300)
    assert child.returncode == 0, log.read_text()[-3000:]
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["session"] != dual_engine.session.name
    assert result["stats"]["teacher_timeouts"] == result["stats"]["theta_timeouts"] == 0
    assert len(result["tokens"]) == 6 and all(result["tokens"])
    for r in result["requests"]:
        request = SimpleNamespace(**{**r, "samples": [SimpleNamespace(**x) for x in r["samples"]]})
        assert assert_records_match_rescoring(request, *hf_models, dual_engine.vocab, "entropy") > 0
    other_start, other_end = result["window"]
    assert any(start < other_end and end > other_start for _, start, end in ours), "the two never sampled at once"
    for out, _, _ in ours:
        for req in out.requests:
            assert all(s.error is None and s.teacher_token_ids == s.theta_token_ids == s.token_ids for s in req.samples)
