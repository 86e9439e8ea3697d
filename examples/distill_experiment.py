"""The experiment: what are samples of the mixture worth for on-policy distillation?

Sample sources compared at an equal budget of generated tokens (same prompts, rounds, optimizer steps, loss, learning
rate and held-out set), several seeds each:

  teacher        α = 1: teacher samples (sequence-level KD states)
  student        α = 0: the student's own samples (pure on-policy)
  fixed_0.5      α = 0.5 at every token
  kl_symmetry    α chosen per token (dual-sampling's default)
  ess_balance    α chosen per token for balanced importance weights
  trl            TRL's DistillationTrainer with its own on-policy generation (transformers) at its default loss
                 (generalised JSD, beta = 1: reverse KL on the full vocabulary), same student, teacher, prompts,
                 completions per step, max tokens, steps and learning rate

Our arms train with dual_sampling.distill (top-k forward KL on the recorded teacher signal, sequence_mean weights);
each arm starts one dual engine and runs its seeds on it in turn (the student is reset through update_theta). The
held-out metrics are those of dual_sampling.distill.evaluate, for every arm alike.

    python examples/distill_experiment.py --output docs/distillation        # SmolLM2, about 45 minutes here
    python examples/distill_experiment.py --quick --output /tmp/dx           # the tiny pair, a minute

Writes results.json (every round of every run) and distillation.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from dual_sampling import ModelsAndPrompts, models
from dual_sampling.distill import DistillConfig, Distiller
from dual_sampling.distill.evaluate import EvalSet, evaluate
from dual_sampling.options import EngineOptions, SamplingOptions
from dual_sampling.testing import tiny_models

ARMS: dict[str, dict[str, Any]] = {
    "teacher": {"alpha_method": "fixed", "alpha_config": {"alpha": 1.0}},
    "student": {"alpha_method": "fixed", "alpha_config": {"alpha": 0.0}},
    "fixed_0.5": {"alpha_method": "fixed", "alpha_config": {"alpha": 0.5}},
    "kl_symmetry": {"alpha_method": "kl_symmetry"},
    "ess_balance": {"alpha_method": "ess_balance"},
    "trl": {},
}
GSM8K = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "gsm8k" / "train.jsonl"


def our_arm(
    arm: str, base: DistillConfig, seeds: list[int], out: Path, eval_set: EvalSet | None
) -> tuple[list[list[dict]], EvalSet]:
    from dual_sampling import OptimalSamplingDual

    engine = dataclasses.replace(base.engine, **ARMS[arm])
    runs = []
    with OptimalSamplingDual(
        base.source.teacher, base.source.theta, **{**dataclasses.asdict(engine), "use_tqdm": False}
    ) as dual:
        for seed in seeds:
            cfg = dataclasses.replace(
                base,
                output=str(out / arm / f"seed-{seed}"),
                engine=engine,
                sampling=dataclasses.replace(base.sampling, seed=seed),
            )
            d = Distiller(cfg, dual, eval_set)
            eval_set = d.eval_set
            runs.append(d.run())
    return runs, eval_set


def trl_arm(base: DistillConfig, seeds: list[int], out: Path, eval_set: EvalSet) -> list[list[dict]]:
    """TRL's DistillationTrainer, evaluated with our held-out metrics after every ``steps_per_round`` steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base.source.theta)
    rows = [json.loads(x) for x in Path(base.prompts).read_text().splitlines() if x][: -base.eval_prompts]
    teacher = AutoModelForCausalLM.from_pretrained(base.source.teacher, dtype=torch.float32).eval()
    return [trl_run(base, seed, rows, teacher, tokenizer, out, eval_set) for seed in seeds]


def trl_run(
    base: DistillConfig, seed: int, rows: list[dict], teacher: Any, tokenizer: Any, out: Path, eval_set: EvalSet
) -> list[dict]:
    import random

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)  # the order our arms walk the prompts in
    used = [order[i % len(order)] for i in range(base.rounds * base.prompts_per_round)]
    prompts = [[{"role": "user", "content": rows[i][base.source.prompt_field]}] for i in used]
    student = AutoModelForCausalLM.from_pretrained(base.source.theta, dtype=torch.float32)
    history: list[dict] = []
    start = time.perf_counter()
    eval_total = 0.0

    def record(round_: int) -> None:
        nonlocal eval_total
        t0 = time.perf_counter()
        m = evaluate(student, teacher, eval_set, len(tokenizer), base.eval_max_tokens)
        spent = time.perf_counter() - t0
        history.append({"round": round_, **m, "eval_s": spent, "wall_s": t0 - start - eval_total})
        eval_total += spent

    class EvalEveryRound(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % base.steps_per_round == 0:
                record(state.global_step // base.steps_per_round)

    args = DistillationConfig(
        output_dir=str(out / "trl" / f"seed-{seed}"),
        per_device_train_batch_size=base.prompts_per_round // base.steps_per_round,
        gradient_accumulation_steps=1,
        max_steps=base.rounds * base.steps_per_round,
        learning_rate=base.learning_rate,
        lr_scheduler_type="constant",  # as our arms' AdamW: not a loss setting, so held equal
        max_completion_length=base.sampling.max_tokens,
        temperature=base.sampling.temperature,
        bf16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        seed=seed,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    record(0)
    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[EvalEveryRound()],
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "num_tokens" in h]
    for h in history[1:]:
        step = h["round"] * base.steps_per_round
        h["tokens_seen_by_trl"] = next((float(x["num_tokens"]) for x in logged if x.get("step") == step), None)
    return history


HEADLINE = ["kl_teacher_student", "kl_student_teacher", "teacher_logp_of_greedy", "repetition_rate"]


def summarise(results: dict[str, list[list[dict]]]) -> dict[str, dict[str, Any]]:
    """Per arm: each headline metric's final-round median and range over seeds, and the mean split of wall time."""
    table = {}
    for arm, runs in results.items():
        final = [run[-1] for run in runs]
        row: dict[str, Any] = {}
        for key in [*HEADLINE, "mean_alpha", "ess_sequence", "ess_token"]:
            values = [f[key] for f in final if key in f]
            if values:
                row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        for key in ("sample_s", "train_s", "update_s", "eval_s"):
            values = [r[key] for run in runs for r in run[1:] if key in r]
            if values:
                row[key + "_per_round"] = statistics.fmean(values)
        # Wall time of the rounds without the held-out evaluations (TRL's runs record it so already).
        row["wall_s_without_eval"] = statistics.fmean(
            run[-1]["wall_s"] - (sum(r["eval_s"] for r in run[1:]) if "sample_s" in run[-1] else 0.0) for run in runs
        )
        table[arm] = row
    return table


def plot(results: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "kl_teacher_student": "KL(π_t‖π_θ) / token (held out)",
        "kl_student_teacher": "KL(π_θ‖π_t) / token (held out)",
        "teacher_logp_of_greedy": "teacher log-prob / token of θ's greedy",
        "repetition_rate": "repeated 4-grams in θ's greedy",
    }
    fig, axes = plt.subplots(1, len(titles), figsize=(4.2 * len(titles), 3.8))
    for ax, (key, title) in zip(axes, titles.items()):
        for arm, runs in results.items():
            rounds = [r["round"] for r in runs[0]]
            per_round = [[run[i][key] for run in runs] for i in range(len(rounds))]
            med = [statistics.median(v) for v in per_round]
            line = ax.plot(rounds, med, marker="o", label=arm)[0]
            ax.fill_between(
                rounds, [min(v) for v in per_round], [max(v) for v in per_round], alpha=0.15, color=line.get_color()
            )
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("round")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(summary: dict[str, dict[str, Any]]) -> str:
    """The headline table: each arm's final-round median over seeds, its range, and the mean time per round."""
    head = (
        "| arm | KL(π_t‖π_θ) | KL(π_θ‖π_t) | teacher log-prob / token of θ's greedy | repetition | mean α | ESS/n "
        "| sample / train / update s per round | wall s, all rounds (no eval) |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []

    def cell(row: dict[str, Any], key: str, digits: int = 3) -> str:
        if key not in row:
            return "–"
        v = row[key]
        return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}–{v['max']:.{digits}f})"

    for arm, row in summary.items():
        split = "–"
        if "train_s_per_round" in row:
            split = (
                f"{row['sample_s_per_round']:.1f} / {row['train_s_per_round']:.1f} / {row['update_s_per_round']:.2f}"
            )
        rows.append(
            f"| {arm} | {cell(row, 'kl_teacher_student')} | {cell(row, 'kl_student_teacher')} "
            f"| {cell(row, 'teacher_logp_of_greedy')} | {cell(row, 'repetition_rate')} | {cell(row, 'mean_alpha', 2)} "
            f"| {cell(row, 'ess_sequence', 2)} | {split} | {row['wall_s_without_eval']:.0f} |"
        )
    return head + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny random pair and a few prompts")
    parser.add_argument("--output", default="bench-out/distill")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts-per-round", type=int, default=16)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--keep-layers", type=int, default=24, help="layers of the pruned SmolLM2 student")
    parser.add_argument("--table", metavar="RESULTS", help="print the Markdown table of a results.json, run nothing")
    args = parser.parse_args()
    if args.table:
        print(markdown_table(summarise(json.loads(Path(args.table).read_text())["runs"])))
        return
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        teacher, theta = tiny_models.tiny_pair("same")
        prompts = out / "quick_prompts.jsonl"
        prompts.write_text("".join(json.dumps({"question": f"Count from {i} to {i + 5}."}) + "\n" for i in range(60)))
    else:
        teacher, theta = models.smollm2(), models.smollm2_pruned(args.keep_layers)
        prompts = GSM8K
    base = DistillConfig(
        prompts=str(prompts),
        output=str(out),
        source=ModelsAndPrompts(str(teacher), str(theta), **DistillConfig.PART_DEFAULTS["source"]),
        rounds=args.rounds,
        prompts_per_round=args.prompts_per_round,
        steps_per_round=args.steps_per_round,
        learning_rate=args.learning_rate,
        eval_prompts=16,
        eval_max_tokens=64 if not args.quick else 16,
        plot=False,
        sampling=SamplingOptions(max_tokens=args.max_tokens),
        engine=EngineOptions(max_num_seqs=8, max_model_len=1024, use_tqdm=False),
    )
    results: dict[str, list[list[dict]]] = {}
    eval_set = None
    arms = args.arms.split(",")
    t0 = time.perf_counter()
    for arm in [a for a in arms if a != "trl"]:
        results[arm], eval_set = our_arm(arm, base, seeds, out, eval_set)
        print(f"{arm}: done at {time.perf_counter() - t0:.0f} s", flush=True)
    if "trl" in arms:
        if eval_set is None:
            raise SystemExit("the trl arm reuses the held-out set of another arm: list one before it")
        results["trl"] = trl_arm(base, seeds, out, eval_set)
        print(f"trl: done at {time.perf_counter() - t0:.0f} s", flush=True)
    summary = summarise(results)
    report = {
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs",
        "pair": [str(teacher), str(theta)],
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "total_s": time.perf_counter() - t0,
        "summary": summary,
        "runs": results,
    }
    (out / "results.json").write_text(json.dumps(report, indent=1))
    plot(results, out / "distillation.png")
    print(markdown_table(summary))


if __name__ == "__main__":
    main()
