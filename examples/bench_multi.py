"""Two teachers against one, and against the slowest engine alone, side by side in one run.

    python examples/bench_multi.py --output docs/multi_teacher_benchmark.json   # SmolLM2 teachers, pruned theta
    python examples/bench_multi.py --quick                                       # the tiny twin trio, to check it

The same GSM8K questions (examples/data/gsm8k, held-out rows), ``--batch`` at a time, exactly ``--tokens`` generated
tokens each (min_tokens = max_tokens), temperature 1, kl_symmetry, the first teacher with three worked solutions as a
hint. Designs, each started, warmed up, timed ``--repeats`` times and closed before the next:

- ``trio``: ``OptimalSamplingDual({"full": SmolLM2, "pruned_27": SmolLM2 with 27 of its 30 layers}, theta)``, three
  engines in lockstep (on two CPUs, placed by model size: the first teacher alone on one, the second teacher and
  theta on the other; ``split_cpu_binding``);
- ``pair``: ``OptimalSamplingDual(SmolLM2, theta)``, the first teacher alone with theta, one CPU each;
- ``slowest_alone``: vLLM's own ``LLM`` on the first teacher (the slowest model) with no mixture, on the CPUs the
  trio gives that teacher's engine: what generating from it costs with nothing else running there.

Reported: each design's tokens per second (median over the repeats, with every repeat), the ratios trio/pair and
trio/slowest_alone, and the peak resident memory of this process and every engine process it started (sampled every
0.1 s while the design ran).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dual_sampling import OptimalSamplingDual, models  # noqa: E402
from dual_sampling.driver.engine_processes import engine_cpus, split_cpu_binding  # noqa: E402
from dual_sampling.driver.placement import weight_bytes  # noqa: E402
from dual_sampling.options import default_kv_cache_bytes  # noqa: E402

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "subset.jsonl"
HELD_OUT = 48
"""The subset's last rows, which the distillation experiment holds out."""


class PeakMemory:
    """The largest resident set of this process and all its descendants together, sampled every 0.1 s in a thread."""

    def __enter__(self) -> PeakMemory:
        import psutil

        self.peak, self._stop = 0, threading.Event()
        me = psutil.Process()

        def sample() -> None:
            while not self._stop.wait(0.1):
                total = 0
                for proc in [me, *me.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):  # a process that exited meanwhile
                        total += proc.memory_info().rss
                self.peak = max(self.peak, total)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def prompts(tokenizer, batch: int) -> tuple[list[list[int]], list[list[int]]]:
    """(hinted prompts for the first teacher, plain prompts for every other model)."""
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
    held_out, shots = rows[-HELD_OUT:], rows[:3]
    hint = "\n\n".join(f"Example problem: {s['question']}\nWorked solution: {s['answer']}" for s in shots)

    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    questions = [row["question"] for row in held_out[:batch]]
    plain = [chat(f"Solve this problem step by step.\n{q}") for q in questions]
    hinted = [chat(f"{hint}\n\nSolve this problem step by step.\n{q}") for q in questions]
    return hinted, plain


def time_dual(dual: OptimalSamplingDual, plain, teacher_prompts, tokens: int, repeats: int) -> list[float]:
    """Seconds of each timed ``generate`` of the whole batch (after one warm-up request)."""
    dual.generate(plain[:1], teacher_prompts=_first(teacher_prompts, 1), max_tokens=4)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = dual.generate(plain, teacher_prompts=teacher_prompts, max_tokens=tokens, min_tokens=tokens, seed=0)
        seconds.append(time.perf_counter() - start)
        assert all(s.ok and len(s.token_ids) == tokens for r in out.requests for s in r.samples)
    return seconds


def _first(teacher_prompts, n: int):
    if isinstance(teacher_prompts, dict):
        return {name: p[:n] for name, p in teacher_prompts.items()}
    return teacher_prompts[:n]


def time_alone(
    model: str, cpus: str | None, hinted, batch: int, max_len: int, tokens: int, repeats: int
) -> list[float]:
    from vllm import LLM, SamplingParams

    with engine_cpus(cpus):
        llm = LLM(
            model=model,
            dtype="float32",
            max_model_len=max_len,
            max_num_seqs=batch,
            enforce_eager=True,
            kv_cache_memory_bytes=default_kv_cache_bytes(model, batch, max_len),
            seed=0,
        )
    params = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, seed=0)
    llm.generate([{"prompt_token_ids": hinted[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in hinted], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    del llm
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="bench-out/multi_teacher.json")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tiny twin trio, small sizes")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if args.quick:
        from dual_sampling.testing.twins import twin_trio

        folders, theta_folder = twin_trio("mixed-trio")
        teachers = {name: str(folder) for name, folder in folders.items()}
        theta = str(theta_folder)
        args.batch, args.tokens, args.repeats = 2, 8, 1
    else:
        teachers = {"full": str(models.smollm2()), "pruned_27": str(models.smollm2_pruned(27))}
        theta = str(models.smollm2_pruned(16))
    first = next(iter(teachers))
    tokenizer = AutoTokenizer.from_pretrained(teachers[first])
    hinted, plain = prompts(tokenizer, args.batch)
    max_len = max(len(p) for p in hinted) + args.tokens + 8
    settings = dict(alpha_method="kl_symmetry", max_num_seqs=args.batch, max_model_len=max_len, use_tqdm=False)
    seconds, peak = {}, {}
    with PeakMemory() as memory, OptimalSamplingDual(teachers, theta, **settings) as dual:
        seconds["trio"] = time_dual(dual, plain, {first: hinted}, args.tokens, args.repeats)
    peak["trio"] = memory.peak
    with PeakMemory() as memory, OptimalSamplingDual(teachers[first], theta, **settings) as dual:
        seconds["pair"] = time_dual(dual, plain, hinted, args.tokens, args.repeats)
    peak["pair"] = memory.peak
    folders = {**teachers, "theta": theta}
    loads = [weight_bytes(folder, "float32") for folder in folders.values()]  # as the trio's engines were placed
    cpus = split_cpu_binding(tuple(folders), loads).get(first)
    with PeakMemory() as memory:
        seconds["slowest_alone"] = time_alone(
            teachers[first], cpus, hinted, args.batch, max_len, args.tokens, args.repeats
        )
    peak["slowest_alone"] = memory.peak
    generated = args.batch * args.tokens
    rate = {design: generated / statistics.median(s) for design, s in seconds.items()}
    report = {
        "teachers": teachers,
        "theta": theta,
        "batch": args.batch,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "slowest_alone_cpus": cpus,
        "seconds": seconds,
        "tokens_per_s": rate,
        "trio_vs_pair": rate["trio"] / rate["pair"],
        "trio_vs_slowest_alone": rate["trio"] / rate["slowest_alone"],
        "peak_rss_mib": {design: value / 2**20 for design, value in peak.items()},
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("tokens_per_s", "trio_vs_pair", "trio_vs_slowest_alone", "peak_rss_mib")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
