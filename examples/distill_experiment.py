"""The pre-registered experiment of docs/distillation.md: are the mixture's samples better states for on-policy
distillation than either model's own?

Four arms train the same student from the same start, differing only in the distribution the training states are
sampled from:

  student        α = 0: the student's own samples (on-policy distillation as published)
  teacher        α = 1: the teacher's samples
  kl_symmetry    α per token, dual-sampling's default
  trust_region   α per token, the largest with KL(q_α‖π_θ) ≤ ε (trust-region behaviour blending's rule), ε falling
                 linearly by a quarter of its start a round: 0.8, 0.6, 0.4, 0.2 nats over the four rounds. It never
                 reaches 0, so this arm never returns to the student's own samples as the published method does;
                 its verdict is on this schedule only. ε chosen by --pilot, before the run

Held equal across arms: the loss (the per-prefix reverse KL over the whole vocabulary), no importance
weighting, the learning rate, the optimizer steps, and the generated tokens of every round (draws continue until the
budget is met; the last sample is cut). Seeds are paired: a seed fixes the prompt order and the sampling seeds of
every arm, and each arm trains on that order's problems in sequence (a problem counts as used once a sample of it is
trained on). The run of docs/distillation.json predates that accounting: a draw of 8 problems counted all 8 even when
fewer samples were taken, so its arms of one seed shared only part of their problems (the doc gives the counts).

The primary metric, fixed before the run: the final student's KL(π_θ‖π_t) per token on its own samples (48 held-out
problems, 2 samples each at temperature 1, at most 128 tokens; exact sums over the vocabulary in float64, transformers
forwards). The decision rule and the secondary metrics are in docs/distillation.md ("Design").

Each (arm, seed) cell resumes on its own: an interrupted run loses at most the round in progress, and a finished cell
(its cell.json) is never run again. One dual engine serves every cell (its alpha method is set per cell).

    python examples/distill_experiment.py --pilot --output bench-out/distill       # ε for trust_region, minutes
    python examples/distill_experiment.py --output bench-out/distill               # make experiment-distill
    python examples/distill_experiment.py --report bench-out/distill               # analysis of the finished cells
    python examples/distill_experiment.py --quick --output /tmp/dx                 # the tiny pair, a smoke run

Writes, under --output: design.json, references.json (the teacher's samples and the human solutions), one folder per
cell with its metrics.jsonl and cell.json, the final student of the first seed of every arm, and (--report)
results.json, distillation.png and the Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dual_sampling import ModelsAndPrompts, models
from dual_sampling.distill import DistillConfig, Distiller
from dual_sampling.distill.compare import bootstrap_interval, sign_flip_p
from dual_sampling.distill.evaluate import continuation_logp, distinct_n, divergence_sums, repetition_rate, sample
from dual_sampling.options import EngineOptions, SamplingOptions
from dual_sampling.run_output import remove_path, write_no_follow
from dual_sampling.testing import tiny_models

DATA = Path(__file__).resolve().parent / "data" / "gsm8k" / "subset.jsonl"

PURE_ARMS = ("student", "teacher")
MIXTURE_ARMS = ("kl_symmetry", "trust_region")
ARMS = (*PURE_ARMS, *MIXTURE_ARMS)

PRIMARY = "own_kl_student_teacher"
"""The primary metric: KL(π_θ‖π_t) per token on the student's own held-out samples (lower is better)."""


@dataclass(frozen=True)
class Design:
    """The experiment's settings, written to design.json before the first cell; a resumed run must match them."""

    keep_layers: int = 20
    """Layers of SmolLM2-135M-Instruct's 30 that the student keeps (a start far from the teacher)."""
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    """Paired seeds: each fixes the prompt order and the sampling seeds of every arm (and, since the loop counts only
    the problems trained on, the problems every arm trains on)."""
    rounds: int = 4
    """Sample-train-update rounds per cell."""
    tokens_per_round: int = 1024
    """Generated tokens trained on per round, equal in every arm."""
    steps_per_round: int = 4
    """AdamW steps per round."""
    learning_rate: float = 5e-5
    """AdamW learning rate (constant)."""
    loss_top_k: int = 64
    """Each model's top k recorded per token with both log-probabilities (the records' dense signal; the
    ``reverse_full`` loss reads the teacher's rows instead)."""
    max_tokens: int = 128
    """Longest sample, training and held out."""
    kl_budget: float = 0.8
    """trust_region's starting ε (nats), falling linearly to ε/rounds in the last round (0.2 nats: never 0, the
    warm-up being as long as the run; ``DistillConfig.kl_budget_warmup_rounds``). Chosen by --pilot before the run, by
    a rule fixed before it: the budget of PILOT_BUDGETS whose mean α on the starting student's first samples is
    closest to kl_symmetry's (on the 20-layer student: 0.489 at ε = 0.8 against 0.500; 0.357 at 0.4, 0.672 at 1.6),
    so that both mixture arms start from about the same blend and differ in how they place and anneal it."""
    eval_prompts: int = 48
    """Held-out problems: the data file's last rows."""
    eval_samples: int = 2
    """The student's samples per held-out problem (the primary metric)."""
    quick: bool = False
    """The tiny random pair and short samples: a smoke run of the machinery, not evidence."""


def base_config(design: Design, out: Path, teacher: Path, theta: Path, prompts: Path) -> DistillConfig:
    return DistillConfig(
        prompts=str(prompts),
        output=str(out),
        source=ModelsAndPrompts(str(teacher), str(theta), prompt_field="question", chat_template=not design.quick),
        eval_prompts=design.eval_prompts,
        eval_every=0,  # this experiment evaluates each final student itself
        rounds=design.rounds,
        prompts_per_round=8,
        tokens_per_round=design.tokens_per_round,
        steps_per_round=design.steps_per_round,
        learning_rate=design.learning_rate,
        loss="reverse_full",
        weighting="none",
        loss_top_k=design.loss_top_k,
        max_sampler_mismatch=0.05,
        resume=True,
        plot=False,
        sampling=SamplingOptions(max_tokens=design.max_tokens, temperature=1.0),
        engine=EngineOptions(
            max_num_seqs=16,
            max_model_len=1024,
            kv_cache_memory_bytes=1 << 30,
            max_dense_logprobs=design.loss_top_k,
            use_tqdm=False,
        ),
    )


def arm_alpha(arm: str, design: Design) -> tuple[str, dict[str, Any]]:
    """The alpha method and configuration an arm samples with (trust_region: its starting budget)."""
    return {
        "student": ("fixed", {"alpha": 0.0}),
        "teacher": ("fixed", {"alpha": 1.0}),
        "kl_symmetry": ("kl_symmetry", {}),
        "trust_region": ("trust_region", {"kl_budget": design.kl_budget}),
    }[arm]


# ---------------------------------------------------------------------------------------------------- held-out sets


def strip_calculator(answer: str) -> str:
    """A GSM8K solution without its calculator annotations (``<<48/2=24>>``), as a person writes it."""
    return re.sub(r"<<[^>]*>>", "", answer)


def theta_prompts(tokenizer: Any, rows: list[dict], design: Design) -> list[str]:
    """The problems as the student sees them (no hint; chat template but for --quick), as the Distiller renders them."""
    from dual_sampling.prompts import Renderer

    renderer = Renderer(tokenizer, None, None, not design.quick)
    return [renderer.prompt(renderer.user_messages(r["question"], None, r)[1], None) for r in rows]


class HeldOut:
    """The held-out problems rendered as the student sees them, and the fixed sequences scored for every student:
    the teacher's samples at temperature 1 (drawn once) and the human solutions, with the teacher's rows on them
    computed once. Every sample here is drawn by transformers (``evaluate.sample``), independently of the engine."""

    def __init__(self, tokenizer: Any, eos_ids: list[int], rows: list[dict], design: Design, out: Path, teacher: Any):
        self.design, self.eos_ids, self.teacher = design, eos_ids, teacher
        self.vocab = len(tokenizer)
        self.prompt_ids = [
            tokenizer.encode(p, add_special_tokens=False) for p in theta_prompts(tokenizer, rows, design)
        ]
        human = [
            [*tokenizer.encode(strip_calculator(r.get("answer", "")), add_special_tokens=False), eos_ids[0]][
                : design.max_tokens
            ]
            for r in rows
        ]
        saved = out / "references.json"
        if saved.exists():
            teacher_samples = json.loads(saved.read_text())["teacher_samples"]
        else:
            teacher_samples = sample(teacher, self.prompt_ids, 1, design.max_tokens, eos_ids, seed=1_000_003)
            write_no_follow(saved, json.dumps({"teacher_samples": teacher_samples, "human": human}))
        self.fixed = {"teacher_samples": [group[0] for group in teacher_samples], "human": human}
        # The teacher's rows on the fixed sequences, once for every student (float32: 1e-7 relative).
        self.teacher_fixed = [
            [r.float() for r in continuation_logp(teacher, p, [t, h], self.vocab)]
            for p, t, h in zip(self.prompt_ids, self.fixed["teacher_samples"], human)
        ]

    def score(self, student: Any, seed: int) -> dict[str, Any]:
        """Every metric of one student (its own samples drawn with ``seed``): per-token figures pooled over tokens,
        per-sequence ones averaged. Each prompt's forward runs once per model; its continuations in one batch."""
        n = self.design.eval_samples
        own = sample(student, self.prompt_ids, n, self.design.max_tokens, self.eos_ids, seed)
        sums: dict[str, list[dict[str, float]]] = {"own": [], "teacher_samples": [], "human": []}
        was_training = student.training
        student.eval()
        try:
            for i, prompt in enumerate(self.prompt_ids):
                fixed = [self.fixed["teacher_samples"][i], self.fixed["human"][i]]
                s_rows = continuation_logp(student, prompt, [*own[i], *fixed], self.vocab)
                t_rows = continuation_logp(self.teacher, prompt, own[i], self.vocab) + self.teacher_fixed[i]
                for j, (ls, lt) in enumerate(zip(s_rows, t_rows)):
                    name = "own" if j < n else ("teacher_samples", "human")[j - n]
                    sums[name].append(divergence_sums(ls, lt))
        finally:
            student.train(was_training)
        metrics: dict[str, Any] = {}
        for name, rows in sums.items():
            tokens = sum(r["tokens"] for r in rows)
            for key in ("kl_student_teacher", "kl_teacher_student"):
                metrics[f"{name}_{key}"] = sum(r[key] for r in rows) / tokens
        rows = sums["own"]
        metrics["own_kl_student_teacher_per_sequence"] = statistics.fmean(r["kl_student_teacher"] for r in rows)
        metrics["own_student_entropy"] = sum(r["student_entropy"] for r in rows) / sum(r["tokens"] for r in rows)
        # The teacher's entropy on the same states: the scale the KLs are read against.
        metrics["own_teacher_entropy"] = sum(r["teacher_entropy"] for r in rows) / sum(r["tokens"] for r in rows)
        metrics["own_tokens"] = sum(r["tokens"] for r in rows)
        own_pairs = [(p, s) for p, group in zip(self.prompt_ids, own) for s in group]
        texts = [s for _, s in own_pairs]
        # An answer ended when its last token is an EOS id (the sampler stops there); one cut at max_tokens did not.
        ended = [bool(s) and s[-1] in self.eos_ids for s in texts]
        metrics["own_end_rate"] = statistics.fmean(ended)
        metrics["own_per_sequence"] = [
            {"tokens": r["tokens"], "kl_student_teacher": r["kl_student_teacher"], "ended": e}
            for r, e in zip(rows, ended)
        ]
        metrics["own_length"] = statistics.fmean(map(len, texts))
        metrics["own_repetition"] = statistics.fmean(map(repetition_rate, texts))
        metrics["own_distinct_2"] = statistics.fmean(d for d in map(distinct_n, texts) if d == d)
        return metrics


# ---------------------------------------------------------------------------------------------------- cells


def run_cell(
    arm: str, seed: int, design: Design, base: DistillConfig, dual: Any, held: HeldOut, first: bool
) -> dict[str, Any]:
    """Train one (arm, seed) cell to its last round (resuming), evaluate its final student, write cell.json."""
    folder = Path(base.output) / arm / f"seed-{seed}"
    done = folder / "cell.json"
    if done.exists():
        return json.loads(done.read_text())
    method, alpha_config = arm_alpha(arm, design)
    cfg = dataclasses.replace(
        base,
        output=str(folder),
        engine=dataclasses.replace(base.engine, alpha_method=method, alpha_config=alpha_config),
        sampling=dataclasses.replace(base.sampling, seed=seed),
        kl_budget_warmup_rounds=design.rounds if arm == "trust_region" else 0,
    )
    dual.update_alpha(method, **alpha_config)
    t0 = time.perf_counter()
    distiller = Distiller(cfg, dual)
    rounds = distiller.run()
    t1 = time.perf_counter()
    metrics = held.score(distiller.student, seed=2_000_003 + seed)
    cell = {
        "arm": arm,
        "seed": seed,
        **{k: v for k, v in metrics.items() if k != "own_per_sequence"},
        "tokens_per_round": [r["tokens"] - p["tokens"] for p, r in itertools.pairwise(rounds)],
        "mean_alpha_per_round": [r["mean_alpha"] for r in rounds[1:]],
        "kl_budget_per_round": [r.get("kl_budget") for r in rounds[1:]],
        "sampler_mismatch_max": max(r["sampler_mismatch_max"] for r in rounds[1:]),
        "train_wall_s": t1 - t0,  # this process's share (a resumed cell counts its last part only)
        "rounds_wall_s": rounds[-1]["wall_s"],
        "eval_wall_s": time.perf_counter() - t1,
        "per_sequence": metrics["own_per_sequence"],
        "rounds": rounds,
    }
    write_no_follow(done, json.dumps(cell))
    if not first:  # the first seed's final student is kept for others to evaluate; the rest would fill the disk
        remove_path(folder / "checkpoints")
    return cell


def start_cell(base: DistillConfig, held: HeldOut) -> dict[str, Any]:
    """The starting student's metrics (with seed 0's held-out samples), written once to start.json."""
    import torch
    from transformers import AutoModelForCausalLM

    done = Path(base.output) / "start.json"
    if done.exists():
        return json.loads(done.read_text())
    student = AutoModelForCausalLM.from_pretrained(base.source.theta, dtype=torch.float32)
    start = {k: v for k, v in held.score(student, seed=2_000_003).items() if k != "own_per_sequence"}
    write_no_follow(done, json.dumps(start))
    return start


PILOT_BUDGETS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)
"""The starting budgets ε (nats) the pilot tries."""


def pilot(design: Design, base: DistillConfig, dual: Any, rows: list[dict], out: Path) -> None:
    """Mean α of the starting student's first round at several budgets, beside kl_symmetry's: the choice of ε."""
    prompts = theta_prompts(dual.tokenizer, rows[:16], design)
    dual.update_theta(base.source.theta, version="start")
    found = {}
    for method, config in [("kl_symmetry", {})] + [("trust_region", {"kl_budget": e}) for e in PILOT_BUDGETS]:
        dual.update_alpha(method, **config)
        out_ = dual.generate(prompts, max_tokens=design.max_tokens, temperature=1.0, seed=77, use_tqdm=False)
        alphas = [a for req in out_.requests for s in req.samples for a in s.alpha]
        tokens = sum(len(s.token_ids) for req in out_.requests for s in req.samples)
        label = method if not config else f"trust_region ε={config['kl_budget']}"
        found[label] = {"mean_alpha": statistics.fmean(alphas), "tokens": tokens}
        print(f"{label}: mean α {found[label]['mean_alpha']:.3f} over {tokens} tokens", flush=True)
    write_no_follow(out / "pilot.json", json.dumps(found, indent=1))


# ---------------------------------------------------------------------------------------------------- analysis

SECONDARY = [
    "own_kl_student_teacher_per_sequence",
    "own_kl_teacher_student",
    "teacher_samples_kl_student_teacher",
    "teacher_samples_kl_teacher_student",
    "human_kl_student_teacher",
    "human_kl_teacher_student",
    "own_repetition",
    "own_distinct_2",
    "own_length",
    "own_student_entropy",
    "own_teacher_entropy",
    "own_end_rate",
]
"""The secondary metrics; the last two are saved by cells run after docs/distillation.json was (its cells lack them)."""


def analyse(cells: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per arm: each metric's median and range over seeds; per mixture arm: the decision rule on the primary metric
    against each pure arm (paired by seed; lower is better, so the difference is pure − mixture)."""
    by = {(c["arm"], c["seed"]): c for c in cells}
    complete = [s for s in seeds if all((a, s) in by for a in ARMS)]
    table: dict[str, Any] = {}
    for arm in ARMS:
        table[arm] = {}
        for key in [PRIMARY, *SECONDARY]:
            values = [by[(arm, s)][key] for s in complete if key in by[(arm, s)]]
            if values and len(values) == len(complete):  # a metric older cells lack is not summarised from a part
                table[arm][key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    verdicts: dict[str, Any] = {}
    for mix in MIXTURE_ARMS:
        against = {}
        for pure in PURE_ARMS:
            d = [by[(pure, s)][PRIMARY] - by[(mix, s)][PRIMARY] for s in complete]
            if not d:
                continue
            lo, hi = bootstrap_interval(d)
            p = sign_flip_p(d)
            against[pure] = {
                "differences": d,
                "mean": statistics.fmean(d),
                "p_one_sided": p,
                "bootstrap_95": [lo, hi],
                "beats": p < 0.05 and lo > 0,
            }
        verdicts[mix] = {"against": against, "wins": bool(against) and all(v["beats"] for v in against.values())}
    return {"seeds_complete": complete, "summary": table, "verdicts": verdicts}


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [PRIMARY, *SECONDARY]
    cols = 4
    rows_ = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.2 * rows_), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for i, arm in enumerate(ARMS):
            values = [c[key] for c in cells if c["arm"] == arm and key in c]
            ax.scatter([i] * len(values), values, s=14, alpha=0.7)
            if values:
                ax.hlines(statistics.median(values), i - 0.3, i + 0.3, color="black")
        ax.set_xticks(range(len(ARMS)), ARMS, fontsize=7)
        ax.set_title(key + (" (primary)" if key == PRIMARY else ""), fontsize=8)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown_table(result: dict[str, Any], start: dict[str, Any] | None) -> str:
    keys = [PRIMARY, "own_kl_teacher_student", "teacher_samples_kl_student_teacher", "human_kl_student_teacher"]
    keys += ["own_repetition", "own_distinct_2", "own_length", "own_student_entropy"]
    head = "| arm | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys) + "\n"
    lines = []
    if start:
        lines.append("| start | " + " | ".join(f"{start[k]:.3f}" for k in keys) + " |")
    for arm, row in result["summary"].items():
        cells = [f"{row[k]['median']:.3f} ({row[k]['min']:.3f}–{row[k]['max']:.3f})" if k in row else "–" for k in keys]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    verdict = []
    for mix, v in result["verdicts"].items():
        for pure, a in v["against"].items():
            verdict.append(
                f"- {mix} vs {pure}: mean difference {a['mean']:+.4f} nats/token (pure − mixture), one-sided p = "
                f"{a['p_one_sided']:.4f}, bootstrap 95 % [{a['bootstrap_95'][0]:+.4f}, {a['bootstrap_95'][1]:+.4f}]"
                f" → {'beats' if a['beats'] else 'does not beat'}"
            )
        verdict.append(f"- **{mix}: {'wins' if v['wins'] else 'does not win'}** by the rule.")
    return head + "\n".join(lines) + "\n\n" + "\n".join(verdict)


def report(out: Path) -> dict[str, Any]:
    design = json.loads((out / "design.json").read_text())
    seeds = design["seeds"]
    cells = [json.loads(p.read_text()) for p in sorted(out.glob("*/seed-*/cell.json"))]
    start = json.loads((out / "start.json").read_text()) if (out / "start.json").exists() else None
    result = analyse(cells, seeds)
    pilot_file = out / "pilot.json"
    full = {
        "design": design,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "pilot": json.loads(pilot_file.read_text()) if pilot_file.exists() else None,
        "start": start,
        **result,
        "cells": [{k: v for k, v in c.items() if k != "rounds"} | {"rounds": c["rounds"]} for c in cells],
    }
    write_no_follow(out / "results.json", json.dumps(full, indent=1))
    plot(cells, out / "distillation.png")
    print(markdown_table(result, start))
    return full


# ---------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="bench-out/distill")
    parser.add_argument("--quick", action="store_true", help="the tiny random pair: a smoke run, not evidence")
    parser.add_argument("--pilot", action="store_true", help="print the mean α of trust_region budgets and stop")
    parser.add_argument("--report", action="store_true", help="analyse the finished cells in --output, run nothing")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the design's six)")
    parser.add_argument("--kl-budget", type=float, help="trust_region's starting ε (default: the design's)")
    parser.add_argument("--arms", default=",".join(ARMS), help="a subset of the arms, for a partial run")
    args = parser.parse_args()
    out = Path(args.output)
    if args.report:
        report(out)
        return
    changes: dict[str, Any] = {"quick": args.quick}
    if args.seeds:
        changes["seeds"] = tuple(int(s) for s in args.seeds.split(","))
    if args.kl_budget is not None:
        changes["kl_budget"] = args.kl_budget
    if args.quick:
        changes.update(
            keep_layers=0, seeds=changes.get("seeds", (0, 1)), rounds=2, tokens_per_round=48, max_tokens=12,
            eval_prompts=4, loss_top_k=16, steps_per_round=2, learning_rate=1e-3,
        )  # fmt: skip
    design = Design(**changes)
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; the arms are {list(ARMS)}")
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "design.json"
    mine = json.loads(json.dumps(dataclasses.asdict(design)))
    if saved.exists() and not args.pilot:
        before = json.loads(saved.read_text())
        changed = sorted(k for k in mine if before.get(k) != mine[k])
        if changed:
            raise SystemExit(f"{out} holds a run of another design (differs in {changed}); use another --output")
    if args.quick:
        teacher, theta = tiny_models.tiny_pair("same")
        prompts = out / "quick_prompts.jsonl"
        prompts.write_text(
            "".join(
                json.dumps({"question": f"Count from {i} to {i + 5}.", "answer": "1 2 3"}) + "\n" for i in range(60)
            )
        )
    else:
        teacher, theta = models.smollm2(), models.smollm2_pruned(design.keep_layers)
        prompts = DATA
    base = base_config(design, out, teacher, theta, prompts)
    rows = [json.loads(x) for x in prompts.read_text().splitlines() if x]
    import torch
    from transformers import AutoModelForCausalLM

    from dual_sampling import OptimalSamplingDual

    t0 = time.perf_counter()
    with OptimalSamplingDual(str(teacher), str(theta), **dataclasses.asdict(base.engine)) as dual:
        if args.pilot:
            pilot(design, base, dual, rows[: -design.eval_prompts], out)
            return
        if not saved.exists():
            write_no_follow(saved, json.dumps(mine, indent=1))
        teacher_model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
        eos = sorted(dual.eos_token_ids)
        held = HeldOut(dual.tokenizer, eos, rows[-design.eval_prompts :], design, out, teacher_model)
        start = start_cell(base, held)
        print(f"start: {PRIMARY} {start[PRIMARY]:.4f} at {time.perf_counter() - t0:.0f} s", flush=True)
        for seed in design.seeds:  # seed-major: a run cut short still has every arm of its first seeds
            for arm in arms:
                cell = run_cell(arm, seed, design, base, dual, held, seed == design.seeds[0])
                print(
                    f"{arm} seed {seed}: {PRIMARY} {cell[PRIMARY]:.4f}, tokens/round {cell['tokens_per_round']}, "
                    f"at {time.perf_counter() - t0:.0f} s",
                    flush=True,
                    file=sys.stderr,
                )
    report(out)


if __name__ == "__main__":
    main()
