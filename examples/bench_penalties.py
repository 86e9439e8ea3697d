"""What the penalties on q cost: plain rows against penalised rows on one dual engine, side by side in one run.

    python examples/bench_penalties.py                      # SmolLM2 and its 24-layer prune, b = 8
    python examples/bench_penalties.py --quick              # the tiny pair, to check the script

``--batch`` held-out GSM8K questions (examples/data/gsm8k), exactly ``--tokens`` generated tokens each (min_tokens =
max_tokens, so no arm ends early and every arm decodes the same number of steps), temperature 1, kl_symmetry. Arms:
``plain``; ``repetition`` (repetition_penalty 1.2, which needs theta's log-normaliser and the prompt's tokens);
``presence_frequency`` (0.5 each); ``all`` (the three). The arms alternate, ``--repeats`` times each, so a drift of
the machine reaches them alike. Reported per arm: median seconds per generate call, its ratio to plain's, the
mixing time per step (the teacher processor's decision, from the engine's counters), and the rows the kernel handed
to the reference. Writes docs/penalties_benchmark.json unless ``--output`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dual_sampling import OptimalSamplingDual, models  # noqa: E402
from dual_sampling.testing import tiny_models  # noqa: E402

GSM8K = ROOT / "examples" / "data" / "gsm8k" / "subset.jsonl"
ARMS = {
    "plain": {},
    "repetition": {"repetition_penalty": 1.2},
    "presence_frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "all": {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(ROOT / "docs" / "penalties_benchmark.json"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep-layers", type=int, default=24, help="theta: SmolLM2 with this many of its 30 layers")
    parser.add_argument("--quick", action="store_true", help="the tiny pair, small sizes")
    args = parser.parse_args()
    if args.quick:
        teacher, theta = (str(p) for p in tiny_models.tiny_pair())
        args.batch, args.tokens, args.repeats = 2, 8, 1
    else:
        teacher, theta = str(models.smollm2()), str(models.smollm2_pruned(args.keep_layers))
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
    questions = [row["question"] for row in rows[-args.batch :]]
    timings: dict[str, list[float]] = {arm: [] for arm in ARMS}
    mixing: dict[str, list[float]] = {arm: [] for arm in ARMS}
    handed_back = dict.fromkeys(ARMS, 0)
    with OptimalSamplingDual(
        teacher, theta, alpha_method="kl_symmetry", max_num_seqs=args.batch, max_model_len=512, use_tqdm=False
    ) as dual:
        for settings in ARMS.values():  # warm-up: each arm's path compiled and cached before any timing
            dual.generate(questions[:1], max_tokens=4, **settings)
        for repeat in range(args.repeats):
            for arm, settings in ARMS.items():
                before = dual.get_sync_statistics()
                start = time.perf_counter()
                out = dual.generate(questions, max_tokens=args.tokens, min_tokens=args.tokens, seed=repeat, **settings)
                timings[arm].append(time.perf_counter() - start)
                after = dual.get_sync_statistics()
                assert all(n == args.tokens for n in out.num_tokens), out.num_tokens
                steps = after["teacher_steps"] - before["teacher_steps"]
                mixing[arm].append((after["mix_s"] - before["mix_s"]) / steps * 1e3)
                handed_back[arm] += int(after["kernel_handed_back"] - before["kernel_handed_back"])
    plain = statistics.median(timings["plain"])
    report = {
        "command": "python examples/bench_penalties.py" + (" --quick" if args.quick else ""),
        "teacher": Path(teacher).name,
        "theta": Path(theta).name,
        "batch": args.batch,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "arms": {
            arm: {
                "settings": ARMS[arm],
                "median_s": round(statistics.median(timings[arm]), 3),
                "runs_s": [round(t, 3) for t in timings[arm]],
                "ratio_to_plain": round(statistics.median(timings[arm]) / plain, 3),
                "mixing_ms_per_step": round(statistics.median(mixing[arm]), 3),
                "kernel_handed_back_rows": handed_back[arm],
            }
            for arm in ARMS
        },
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
