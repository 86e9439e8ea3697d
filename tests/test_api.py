"""The dual engine on real vLLM CPU engines (tiny models), checked against independent oracles."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from dual_sampling import EnginePairDead, OptimalSamplingDual, SamplingOptions
from dual_sampling.testing import tiny_models
from tests import processes
from tests.oracles import (
    assert_dense_match_rescoring,
    assert_records_match_rescoring,
    oracle_rows,
    reference_logq,
    rescore,
)
from tests.tolerances import TWO_NORMALISATIONS_ATOL

pytestmark = pytest.mark.engine

PROMPTS = ["Hello there", "The capital of France is", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3, "x"]


def assert_three_streams_agree(out) -> None:
    for req in out.requests:
        for s in req.samples:
            assert s.error is None, s.error
            assert s.teacher_token_ids == s.theta_token_ids == s.token_ids


def test_streams_identical_and_records_match_offline_rescoring(dual_engine, hf_models):
    teacher_prompts = [p + " (hint: think)" for p in PROMPTS]
    out = dual_engine.generate(PROMPTS, teacher_prompts=teacher_prompts, max_tokens=24, seed=3)
    assert_three_streams_agree(out)
    checked = 0
    for req in out.requests:
        assert req.samples[0].token_ids
        assert req.teacher_prompt_token_ids != req.theta_prompt_token_ids
        checked += assert_records_match_rescoring(req, *hf_models, dual_engine.vocab, "kl_symmetry")
    assert checked >= 4 * 10
    assert out.alpha_stats["std"] > 0.0  # α really varies token by token


def test_dense_logprobs_are_each_models_own_top_k(dual_engine, hf_models):
    """The per-token top k of π_t and of π_θ, untempered and unfiltered, with both models' log-probabilities at
    them, against transformers re-scoring."""
    k = 16
    out = dual_engine.generate(PROMPTS[1:3], max_tokens=10, temperature=0.7, top_k=5, seed=11, dense_logprobs=k)
    assert_three_streams_agree(out)
    for req in out.requests:
        assert_dense_match_rescoring(req, *hf_models, dual_engine.vocab, k)
    plain = dual_engine.generate(PROMPTS[1:2], max_tokens=4, seed=11)
    assert plain.requests[0].samples[0].dense_ids is None
    with pytest.raises(ValueError, match="dense_logprobs"):
        dual_engine.generate(PROMPTS[1:2], max_tokens=4, dense_logprobs=k + 1)


def test_temperature_and_top_k_shape_the_recorded_logq(dual_engine, hf_models):
    out = dual_engine.generate(PROMPTS[:2], max_tokens=12, temperature=0.7, top_k=50, seed=5)
    for req in out.requests:
        assert_records_match_rescoring(req, *hf_models, dual_engine.vocab, "kl_symmetry", temperature=0.7, top_k=50)


@pytest.mark.parametrize(
    "options",
    [
        {"logit_bias": {198: 6.0, 11: -100.0}},
        {"min_p": 0.05, "temperature": 0.9},
        {"teacher_support_top_p": 0.8},
        {"teacher_support_top_k": 5, "top_p": 0.9},
        {"force_first_token": True},
    ],
)
def test_sampling_options_against_the_oracle(dual_engine, hf_models, options):
    out = dual_engine.generate(PROMPTS[:3], max_tokens=10, seed=8, **options)
    for req in out.requests:
        assert_records_match_rescoring(req, *hf_models, dual_engine.vocab, "kl_symmetry", **options)
        if options.get("force_first_token"):
            s = req.samples[0]
            # q = π_t at step 0: the same logits, normalised as a mixture and as the teacher alone.
            assert s.alpha[0] == 1.0 and s.logq[0] == pytest.approx(s.logp_teacher[0], abs=TWO_NORMALISATIONS_ATOL)
        if "logit_bias" in options:
            assert 11 not in req.samples[0].token_ids


def test_greedy_picks_the_mode_of_q(dual_engine, hf_models):
    out = dual_engine.generate(PROMPTS[:2], max_tokens=8, temperature=0.0)
    for req in out.requests:
        s = req.samples[0]
        lt, lth, alpha = oracle_rows(s, req, *hf_models, dual_engine.vocab)
        mode = reference_logq(lth, lt, alpha).argmax(-1).tolist()
        assert s.token_ids == mode
        assert s.logq == [0.0] * len(s.token_ids)  # greedy records log q = 0 by convention
    again = dual_engine.generate(PROMPTS[:2], max_tokens=8, temperature=0.0, seed=99)
    assert again.generated_ids == out.generated_ids


def test_same_seed_same_output_and_seeds_matter(dual_engine):
    a = dual_engine.generate(PROMPTS, max_tokens=16, seed=11, n=2)
    b = dual_engine.generate(PROMPTS, max_tokens=16, seed=11, n=2)
    c = dual_engine.generate(PROMPTS, max_tokens=16, seed=12, n=2)
    assert a.generated_ids == b.generated_ids
    assert [s.alpha for r in a.requests for s in r.samples] == [s.alpha for r in b.requests for s in r.samples]
    assert a.generated_ids != c.generated_ids


def test_many_requests_mixed_lengths_early_stops_no_timeouts(dual_engine):
    before = dual_engine.get_sync_statistics()
    prompts = [("word " * (1 + (7 * i) % 60)).strip() for i in range(14)]  # more than max_num_seqs=4
    common = [t for t, _ in zip(range(200, 49152, 97), range(400))]  # many stop ids: early stops
    out = dual_engine.generate(prompts, max_tokens=30, n=2, seed=1, stop_token_ids=common, stop=["ing"])
    after = dual_engine.get_sync_statistics()
    lengths = out.num_tokens
    assert after["row_transport"] == "host"  # "auto" on CPU engines
    assert len(lengths) == 28 and 1 <= min(lengths) < 30 and len(set(lengths)) >= 3  # mixed: early stops vary
    assert_three_streams_agree(out)
    assert (
        after["teacher_timeouts"] == before["teacher_timeouts"] and after["theta_timeouts"] == before["theta_timeouts"]
    )
    # The kernel's α solve converges on real rows: no row was handed back for that (the counter is the teacher's).
    assert after["kernel_unconverged"] == before["kernel_unconverged"]
    assert after["kernel_handed_back"] >= before["kernel_handed_back"] >= 0
    reasons = {s.finish_reason for r in out.requests for s in r.samples}
    assert "stop" in reasons
    for r in out.requests:
        for s in r.samples:
            assert len(s.alpha) == len(s.logq) == len(s.logp_teacher) == len(s.token_ids)
            if isinstance(s.stop_reason, str):
                assert s.stop_reason == "ing" and "ing" not in s.text[-3:]


def test_both_batches_hold_the_same_requests_at_every_step(dual_engine):
    # A request in one engine's batch a step before the other's would show as a split step
    # (its teacher row waits for theta's next step). Lockstep by construction: none, ever.
    before = dual_engine.get_sync_statistics()
    prompts = [("word " * (1 + 5 * i)).strip() for i in range(12)]
    out = dual_engine.generate(
        prompts,
        teacher_prompts=[p + " and a much longer hint " * 6 for p in prompts],
        max_tokens=20,
        min_tokens=20,
        seed=4,
    )
    after = dual_engine.get_sync_statistics()
    assert out.num_tokens == [20] * 12
    assert after["teacher_steps"] - before["teacher_steps"] >= 40
    assert after["split_steps"] == before["split_steps"]
    assert after["follower_diverged"] == before["follower_diverged"]
    assert after["teacher_steps"] - before["teacher_steps"] == after["theta_steps"] - before["theta_steps"]


def test_n_and_best_of(dual_engine):
    out = dual_engine.generate(PROMPTS[:2], max_tokens=10, n=2, best_of=4, best_of_score="logp_theta", seed=2)
    full = dual_engine.generate(PROMPTS[:2], max_tokens=10, n=4, seed=2)
    for kept, everything in zip(out.requests, full.requests):
        assert len(kept.samples) == 2
        scores = sorted((math.fsum(s.logp_theta) for s in everything.samples), reverse=True)
        assert [math.fsum(s.logp_theta) for s in kept.samples] == pytest.approx(scores[:2])
        assert len({tuple(s.token_ids) for s in everything.samples}) > 1


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(dual_engine, hf_models):
    eos = dual_engine.eos_token_ids
    evens = list(range(0, 49152, 2))
    out = dual_engine.generate(PROMPTS[:2], max_tokens=6, min_tokens=6, stop_token_ids=evens, stop=["e", " "], seed=4)
    for req in out.requests:
        s = req.samples[0]
        assert len(s.token_ids) == 6 and all(t % 2 == 1 and t not in eos for t in s.token_ids[:-1])
        assert_records_match_rescoring(
            req,
            *hf_models,
            dual_engine.vocab,
            "kl_symmetry",
            min_tokens=6,
            stop_ids=tuple(sorted(set(eos) | set(evens))),
        )


def test_sampling_options_object_and_keywords_agree(dual_engine):
    opts = SamplingOptions(max_tokens=9, temperature=0.8, n=2, seed=21, stop=["."])
    a = dual_engine.generate(PROMPTS[:2], sampling=opts)
    b = dual_engine.generate(PROMPTS[:2], max_tokens=9, temperature=0.8, n=2, seed=21, stop=["."])
    assert a.generated_ids == b.generated_ids
    with pytest.raises(ValueError, match="either as sampling= or as keywords"):
        dual_engine.generate(PROMPTS[:1], sampling=opts, top_k=3)


def test_bad_generate_arguments_are_named(dual_engine):
    with pytest.raises(ValueError, match="temperature"):
        dual_engine.generate(["a"], temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        dual_engine.generate(["a"], top_p=0)
    with pytest.raises(ValueError, match="best_of"):
        dual_engine.generate(["a"], n=3, best_of=2)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        dual_engine.generate(["a"], n=0)
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        dual_engine.generate(["a", ""])
    with pytest.raises(ValueError, match="teacher_prompts has 1 entries"):
        dual_engine.generate(["a", "b"], teacher_prompts=["c"])
    with pytest.raises(ValueError, match="prompt_keys has 1 entries"):
        dual_engine.generate(["a", "b"], prompt_keys=["k"])
    with pytest.raises(ValueError, match="prompt 0 has"):
        dual_engine.generate(["word " * 400])
    with pytest.raises(ValueError, match="unsupported sampling options: bad_words .*bad words"):
        dual_engine.generate(["a"], bad_words=["x"])
    with pytest.raises(ValueError, match="presence_penalty must lie in"):
        dual_engine.generate(["a"], presence_penalty=2.5)
    with pytest.raises(ValueError, match="logit_bias has token ids outside the vocabulary"):
        dual_engine.generate(["a"], logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match="must be a list of prompts"):
        dual_engine.generate("just one string")
    vocab = dual_engine.vocab
    with pytest.raises(
        ValueError, match=rf"prompts\[1\] has token ids outside the vocabulary \[0, {vocab}\): \[{vocab}\]"
    ):
        dual_engine.generate([[1, 2], [3, vocab]])
    with pytest.raises(ValueError, match=r"teacher_prompts\[0\] has token ids outside the vocabulary .*\[-1\]"):
        dual_engine.generate([[1, 2]], teacher_prompts=[[-1, 2]])
    with pytest.raises(ValueError, match=rf"stop_token_ids has token ids outside the vocabulary .*\[{vocab}\]"):
        dual_engine.generate(["a"], stop_token_ids=[5, vocab])
    with pytest.raises(ValueError, match="stop_token_ids"):
        dual_engine.generate(["a"], stop_token_ids=[-3])


def test_max_tokens_is_capped_by_the_room_the_longer_prompt_leaves(dual_engine):
    # max_model_len is 256. The longer prompt (either side) leaves 3 tokens: the sample fills the context and stops.
    long = list(range(100, 353))
    for prompts, teacher in (([[7, 8]], [long]), ([long], [[7, 8]])):
        out = dual_engine.generate(prompts, teacher_prompts=teacher, max_tokens=40, seed=1)
        (sample,) = out.requests[0].samples
        assert len(sample.token_ids) == 256 - len(long) == 3 and sample.finish_reason == "length"


def test_keyboard_interrupt_inside_generate_leaves_the_engine_usable(dual_engine):
    main = threading.main_thread().ident

    driver = dual_engine.driver
    deadline = time.monotonic() + 60
    while driver.in_flight() and time.monotonic() < deadline:  # an earlier test's request still ending
        time.sleep(0.005)
    launched_before = driver.counters["requests"]

    def interrupt_once_running() -> None:  # by state: once requests are in the engines (a timer once fired too late)
        # This call's requests, not an earlier test's: one still ending once let the interrupt land before generate()
        # launched any (CI, 2026-12-07: no request aborted).
        deadline = time.monotonic() + 60
        running = lambda: driver.counters["requests"] > launched_before and driver.in_flight()
        while not running() and time.monotonic() < deadline:
            time.sleep(0.005)
        # A real SIGINT to the main thread, as Ctrl-C sends: it interrupts generate()'s wait while the requests run.
        # (_thread.interrupt_main only sets Python's flag, which a thread blocked on a lock sees once generate returns.)
        signal.pthread_kill(main, signal.SIGINT)

    # A job started in the background by a non-interactive shell inherits SIGINT ignored, and then Python installs no
    # handler and interrupt_main does nothing: install Python's own for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt_once_running, daemon=True).start()
    aborted_before = dual_engine.driver.counters["finished_abort"]
    try:
        with pytest.raises(KeyboardInterrupt):
            dual_engine.generate(["tell me a long story"] * 12, max_tokens=200, min_tokens=200, seed=1)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert dual_engine.driver.in_flight() == []
    # It landed while requests ran (aborted ones), not after the generation ended.
    assert dual_engine.driver.counters["finished_abort"] > aborted_before
    out = dual_engine.generate(PROMPTS, max_tokens=8, seed=3)
    assert_three_streams_agree(out)
    assert all(s.finish_reason in ("stop", "length") for r in out.requests for s in r.samples)


def test_construction_errors_before_any_engine_starts(tiny_same, tmp_path):
    teacher, theta = tiny_same
    _, foreign = tiny_models.tiny_pair("foreign")
    before = processes.our_shm_files()
    with pytest.raises(ValueError, match="tokenizers differ"):
        OptimalSamplingDual(teacher, foreign)
    with pytest.raises(ValueError, match="unknown alpha method 'nope'"):
        OptimalSamplingDual(teacher, theta, alpha_method="nope")
    with pytest.raises(ValueError, match="alpha_min=0.9 > alpha_max=0.1"):
        OptimalSamplingDual(teacher, theta, alpha_min=0.9, alpha_max=0.1)
    with pytest.raises(FileNotFoundError, match="model_theta"):
        OptimalSamplingDual(teacher, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="theta_engine_kwargs sets max_num_seqs"):
        OptimalSamplingDual(teacher, theta, theta_engine_kwargs={"max_num_seqs": 2})
    with pytest.raises(ValueError, match="max_num_batched_tokens=64 is below max_model_len=256"):
        OptimalSamplingDual(teacher, theta, max_model_len=256, max_num_batched_tokens=64)
    assert processes.our_shm_files() <= before


def unix_socket_paths(pids: list[int], children: bool = True) -> set[str]:
    """The filesystem paths of the Unix sockets ``pids`` (and their children) have open, bound or connected."""
    procs = [psutil.Process(pid) for pid in pids]
    if children:
        procs += [child for proc in procs for child in proc.children(recursive=True)]
    paths = set()
    for proc in procs:
        for conn in proc.net_connections(kind="unix"):
            paths |= {a for a in (conn.laddr, conn.raddr) if isinstance(a, str) and a.startswith("/")}
    return paths


def test_padded_vocab_pair_matches_rescoring_and_cleans_up():
    teacher, theta = tiny_models.tiny_pair("padded")
    from transformers import AutoModelForCausalLM

    hf = tuple(AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (teacher, theta))
    # Also the one real-engine run of the fixed method: α = 0.3 on every token, whatever the rows.
    with OptimalSamplingDual(
        teacher,
        theta,
        max_num_seqs=2,
        max_model_len=128,
        use_tqdm=False,
        alpha_method="fixed",
        alpha_config={"alpha": 0.3},
    ) as s:
        assert s.vocab == 49152
        name = s.session.name
        assert os.path.exists(f"/dev/shm/{name}")
        # vLLM's ZMQ sockets lie in the pair's private folder (removed by close), not in the machine's /tmp.
        ipc = s.driver.engines.ipc_dir
        assert ipc is not None and ipc.is_dir() and ipc.stat().st_mode & 0o077 == 0
        # The engines' sockets are all in it; this process's are in it or in another pair's folder of this process (the
        # session's dual_engine fixture runs too), never elsewhere.
        engines = unix_socket_paths([p for pids in s.engine_pids().values() for p in pids])
        assert engines and all(Path(p).parent == ipc for p in engines), engines
        ours = unix_socket_paths([os.getpid()], children=False)
        assert any(Path(p).parent == ipc for p in ours), ours
        assert all(
            Path(p).parent.parent == ipc.parent and Path(p).parent.name.startswith(f"ipc-{os.getpid()}-") for p in ours
        )
        out = s.generate(PROMPTS[:3], max_tokens=12, seed=0)
        assert_three_streams_agree(out)
        for r in out.requests:
            # The teacher's 128 padding rows never take part: the re-scoring over the tokenizer's V agrees.
            assert_records_match_rescoring(r, *hf, s.vocab, "fixed", alpha_config={"alpha": 0.3})
            assert all(a == pytest.approx(0.3, abs=1e-6) for a in r.samples[0].alpha)
            assert rescore(hf[0], r.teacher_prompt_token_ids, r.samples[0].token_ids, s.vocab).shape[-1] == s.vocab
    assert not os.path.exists(f"/dev/shm/{name}") and not ipc.exists()
    # A closed instance refuses every call through its door at once (its loop is gone: nothing may wait on it).
    for call in (s.resume, s.pause, lambda: s.set_weight_version("theta", "x"), lambda: s.update_alpha("fixed")):
        with pytest.raises(EnginePairDead, match="this OptimalSamplingDual is closed"):
            call()
    for call in (s.resume_async, s.pause_async):
        with pytest.raises(EnginePairDead, match="this OptimalSamplingDual is closed"):
            asyncio.run(call())


def test_a_new_alpha_computer_decides_the_next_samples_and_a_bad_one_changes_nothing(dual_engine, hf_models):
    """update_alpha: trust_region with a budget, checked against the float64 boundary by re-scoring, then back."""
    s = dual_engine
    started = s.alpha_settings
    assert started[0] == "kl_symmetry"
    with pytest.raises(ValueError, match="kl_budget must be a finite number >= 0"):
        s.update_alpha("trust_region", kl_budget=-1.0)
    with pytest.raises(ValueError, match="unknown alpha method"):
        s.update_alpha("trust_regio")
    assert s.alpha_settings == started and s.get_sync_statistics()["alpha_updates"] == 0
    try:
        method, config = s.update_alpha("trust_region", kl_budget=0.02)
        assert method == "trust_region" and config == {"alpha_min": 0.0, "alpha_max": 1.0, "kl_budget": 0.02}
        out = s.generate(PROMPTS[:2], max_tokens=12, seed=4)
        checked = sum(
            assert_records_match_rescoring(r, *hf_models, s.vocab, "trust_region", alpha_config={"kl_budget": 0.02})
            for r in out.requests
        )
        assert checked > 0
        alphas = [a for r in out.requests for a in r.samples[0].alpha]
        assert max(alphas) < 1.0  # the budget binds on this pair: not the teacher alone
    finally:
        s.update_alpha(started[0], **started[1])
    assert s.alpha_settings == started and s.get_sync_statistics()["alpha_updates"] == 2
    back = s.generate(PROMPTS[:1], max_tokens=8, seed=4).requests[0]
    assert assert_records_match_rescoring(back, *hf_models, s.vocab, "kl_symmetry") > 0


def test_engines_start_from_the_fork_server_with_their_own_cpus(dual_engine):
    """Each EngineCore is forked from this process's fork server (not spawned by this process), its worker is forked
    from it (so the pair's health watch and vLLM's shutdown still find it), and each worker runs on its own half of
    the CPUs, applied by hand since libgomp read its variables in the fork server (``driver.engine_start``)."""
    pair = dual_engine.driver.engines
    assert pair.from_forkserver
    pids = dual_engine.engine_pids()
    assert set(pids) == {"teacher", "theta"} and all(len(p) == 2 for p in pids.values()), pids
    servers = set()
    for role, (core, worker) in pids.items():
        servers.add(psutil.Process(core).ppid())
        assert psutil.Process(worker).ppid() == core
        assert psutil.Process(worker).cpu_affinity() == [int(c) for c in pair.binding[role].split(",")]
    (server,) = servers
    assert server != os.getpid() and psutil.Process(server).ppid() == os.getpid()
    assert "forkserver" in " ".join(psutil.Process(server).cmdline())
    # The server loaded the decision kernel for every engine (numba's llvmlite is mapped in it; a worker registering
    # vLLM's kernel overrides after that would fail, so the engines running show the server registered them), and it
    # still holds a single thread: no OpenMP pool for its children to inherit.
    assert "libllvmlite" in Path(f"/proc/{server}/maps").read_text()
    assert psutil.Process(server).num_threads() == 1


def test_the_fork_servers_preparation_does_nothing_imported_elsewhere():
    from vllm.platforms import current_platform

    import dual_sampling.driver.engine_server as engine_server

    assert current_platform.register_triton_kernel_overrides != engine_server._already_registered


def test_the_driver_and_every_engine_share_one_tokenizer(dual_engine):
    """The driver's tokenizer is the object vLLM's cache holds under each running engine's own model config: the
    engines' front ends took it without a load of their own."""
    from vllm.tokenizers import cached_get_tokenizer, cached_tokenizer_from_config

    misses = cached_get_tokenizer.cache_info().misses
    for engine in dual_engine.driver.engines.engines.values():
        assert cached_tokenizer_from_config(engine.model_config) is dual_engine.tokenizer
    assert cached_get_tokenizer.cache_info().misses == misses
