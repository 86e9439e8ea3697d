"""Distillation data from the shipped math problems: the teacher (SmolLM2-135M-Instruct) sees
each problem with its reference solution as a hint, theta (the 24-layer pruned copy) sees the
problem only. Writes training-ready records and a report with plots.

The same run from the shell:

    dual-sampling generate --input examples/math_problems.jsonl --output runs/math.jsonl \\
        --hint-field solution --id-field id --n 2 --max-tokens 96 --temperature 0.8
    dual-sampling report runs/math.jsonl

Run this script again to resume it, or delete runs/ to start over.
"""

from __future__ import annotations

import json
from pathlib import Path

from dual_sampling import EngineOptions, ModelsAndPrompts, SamplingOptions
from dual_sampling.datagen import RunConfig, run_generation
from dual_sampling.datagen.report import write_report

HERE = Path(__file__).parent


def main() -> None:
    output = Path("runs/math.jsonl")
    output.parent.mkdir(exist_ok=True)
    cfg = RunConfig(
        input=str(HERE / "math_problems.jsonl"),
        output=str(output),
        id_field="id",
        source=ModelsAndPrompts(hint_field="solution"),
        resume=output.exists(),
        sampling=SamplingOptions(n=2, max_tokens=96, temperature=0.8),
        engine=EngineOptions(max_num_seqs=8, max_model_len=512),
    )
    summary = run_generation(cfg)
    print(json.dumps(summary, indent=1))
    print(f"report: {write_report(output)}")


if __name__ == "__main__":
    main()
