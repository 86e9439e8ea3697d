"""Benchmark: the dual engine against its peers, side by side in one process.

Five designs, same models, prompts and settings:

  (a) teacher      teacher-only vLLM
  (b) theta        theta-only vLLM
  (c) dual         the dual engine (OptimalSamplingDual)
  (d) transformers plain-transformers mixture: both models with KV caches, static batches,
                   the same alpha and sampling code as (c)
  (e) recompute    like (d), but theta re-runs its whole prefix at every token (the
                   original design); the teacher keeps its cache

Measured:
  - tokens/s on a fixed workload: B prompts, exactly T generated tokens each (EOS masked);
  - time per token against generated length L: a probe prefills prompt + L tokens, then
    times decoding steps (the median of 24), so the curve is exact at each L without
    generating everything before it (an O(n²) design would otherwise take hours at L = 1024);
  - peak RSS of the process tree during each design;
  - for (c), the split of the run into model time, barrier wait and mixing time, theta's
    wait for the plan, and how many steps found the two engines' batches out of phase
    (0 by construction);
  - a realistic workload for (c) against (d): chat-formatted questions, sampled at
    temperature 1, lengths ending at EOS, capped at 256 tokens.

Plain engines (a) and (b) bind their model threads to the same CPUs as the dual engine
gives each model (``dual_sampling.driver.engine_processes.split_cpu_binding``).

Derived (the names are fixed; other tools read them):
  dual_vs_bound             tok/s(c) / (1 / (1/tok/s(a) + 1/tok/s(b)))
  dual_vs_parallel_bound    tok/s(c) / min(tok/s(a), tok/s(b)): the ceiling when the two models
                            run at once on their own CPUs, as the dual engine binds them
  dual_vs_transformers      tok/s(c) / tok/s(d) on the realistic workload
  dual_vs_recompute_at_1024 time per token (e) / (c) at the longest length
  per_token_growth          time per token of (c) at the longest length / at the shortest
  growth_vs_teacher         per_token_growth of (c) / the same growth of (a): what the dual engine adds
  serve_vs_offline          tok/s of the realistic workload through ``dual-sampling serve`` (streaming,
                            32 at a time) / tok/s of generate() on the same prompts

Also recorded: the per-token decision's cost in µs per row at the pair's vocabulary size,
against one read of both rows (``decision``; the same measurement as ``make bench-alpha``).

    python examples/benchmark.py                      # SmolLM2 pair, batch 32
    python examples/benchmark.py --pair gemma3        # Gemma 3 270M pair (V = 262,144)
    python examples/benchmark.py --designs teacher theta dual   # only the vLLM designs
    python examples/benchmark.py --quick              # tiny models, seconds per design

A derived figure is reported only when every design it needs was run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from alpha import get_alpha_computer
from dual_sampling import OptimalSamplingDual, models
from dual_sampling.decision.pipeline import ModelRows, RowSampling, decide
from dual_sampling.driver import engine_start
from dual_sampling.driver.engine_processes import engine_cpus, split_cpu_binding
from dual_sampling.options import default_kv_cache_bytes
from dual_sampling.testing import tiny_models

DESIGNS = ("teacher", "theta", "dual", "transformers", "recompute")


@dataclass
class Settings:
    """What one benchmark run measures."""

    teacher: str
    theta: str
    batch: int = 32
    """Sequences decoded together."""
    tokens: int = 128
    """Generated tokens per sequence in the throughput workload."""
    lengths: list[int] = field(default_factory=lambda: [128, 256, 512, 1024])
    """Generated lengths at which time per token is probed."""
    probe_steps: int = 24
    """Decoding steps timed per probe (their median is the probe's figure). Six made growth_vs_teacher swing ±20%
    between runs; more steps cost little beside the probe's prefill, which takes 60–90 s at L = 1024."""
    recompute_probe_steps: int = 2
    """Decoding steps timed per probe of (e), whose steps take up to a minute at L = 1024."""
    realistic_prompts: int = 64
    """Prompts in the realistic workload (temperature 1, EOS, capped)."""
    realistic_max_tokens: int = 256
    prompt_tokens: int = 32
    """Prompt length of the fixed workloads."""
    serve_concurrency: int = 32
    """Streaming requests in flight at once through the server."""
    alpha_method: str = "kl_symmetry"
    designs: tuple[str, ...] = DESIGNS
    """Designs to run, a subset of DESIGNS (the transformers ones take most of a full run's time)."""

    def __post_init__(self) -> None:
        unknown = set(self.designs) - set(DESIGNS)
        if unknown:
            raise ValueError(f"designs: unknown {sorted(unknown)}; choose from {list(DESIGNS)}")


class PeakRSS:
    """Samples the RSS of this process and its children every 50 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
            self.peak = max(self.peak, total)
            self._stop.wait(0.05)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def fixed_prompts(tokenizer, count: int, length: int, offset: int = 0) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``length`` tokens, sharing no prefix beyond a BOS."""
    words = "the a of to and in is it that for on with as was at by an be this from".split()  # noqa: SIM905
    bos = tokenizer("")["input_ids"]  # Gemma's output degenerates without its BOS; SmolLM2 uses none
    out = []
    for i in range(count):
        text = " ".join(words[(i * 7 + j * 3 + offset) % len(words)] + str((i * 31 + j) % 97) for j in range(length))
        out.append((bos + tokenizer(text, add_special_tokens=False)["input_ids"])[:length])
    return out


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` distinct questions (the realistic workload: answers end at EOS).

    Chat-formatted when the tokenizer has a chat template; a base model without one (Gemma 3
    270M) gets "Question: …\\nAnswer:" with its special tokens (Gemma needs its BOS).
    """
    asks = [
        "What is {a} + {b}?",
        "Explain in two sentences what makes {thing} interesting.",
        "Write a short poem about {thing}.",
        "Give three facts about {thing}.",
        "What is {a} times {b}? Show your steps.",
        "Describe {thing} to a child.",
    ]
    things = [
        "the moon",
        "rivers",
        "bread",
        "volcanoes",
        "music",
        "bees",
        "winter",
        "trains",
        "the ocean",
        "forests",
        "salt",
    ]
    out = []
    for i in range(count):
        text = asks[i % len(asks)].format(a=12 + 7 * i, b=5 + 3 * i, thing=things[i % len(things)])
        if tokenizer.chat_template is None:
            out.append(tokenizer(f"Question: {text}\nAnswer:")["input_ids"])
            continue
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    return out


# ---------------------------------------------------------------------- vLLM designs (a), (b)


def vllm_engine(path: str, s: Settings, max_len: int, role: str, prefill_budget: int):
    """One plain engine, its model threads bound to the CPUs that the dual engine gives ``role``."""
    from vllm import LLM

    # Started as the dual engine's are (from the fork server where they are), so no design pays a slower start.
    with engine_cpus(split_cpu_binding().get(role)), engine_start.vllm_engines():
        return LLM(
            model=path,
            dtype="float32",
            max_model_len=max_len,
            max_num_seqs=s.batch,
            enforce_eager=True,
            enable_chunked_prefill=False,
            max_num_batched_tokens=prefill_budget,
            enable_prefix_caching=False,
            # The same cache the dual engine gives each model: room for every sequence, no preemption.
            kv_cache_memory_bytes=default_kv_cache_bytes(path, s.batch, max_len),
            seed=0,
        )


def vllm_run(llm, prompts: list[list[int]], tokens: int) -> tuple[float, list[float]]:
    """(wall seconds, per-step durations) generating exactly ``tokens`` per prompt."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, seed=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    steps, start = [], time.perf_counter()
    last = start
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    return time.perf_counter() - start, steps


# ---------------------------------------------------------------------- transformers designs (d), (e)


class HFMixture:
    """Both models in plain transformers with KV caches, static batches; theta optionally recomputed each token."""

    def __init__(self, teacher: str, theta: str, alpha_method: str, recompute_theta: bool) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(teacher)
        self.vocab = len(self.tokenizer)
        self.teacher = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
        self.theta = AutoModelForCausalLM.from_pretrained(theta, dtype=torch.float32).eval()
        self.alpha = get_alpha_computer(alpha_method)
        self.recompute = recompute_theta
        self.eos = self.tokenizer.eos_token_id

    @torch.no_grad()
    def run(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        stop_at_eos: bool,
        seed: int = 0,
        timed_steps: int | None = None,
    ) -> tuple[float, int, list[float]]:
        """Generate for one static batch (left-padded); return (seconds, generated tokens, step durations)."""
        b = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((b, width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        rows = [
            RowSampling(seed=seed * 1000 + i, min_tokens=0 if stop_at_eos else max_tokens, stop_token_ids=(self.eos,))
            for i in range(b)
        ]
        start = time.perf_counter()
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        out_t = self.teacher(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        out_th = self.theta(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=not self.recompute)
        cache_t, cache_th = out_t.past_key_values, getattr(out_th, "past_key_values", None)
        logits_t, logits_th = out_t.logits[:, -1, : self.vocab], out_th.logits[:, -1, : self.vocab]
        done = torch.zeros(b, dtype=torch.bool)
        generated, steps = 0, []
        all_ids, all_mask = ids, mask
        prev = torch.full((b,), 0.5)
        last = time.perf_counter()
        for step in range(max_tokens):
            decision = decide(ModelRows.pair(logits_t, logits_th), [step] * b, rows, self.alpha, prev)
            prev, tokens = decision.alpha, decision.tokens
            generated += int((~done).sum())
            done |= tokens == self.eos if stop_at_eos else done
            nxt = tokens.unsqueeze(-1)
            all_ids = torch.cat([all_ids, nxt], 1)
            all_mask = torch.cat([all_mask, torch.ones((b, 1), dtype=torch.long)], 1)
            pos_next = all_mask.sum(-1, keepdim=True) - 1
            out_t = self.teacher(
                input_ids=nxt, attention_mask=all_mask, position_ids=pos_next, past_key_values=cache_t, use_cache=True
            )
            cache_t, logits_t = out_t.past_key_values, out_t.logits[:, -1, : self.vocab]
            if self.recompute:
                full_pos = (all_mask.cumsum(-1) - 1).clamp_min(0)
                logits_th = self.theta(
                    input_ids=all_ids, attention_mask=all_mask, position_ids=full_pos, use_cache=False
                ).logits[:, -1, : self.vocab]
            else:
                out_th = self.theta(
                    input_ids=nxt,
                    attention_mask=all_mask,
                    position_ids=pos_next,
                    past_key_values=cache_th,
                    use_cache=True,
                )
                cache_th, logits_th = out_th.past_key_values, out_th.logits[:, -1, : self.vocab]
            now = time.perf_counter()
            steps.append(now - last)
            last = now
            if bool(done.all()) or (timed_steps is not None and step + 1 >= timed_steps):
                break
        return time.perf_counter() - start, generated, steps


# ---------------------------------------------------------------------- the dual engine (c)


def dual_run(dual: OptimalSamplingDual, prompts: list[list[int]], tokens: int, **kw) -> tuple[float, int, dict]:
    before = dual.get_sync_statistics()
    start = time.perf_counter()
    out = dual.generate(prompts, max_tokens=tokens, use_tqdm=False, **kw)
    wall = time.perf_counter() - start
    after = dual.get_sync_statistics()
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}  # counters, not names
    return wall, sum(out.num_tokens), delta


def dual_probe_step(dual: OptimalSamplingDual, prompts: list[list[int]], steps: int) -> float:
    """Median seconds per decoding step of the batch after prefilling ``prompts``, from the teacher's step counter.

    The teacher scheduler admits requests as they reach both engines, so the batch may be
    prefilled over a few steps; timing starts at the first step after the last admission,
    when every row decodes. The median over ``steps`` steps, as for the single engines.
    """
    stats = dual.session.statistics
    admitted0 = stats()["leader_admitted"]
    marks: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            now = stats()
            marks.append((time.perf_counter(), now["teacher_steps"], now["leader_admitted"]))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        dual.generate(prompts, max_tokens=steps + 8, min_tokens=steps + 8, use_tqdm=False)
    finally:
        stop.set()
        watcher.join()
    full = next(c for _, c, a in marks if a >= admitted0 + len(prompts))  # the step that admitted the last one
    ends = [next(t for t, c, _ in marks if c >= full + k) for k in range(1, steps + 2)]
    return statistics.median(b - a for a, b in itertools.pairwise(ends))


def serve_run(dual: OptimalSamplingDual, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """tok/s, time to first token and inter-token latency of streaming requests through ``dual-sampling serve``."""
    import asyncio
    import socket

    import httpx
    import uvicorn

    from dual_sampling.server.app import build_app
    from dual_sampling.server.serve_options import ServeOptions

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(dual, ServeOptions(port=port)), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    ttft, itl, tokens = [], [], 0

    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, i: int) -> None:
        nonlocal tokens
        body = {"prompt": prompts[i], "max_tokens": max_tokens, "seed": 3 + i, "stream": True}
        async with gate:
            start = last = time.perf_counter()
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    n = len(json.loads(line[6:])["choices"][0].get("dual_sampling", {}).get("token_ids", []))
                    if not n:
                        continue
                    now = time.perf_counter()
                    if not tokens or last == start:
                        ttft.append(now - start)
                    else:
                        itl.extend([(now - last) / n] * n)
                    last, tokens = now, tokens + n

    async def run() -> float:
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            start = time.perf_counter()
            await asyncio.gather(*(one(client, gate, i) for i in range(len(prompts))))
            return time.perf_counter() - start

    try:
        wall = asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join(timeout=30)

    def pct(values: list[float], q: float) -> float:
        return 1e3 * statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else 1e3 * (values or [0.0])[0]

    return {
        "tok_s": tokens / wall,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
        "concurrency": concurrency,
    }


# ---------------------------------------------------------------------- driver


def run(s: Settings) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(s.teacher)
    longest = max(s.lengths)
    max_len = s.prompt_tokens + longest + s.probe_steps + 8
    # A probe's whole batch may be prefilled in one engine step, so the steps timed after it are pure decoding.
    prefill_budget = max(s.batch * max_len, 2048)
    work = fixed_prompts(tok, s.batch, s.prompt_tokens)
    results: dict[str, dict] = {d: {"time_per_token_ms": {}} for d in s.designs}

    def probe_prompts(length: int, offset: int) -> list[list[int]]:
        return fixed_prompts(tok, s.batch, s.prompt_tokens + length, offset)

    # (a), (b): one engine at a time, so each has the machine to itself.
    for design, path in (("teacher", s.teacher), ("theta", s.theta)):
        if design not in s.designs:
            continue
        with PeakRSS() as rss:
            llm = vllm_engine(path, s, max_len, design, prefill_budget)
            vllm_run(llm, work[:2], 4)  # warm-up
            wall, _ = vllm_run(llm, work, s.tokens)
            results[design]["tok_s"] = s.batch * s.tokens / wall
            for i, length in enumerate(s.lengths):
                _, steps = vllm_run(llm, probe_prompts(length, i + 1), s.probe_steps + 1)
                results[design]["time_per_token_ms"][length] = 1e3 * statistics.median(steps[1:]) / s.batch
            llm.llm_engine.engine_core.shutdown()
            del llm
        results[design]["peak_rss_mib"] = rss.peak / 2**20
        print(f"{design:12s} {results[design]['tok_s']:8.1f} tok/s", flush=True)

    if "dual" in s.designs:
        run_dual(s, tok, work, probe_prompts, max_len, prefill_budget, results)
    for design, recompute in (("transformers", False), ("recompute", True)):
        if design in s.designs:
            run_transformers(s, tok, work, probe_prompts, recompute, results[design])
    return {
        "settings": s.__dict__,
        "results": results,
        "derived": derived_figures(s, results),
        "decision": decision_figures(s.batch, len(tok)),
        "machine": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
    }


def run_dual(s: Settings, tok, work, probe_prompts, max_len: int, prefill_budget: int, results: dict) -> None:
    """Design (c): throughput with its step split, the probes, the realistic workload and the server."""
    with (
        PeakRSS() as rss,
        OptimalSamplingDual(
            s.teacher,
            s.theta,
            alpha_method=s.alpha_method,
            max_num_seqs=s.batch,
            max_model_len=max_len,
            use_tqdm=False,
            max_num_batched_tokens=prefill_budget,
        ) as dual,
    ):
        dual_run(dual, work[:2], 4)
        wall, generated, split = dual_run(dual, work, s.tokens, min_tokens=s.tokens)
        results["dual"]["tok_s"] = generated / wall
        steps = split["teacher_steps"]
        per_step = 1e3 / max(steps, 1)
        # Seen from the teacher, whose step is the critical path: its model, its wait for theta's rows and
        # the decision. Theta's waits for the token and for the plan are reported beside them.
        results["dual"]["step_split_ms"] = {
            "total": wall * per_step,
            "model": (wall - split["teacher_wait_s"] - split["mix_s"]) * per_step,
            "barrier_wait": split["teacher_wait_s"] * per_step,
            "mixing": split["mix_s"] * per_step,
            "theta_waits_for_token": split["theta_wait_s"] * per_step,
            "theta_waits_for_plan": split["follower_plan_wait_s"] * per_step,
        }
        results["dual"]["split_steps"] = int(split["split_steps"])
        for i, length in enumerate(s.lengths):
            step = dual_probe_step(dual, probe_prompts(length, i + 1), s.probe_steps)
            results["dual"]["time_per_token_ms"][length] = 1e3 * step / s.batch
        realistic = chat_prompts(tok, s.realistic_prompts)
        r_wall, r_tokens, _ = dual_run(dual, realistic, s.realistic_max_tokens, seed=3)
        results["dual"]["realistic_tok_s"] = r_tokens / r_wall
        # The same prompts through the OpenAI-compatible server, 32 streams at a time, beside generate().
        results["serve"] = serve_run(dual, realistic, s.realistic_max_tokens, s.serve_concurrency)
    results["dual"]["peak_rss_mib"] = rss.peak / 2**20
    print(f"{'dual':12s} {results['dual']['tok_s']:8.1f} tok/s", flush=True)


def run_transformers(s: Settings, tok, work, probe_prompts, recompute: bool, result: dict) -> None:
    """Designs (d) and (e): the plain-transformers mixture, theta cached or recomputed."""
    with PeakRSS() as rss:
        hf = HFMixture(s.teacher, s.theta, s.alpha_method, recompute)
        hf.run(work[:2], 2, stop_at_eos=False)
        wall, generated, _ = hf.run(work, s.tokens, stop_at_eos=False)
        result["tok_s"] = generated / wall
        for i, length in enumerate(s.lengths):
            timed = s.recompute_probe_steps if recompute else s.probe_steps
            _, _, steps = hf.run(probe_prompts(length, i + 1), timed + 1, stop_at_eos=False, timed_steps=timed + 1)
            result["time_per_token_ms"][length] = 1e3 * statistics.median(steps[1:]) / s.batch
        if not recompute:
            realistic = chat_prompts(tok, s.realistic_prompts)
            r_wall, r_tokens = 0.0, 0
            for start in range(0, len(realistic), s.batch):
                w, g, _ = hf.run(realistic[start : start + s.batch], s.realistic_max_tokens, stop_at_eos=True, seed=3)
                r_wall, r_tokens = r_wall + w, r_tokens + g
            result["realistic_tok_s"] = r_tokens / r_wall
        del hf
    result["peak_rss_mib"] = rss.peak / 2**20
    print(f"{'recompute' if recompute else 'transformers':12s} {result['tok_s']:8.1f} tok/s", flush=True)


def derived_figures(s: Settings, results: dict) -> dict[str, float]:
    """The derived ratios whose designs all ran (names fixed: other tools read them)."""
    short, long_ = min(s.lengths), max(s.lengths)
    tok_s = {d: r["tok_s"] for d, r in results.items() if "tok_s" in r}
    tpt = {d: results[d]["time_per_token_ms"] for d in s.designs}
    formulas = {
        "dual_vs_bound": (
            ("dual", "teacher", "theta"),
            lambda: tok_s["dual"] * (1.0 / tok_s["teacher"] + 1.0 / tok_s["theta"]),
        ),
        # With each engine's model on its own cores the two run at once: the ceiling is the slower one alone.
        "dual_vs_parallel_bound": (
            ("dual", "teacher", "theta"),
            lambda: tok_s["dual"] / min(tok_s["teacher"], tok_s["theta"]),
        ),
        "dual_vs_transformers": (
            ("dual", "transformers"),
            lambda: results["dual"]["realistic_tok_s"] / results["transformers"]["realistic_tok_s"],
        ),
        "dual_vs_recompute_at_1024": (("dual", "recompute"), lambda: tpt["recompute"][long_] / tpt["dual"][long_]),
        "per_token_growth": (("dual",), lambda: tpt["dual"][long_] / tpt["dual"][short]),
        "growth_vs_teacher": (
            ("dual", "teacher"),
            lambda: (tpt["dual"][long_] / tpt["dual"][short]) / (tpt["teacher"][long_] / tpt["teacher"][short]),
        ),
        "serve_vs_offline": (("dual",), lambda: results["serve"]["tok_s"] / results["dual"]["realistic_tok_s"]),
    }
    return {name: f() for name, (needs, f) in formulas.items() if set(needs) <= set(s.designs)}


def decision_figures(batch: int, vocab: int) -> dict[str, float]:
    """decide() in µs per row at this batch and vocabulary, on one thread as an engine runs it."""
    from bench_alpha import decision_cost, synthetic_pair

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"batch": batch, "vocab": vocab, **decision_cost(*synthetic_pair(batch, vocab), repeats=7)}
    finally:
        torch.set_num_threads(threads)


def markdown_table(report: dict) -> str:
    lengths = report["settings"]["lengths"]
    head = "| design | tok/s | " + " | ".join(f"ms/token @{n}" for n in lengths) + " | peak RSS MiB |"
    lines = [head, "|" + "---|" * (3 + len(lengths))]
    designs = report["settings"]["designs"]
    for d in designs:
        r = report["results"][d]
        cells = " | ".join(f"{r['time_per_token_ms'][n]:.2f}" for n in lengths)
        lines.append(f"| {d} | {r['tok_s']:.1f} | {cells} | {r['peak_rss_mib']:.0f} |")
    lines.append("")
    lines += [f"- `{k}` = {v:.3f}" for k, v in report["derived"].items()]
    dc = report["decision"]
    lines.append(
        f"- decide() at B = {dc['batch']}, V = {dc['vocab']}: {dc['us_per_row']:.0f} µs/row, one read of both rows "
        f"{dc['floor_us_per_row']:.1f} µs/row ({dc['decide_vs_floor']:.1f}×); torch reference "
        f"{dc['reference_us_per_row']:.0f} µs/row"
    )
    if "dual" not in designs:
        return "\n".join(lines)
    split = report["results"]["dual"]["step_split_ms"]
    lines.append("- dual step split (ms per step): " + ", ".join(f"{k} {v:.1f}" for k, v in split.items()))
    lines.append(f"- dual steps with the engines out of phase: {report['results']['dual']['split_steps']}")
    sv = report["results"]["serve"]
    lines.append(
        f"- server, {sv['concurrency']} streams: {sv['tok_s']:.1f} tok/s; time to first token p50 "
        f"{sv['ttft_ms_p50']:.0f} ms, p99 {sv['ttft_ms_p99']:.0f} ms; inter-token latency p50 "
        f"{sv['itl_ms_p50']:.1f} ms, p99 {sv['itl_ms_p99']:.1f} ms"
    )
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    lengths = report["settings"]["lengths"]
    for d in report["settings"]["designs"]:
        ax.plot(lengths, [report["results"][d]["time_per_token_ms"][n] for n in lengths], marker="o", label=d)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="generated length (tokens)",
        ylabel="ms per token (per sequence)",
        title=f"Time per token, batch {report['settings']['batch']}",
    )
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # only the probed lengths are labelled
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pair", choices=sorted(models.REAL_PAIRS), default="smollm2", help="model pair (default smollm2)"
    )
    parser.add_argument("--designs", nargs="+", choices=DESIGNS, help="designs to run (default: all five)")
    parser.add_argument("--teacher")
    parser.add_argument("--theta")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument(
        "--quick", action="store_true", help="tiny models and short lengths: a smoke run in about a minute"
    )
    parser.add_argument(
        "--output", default="bench-out/benchmark.json", help="JSON path; the .md table and .png plot go beside it"
    )
    args = parser.parse_args()
    if args.quick:
        teacher, theta = (str(p) for p in tiny_models.tiny_pair("same"))
        s = Settings(
            teacher,
            theta,
            batch=4,
            tokens=16,
            lengths=[16, 64],
            probe_steps=3,
            recompute_probe_steps=2,
            realistic_prompts=8,
            realistic_max_tokens=24,
            prompt_tokens=8,
        )
    else:
        teacher, theta = models.REAL_PAIRS[args.pair]
        s = Settings(str(teacher()), str(theta()))
    for name in ("teacher", "theta", "batch", "tokens", "lengths", "designs"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    report = run(s)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    table = markdown_table(report)
    out.with_suffix(".md").write_text(table + "\n")
    plot(report, str(out.with_suffix(".png")))
    print(table)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
