"""The records of every twin family in every mode, for fixed seeds: to show a refactor changed none of them.

A change that is meant to keep behaviour (the roster, the decision's rows object, the model-runner seam) must leave
every recorded token, α, log π and log q as it was, to the bit. This script runs each twin pair
(``dual_sampling.testing.twins``) in lockstep and, where the pair allows it, in the speculative mode, with fixed
seeds, and writes every sample's tokens and records as exact float32 bit patterns; ``--compare`` reads two such files
and names the first cells that differ. Run it at the commit before a change and at the change, on one machine::

    git worktree add ../before <commit> && (cd ../before && python examples/records_fingerprint.py --output a.json)
    python examples/records_fingerprint.py --output b.json
    python examples/records_fingerprint.py --compare ../before/a.json b.json

The engines run one request at a time (``max_num_seqs=1``), so no batch ever depends on timing: vLLM's CPU kernels may
round a row differently in another batch, which would make two runs of one commit differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

PROMPTS = ["Once upon a time", " ".join(f"item {i} costs {3 * i + 1} coins;" for i in range(12)), "1, 2, 3, 4,"]
"""A short prompt, one of about 100 tokens (past the Gemma twin's sliding window), and one where a padded twin's θ
puts mass past the tokenizer."""
HINT = "Hint: every answer is a number. "
"""In lockstep the teacher's prompt is the hint and the prompt, θ's the prompt alone (the speculative mode gives both
models one prompt)."""
SEED = 7
N = 2
MAX_TOKENS = 12
MODES = ("lockstep", "speculative")
BF16_TEACHER = {"mixed-dtype"}
"""Twins whose teacher runs in bfloat16, as the twin matrix runs them."""


def bits(values) -> list[str]:
    """float32 values as hexadecimal bit patterns: equal strings mean equal bits."""
    return [f"{int(v):08x}" for v in np.asarray(values, dtype=np.float32).view(np.uint32)]


def fingerprint(name: str, mode: str) -> dict:
    """Every sample of one twin pair in one mode: tokens, finish reason, and α, log π_t, log π_θ, log q as bits."""
    from dual_sampling import OptimalSamplingDual
    from dual_sampling.testing.twins import twin_pair

    teacher, theta = twin_pair(name)
    extra = {"num_speculative_tokens": 3} if mode == "speculative" else {}
    if name in BF16_TEACHER:
        extra["teacher_engine_kwargs"] = {"dtype": "bfloat16"}
    try:
        dual = OptimalSamplingDual(
            teacher, theta, mode=mode, max_num_seqs=1, max_model_len=256, sync_timeout=60, use_tqdm=False, **extra
        )
    except ValueError as refused:  # a pair the mode refuses by name: the refusal is part of the fingerprint
        return {"refused": str(refused)}
    with dual:
        out = dual.generate(
            PROMPTS,
            teacher_prompts=[HINT + p for p in PROMPTS] if mode == "lockstep" else None,
            n=N,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=SEED,
        )
    samples = []
    for request in out.requests:
        for s in request.samples:
            samples.append(
                {
                    "tokens": list(s.token_ids),
                    "finish": s.finish_reason,
                    "error": s.error,
                    **{field: bits(getattr(s, field)) for field in ("alpha", "logp_teacher", "logp_theta", "logq")},
                }
            )
    return {"samples": samples}


def _outcome(cell: dict | None) -> str:
    return "missing" if cell is None else cell.get("refused", "ran")


def compare(a: dict, b: dict, most: int = 10) -> list[str]:
    """The cells where ``a`` and ``b`` differ ("twin/mode/sample/field"), at most ``most`` of them."""
    diffs = []
    for cell in sorted(set(a) | set(b)):
        x, y = a.get(cell), b.get(cell)
        if x == y:
            continue
        if x is None or y is None or "samples" not in x or "samples" not in y:
            diffs.append(f"{cell}: {_outcome(x)} vs {_outcome(y)}")
            continue
        if len(x["samples"]) != len(y["samples"]):
            diffs.append(f"{cell}: {len(x['samples'])} vs {len(y['samples'])} samples")
            continue
        for i, (p, q) in enumerate(zip(x["samples"], y["samples"])):
            diffs += [f"{cell}/{i}/{field}: {p[field]} vs {q[field]}" for field in p if p[field] != q.get(field)]
    return diffs[:most]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write every twin's and mode's records here (JSON)")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"), help="compare two outputs")
    parser.add_argument("--twins", nargs="*", help="these twins only (default: all)")
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        diffs = compare(a, b)
        cells = len(set(a) | set(b))
        samples = sum(len(v.get("samples", ())) for v in a.values())
        print(f"{cells} cells, {samples} samples: " + ("identical" if not diffs else "differ:\n" + "\n".join(diffs)))
        return 1 if diffs else 0
    if args.output is None:
        parser.error("--output or --compare is needed")
    from dual_sampling.testing.twins import TWIN_PAIRS

    result = {}
    for name in args.twins or list(TWIN_PAIRS):
        for mode in MODES:
            result[f"{name}/{mode}"] = fingerprint(name, mode)
            print(f"{name}/{mode}: {len(result[f'{name}/{mode}'].get('samples', []))} samples", flush=True)
    args.output.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
