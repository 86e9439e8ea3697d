"""Ray's overhead on one machine: the same data-generation run without Ray and with one Ray replica.

    python examples/bench_ray.py [--n 8] [--max-tokens 128] [--output bench-out/ray.json]

Both runs draw the same samples (same input, seed and settings) on the SmolLM2 pair, one after
the other in this process; each wall time covers the whole run, engine start included, and
the Ray run also covers starting and stopping its local cluster. ``ray_vs_local`` is the
local wall time over the Ray wall time (their throughput ratio: both generate the same
tokens, which is checked). On a 2-core machine scaling cannot be shown, only this overhead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from dual_sampling import EngineOptions, ModelsAndPrompts, SamplingOptions
from dual_sampling.datagen import RunConfig, read_records, run_generation

HERE = Path(__file__).parent


def one_run(workdir: Path, name: str, use_ray: bool, args: argparse.Namespace) -> tuple[dict, dict]:
    output = workdir / name  # a directory of Parquet parts, as a cluster run would write
    cfg = RunConfig(
        input=str(HERE / "math_problems.jsonl"),
        output=str(output),
        id_field="id",
        source=ModelsAndPrompts(hint_field="solution"),
        ray=use_ray,
        replicas=1,
        cpus_per_replica=2,
        sampling=SamplingOptions(n=args.n, max_tokens=args.max_tokens, temperature=0.8, seed=11),
        engine=EngineOptions(max_num_seqs=32, max_model_len=512),
    )
    started = time.perf_counter()
    summary = run_generation(cfg)
    wall = time.perf_counter() - started
    records = {(r["id"], r["sample_index"]): r["token_ids"] for r in read_records(str(output))}
    tokens = summary["generated_tokens"]
    result = {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "failed": summary["failed_samples"]}
    print(f"{name}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s)", flush=True)
    return result, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8, help="samples per problem (12 problems)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--output", default="bench-out/ray.json")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    try:
        local, local_records = one_run(workdir, "local", False, args)
        on_ray, ray_records = one_run(workdir, "ray", True, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if local_records != ray_records:
        raise SystemExit("the Ray run drew different samples from the local run: the overhead figure would be void")
    report = {
        "settings": {"problems": 12, "n": args.n, "max_tokens": args.max_tokens, "replicas": 1, "cpus_per_replica": 2},
        "results": {"local": local, "ray": on_ray},
        "derived": {"ray_vs_local": local["wall_s"] / on_ray["wall_s"]},
        "same_records": True,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"ray_vs_local = {report['derived']['ray_vs_local']:.3f} (target >= 0.9); written to {out}")


if __name__ == "__main__":
    main()
