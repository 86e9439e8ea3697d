"""Seeds for the second distillation experiment: the power of its exact paired sign-flip tests, from the first
experiment's spread.

The second experiment (trust-region blending as published against α = 0) decides by two one-sided tests on per-seed
paired differences, both with ``dual_sampling.distill.compare.sign_flip_p`` at level 0.05:

1. non-inferiority on the student's own samples: KL(π_θ‖π_t) per token, margin 0.05 nats (trust_region − α = 0 below
   +0.05, tested as "the difference minus 0.05 is below 0");
2. superiority on the human reference solutions (the student's negative log-likelihood per token lower).

Trust-region blending "helps" only if both pass. This is an intersection-union rule: it is wrong only if a false
claim passes both tests, so each test at 0.05 keeps the rule's error at 0.05 and no correction for two tests is
needed; the report also gives the power at 0.025 each (Bonferroni), the conservative reading.

Power is simulated: per-seed differences drawn normal with the first experiment's standard deviation
(``docs/distillation.json``: trust_region − α = 0 on the primary metric, 6 seeds), the exact test run on each draw.
For test 1 the true difference is 0 (the arms equal), so the shifted differences have mean 0.05; for test 2 the
effect sizes listed are assumptions, at the spread of the first experiment's KL on the human solutions (the NLL
itself was not recorded per seed).

    python examples/distill_power.py --output docs/distillation_power.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

FIRST = Path(__file__).resolve().parent.parent / "docs" / "distillation.json"


def spreads() -> dict[str, float]:
    """The first experiment's seed-to-seed standard deviations of trust_region − α = 0 (nats per token)."""
    first = json.loads(FIRST.read_text())
    primary = first["verdicts"]["trust_region"]["against"]["student"]["differences"]
    by_seed: dict[int, dict[str, dict]] = defaultdict(dict)
    for cell in first["cells"]:
        by_seed[cell["seed"]][cell["arm"]] = cell
    human = [
        arms["trust_region"]["human_kl_student_teacher"] - arms["student"]["human_kl_student_teacher"]
        for arms in by_seed.values()
    ]
    return {"own_kl_student_teacher": statistics.stdev(primary), "human_kl_student_teacher": statistics.stdev(human)}


def power(seeds: int, effect: float, spread: float, level: float, draws: int, rng: np.random.Generator) -> float:
    """Share of ``draws`` simulated experiments whose exact one-sided sign-flip p-value is at most ``level``."""
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=seeds)))  # [2^n, n]
    differences = rng.normal(effect, spread, size=(draws, seeds))
    observed = differences.sum(axis=1)
    totals = differences @ signs.T  # [draws, 2^n]: every sign pattern's sum
    slack = 1e-12 * np.abs(differences).sum(axis=1, keepdims=True)
    p = (totals >= observed[:, None] - slack).mean(axis=1)
    return float((p <= level).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(6, 17)))
    parser.add_argument("--margin", type=float, default=0.05, help="non-inferiority margin, nats per token")
    parser.add_argument("--effects", type=float, nargs="+", default=[0.05, 0.25, 0.5, 1.0], help="test 2's effects")
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--output", default="docs/distillation_power.json")
    cli = parser.parse_args()

    rng = np.random.default_rng(0)
    spread = spreads()
    table = []
    for n in cli.seeds:
        row = {"seeds": n}
        for level in (0.05, 0.025):
            row[f"non_inferiority_at_{level}"] = power(
                n, cli.margin, spread["own_kl_student_teacher"], level, cli.draws, rng
            )
            for effect in cli.effects:
                row[f"superiority_{effect}_at_{level}"] = power(
                    n, effect, spread["human_kl_student_teacher"], level, cli.draws, rng
                )
        table.append(row)
        print(
            f"{n:2d} seeds: non-inferiority power {row['non_inferiority_at_0.05']:.2f} (at 0.025: "
            f"{row['non_inferiority_at_0.025']:.2f}); superiority at effect "
            + ", ".join(f"{e}: {row[f'superiority_{e}_at_0.05']:.2f}" for e in cli.effects)
        )
    enough = next((r["seeds"] for r in table if r["non_inferiority_at_0.05"] >= 0.8), None)
    report = {"settings": vars(cli), "spreads": spread, "table": table, "seeds_for_80_percent": enough}
    Path(cli.output).write_text(json.dumps(report, indent=1))
    print(f"seeds for ≥ 80 % power on test 1: {enough}")


if __name__ == "__main__":
    main()
