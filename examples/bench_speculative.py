"""The speculative mixture mode against lockstep and against the peers' pipeline, side by side in one run.

    python examples/bench_speculative.py --output bench-out/speculative.json     # SmolLM2 and its 24-layer prune
    python examples/bench_speculative.py --quick                                 # the tiny pair, to check the script

Two workloads of the same GSM8K questions (examples/data/gsm8k, held-out rows), ``--batch`` at a time, exactly
``--tokens`` generated tokens each (EOS ignored), at temperature 1:

- **no hint:** both models see the question;
- **hinted:** the teacher's prompt also holds three worked solutions (theta's does not).

Designs, on this machine's cores:

- ``peers``: what on-policy distillation in TRL, verl and NeMo-RL does: theta generates alone, then the teacher scores
  each prompt and completion in one prefill (``prompt_logprobs``). Its time is the sum of the two stages, each engine
  on the cores lockstep gives its model (half each).
- ``lockstep``: ``OptimalSamplingDual`` (kl_symmetry), one core per engine as it binds them.
- ``speculative_<γ>``: ``OptimalSamplingDual(mode="speculative", num_speculative_tokens=γ)`` (kl_symmetry), one
  engine with every core, for γ in ``--gammas``. The mode gives both models the teacher's prompt, so on the hinted
  workload theta sees the hint too (its q differs from lockstep's there).

Reported per workload: tokens per second of each design; ``dual_vs_student_plus_teacher_prefill``, a design's
tokens per second over the peers', for lockstep and for each γ; the speculative mode's acceptance (drafts kept over
drafts checked) and the mean tokens a teacher forward emitted; and, from the engines' own step counts, the time of one
lockstep step against one speculative round, which is what a GPU changes (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dual_sampling import OptimalSamplingDual, models  # noqa: E402
from dual_sampling.driver.engine_processes import engine_cpus, split_cpu_binding  # noqa: E402
from dual_sampling.options import default_kv_cache_bytes  # noqa: E402
from dual_sampling.testing import tiny_models  # noqa: E402

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "subset.jsonl"
HELD_OUT = 48
"""The subset's last rows, which the distillation experiment holds out."""


def problems() -> list[dict]:
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
    return rows[-HELD_OUT:], rows[:3]


def chat(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def workloads(tokenizer, batch: int) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """{name: (teacher prompts, theta prompts)}."""
    held_out, shots = problems()
    questions = [row["question"] for row in held_out[:batch]]
    hint = "\n\n".join(f"Example problem: {s['question']}\nWorked solution: {s['answer']}" for s in shots)
    plain = [chat(tokenizer, f"Solve this problem step by step.\n{q}") for q in questions]
    hinted = [chat(tokenizer, f"{hint}\n\nSolve this problem step by step.\n{q}") for q in questions]
    return {"no_hint": (plain, plain), "hinted": (hinted, plain)}


def engine(model: str, role: str, batch: int, max_len: int, **kw):
    """A plain engine whose model threads are bound to the CPUs the dual engine gives ``role``."""
    from vllm import LLM

    with engine_cpus(split_cpu_binding().get(role)):
        return LLM(
            model=model,
            dtype="float32",
            max_model_len=max_len,
            max_num_seqs=batch,
            enforce_eager=True,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=default_kv_cache_bytes(model, batch, max_len),
            seed=0,
            **kw,
        )


def generate(llm, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in out]


def score(llm, prompts: list[list[int]], completions: list[list[int]]) -> float:
    """Seconds for the teacher to score each prompt and completion in one prefill."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, completions)], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="bench-out/speculative.json")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--keep-layers", type=int, default=24, help="theta: SmolLM2 with this many of its 30 layers")
    parser.add_argument("--quick", action="store_true", help="the tiny pair, small sizes")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if args.quick:
        teacher, theta = (str(p) for p in tiny_models.tiny_pair())
        args.batch, args.tokens, args.gammas = 2, 8, [2]
    else:
        teacher, theta = str(models.smollm2()), str(models.smollm2_pruned(args.keep_layers))
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    work = workloads(tokenizer, args.batch)
    longest = max(len(p) for t, _ in work.values() for p in t)
    max_len = longest + args.tokens + 2 * max(args.gammas) + 8  # the speculative mode keeps 2γ free
    report: dict = {"teacher": teacher, "theta": theta, "batch": args.batch, "tokens": args.tokens, "workloads": {}}
    results = {name: {} for name in work}
    # The peers: theta alone, then the teacher's scoring prefill.
    llm = engine(theta, "theta", args.batch, max_len)
    completions = {}
    for name, (_, theta_prompts) in work.items():
        generate(llm, theta_prompts[:1], 4)  # warm-up
        results[name]["theta_s"], completions[name] = generate(llm, theta_prompts, args.tokens)
    del llm
    llm = engine(teacher, "teacher", args.batch, max_len)
    for name, (teacher_prompts, _) in work.items():
        score(llm, teacher_prompts[:1], completions[name][:1])
        results[name]["teacher_prefill_s"] = score(llm, teacher_prompts, completions[name])
    del llm
    # Lockstep.
    with OptimalSamplingDual(
        teacher, theta, alpha_method="kl_symmetry", max_num_seqs=args.batch, max_model_len=max_len, use_tqdm=False
    ) as dual:
        for name, (teacher_prompts, theta_prompts) in work.items():
            dual.generate(theta_prompts[:1], teacher_prompts=teacher_prompts[:1], max_tokens=4)
            before = dual.get_sync_statistics()["teacher_steps"]
            start = time.perf_counter()
            dual.generate(
                theta_prompts, teacher_prompts=teacher_prompts, max_tokens=args.tokens, min_tokens=args.tokens
            )
            results[name]["lockstep_s"] = time.perf_counter() - start
            results[name]["lockstep_steps"] = dual.get_sync_statistics()["teacher_steps"] - before
    # The speculative mixture, per γ.
    for gamma in args.gammas:
        with OptimalSamplingDual(
            teacher,
            theta,
            alpha_method="kl_symmetry",
            mode="speculative",
            num_speculative_tokens=gamma,
            max_num_seqs=args.batch,
            max_model_len=max_len,
            use_tqdm=False,
        ) as dual:
            for name, (teacher_prompts, _) in work.items():
                dual.generate(teacher_prompts[:1], max_tokens=4)
                before = dual.get_sync_statistics()
                start = time.perf_counter()
                # The mode serves no min_tokens: a sample may end at EOS, so its speed counts the tokens drawn.
                out = dual.generate(teacher_prompts, max_tokens=args.tokens)
                wall = time.perf_counter() - start
                after = dual.get_sync_statistics()
                drafted = after["drafted"] - before["drafted"]
                steps = after["teacher_steps"] - before["teacher_steps"]
                results[name][f"speculative_{gamma}"] = {
                    "s": wall,
                    "tokens": sum(out.num_tokens),
                    "acceptance": (after["accepted"] - before["accepted"]) / max(drafted, 1),
                    "engine_steps": steps,
                }
    total = args.batch * args.tokens
    for name, r in results.items():
        peers = total / (r["theta_s"] + r["teacher_prefill_s"])
        figures = {
            "tok_s": {"peers": peers, "lockstep": total / r["lockstep_s"]},
            "dual_vs_student_plus_teacher_prefill": {"lockstep": total / r["lockstep_s"] / peers},
            "acceptance": {},
            "step_ms": {"lockstep": 1e3 * r["lockstep_s"] / max(r["lockstep_steps"], 1)},
        }
        for gamma in args.gammas:
            v = r[f"speculative_{gamma}"]
            figures["tok_s"][f"speculative_{gamma}"] = v["tokens"] / v["s"]
            figures["dual_vs_student_plus_teacher_prefill"][f"speculative_{gamma}"] = v["tokens"] / v["s"] / peers
            figures["acceptance"][gamma] = v["acceptance"]
            figures["step_ms"][f"speculative_{gamma}"] = 1e3 * v["s"] / max(v["engine_steps"], 1)
        report["workloads"][name] = {"seconds": r, **figures}
        print(name, json.dumps(figures), flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
