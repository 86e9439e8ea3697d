"""The per-record overhead of a data-generation run, without engines: does a run cost the same per record at any size?

    python examples/bench_datagen.py [--sizes 10000 100000] [--repeats 3] [--formats jsonl parquet]
                                     [--code DIR] [--output bench-out/datagen.json]

A generated input of the largest size (its first rows for the smaller sizes) goes through a whole run: the input
check, plan (prompt rendering and tokenising), draw, sink and, for Parquet, the final file; then through a resume of
the finished run (reading the done keys, planning nothing, and for Parquet writing the final file again). The
samples come from :class:`~dual_sampling.testing.scripted.ScriptedSampler` (made up from their seeds, no engine), so
what is measured is the run's own cost. Each measurement runs in a fresh process: its peak RSS
(``resource.getrusage``) is its own. The tables give medians over the repeats in µs per record, of CPU time (the
process's, robust to other load on the machine) and of wall time (which includes waiting for fsync), and the ratio
of the largest size's figure to the smallest's: 1 is linear growth.

``--code DIR`` runs the package found in DIR (e.g. an older commit unpacked with ``git archive``) with this same
script, for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _scripted_sampler():
    """The stub sampler class, from the package under test or (when that is an older one without it) this repo's."""
    try:
        from dual_sampling.testing.scripted import ScriptedSampler
    except ImportError:
        import importlib.util

        path = HERE.parent / "dual_sampling" / "testing" / "scripted.py"
        spec = importlib.util.spec_from_file_location("_bench_scripted", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ScriptedSampler = module.ScriptedSampler
    return ScriptedSampler


def write_input(path: Path, rows: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i in range(rows):
            row = {"id": f"q{i}", "problem": f"What is {i} plus {2 * i}?", "solution": f"{i} + {2 * i} = {3 * i}."}
            f.write(json.dumps(row) + "\n")


def child(args: argparse.Namespace) -> None:
    """One measured run (or resume) in this fresh process; prints its figures as one JSON line."""
    import dual_sampling
    from dual_sampling.datagen.run import run_generation
    from dual_sampling.datagen.run_config import RunConfig
    from dual_sampling.testing.tiny_models import tiny_pair

    teacher, theta = tiny_pair("same")
    ScriptedSampler = _scripted_sampler()

    def config(input_path: str, output: str, resume: bool):
        settings = dict(
            input=input_path,
            output=output,
            teacher=str(teacher),
            theta=str(theta),
            hint_field="solution",
            id_field="id",
            n=1,
            max_tokens=16,
            max_model_len=256,
            use_tqdm=False,
            resume=resume,
        )
        return RunConfig.from_settings(settings)

    # Warm up on a small run of its own (imports, tokenizer, template compilation), so that the measured run holds
    # only per-record work; the peak RSS before the measured run is reported as the base.
    sampler = ScriptedSampler((teacher, theta), keep_drawn=False)
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as warm:
        write_input(Path(warm) / "in.jsonl", 64)
        run_generation(config(str(Path(warm) / "in.jsonl"), str(Path(warm) / Path(args.output).name), False), sampler)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started, cpu = time.perf_counter(), time.process_time()
    summary = run_generation(config(args.input, args.output, args.child == "resume"), sampler)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    records = summary["samples_written"] + summary["samples_already_done"]
    figures = {"seconds": seconds, "cpu_seconds": cpu, "records": records, "base_kib": base, "peak_kib": peak}
    print(json.dumps({**figures, "package": str(Path(dual_sampling.__file__).parent)}))


def measure(mode: str, input_path: Path, output: Path, code: str | None) -> dict:
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = os.pathsep.join([code, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, __file__, "--child", mode, "--input", str(input_path), "--output-file", str(output)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", nargs="+", default=["jsonl", "parquet"], choices=["jsonl", "parquet"])
    parser.add_argument("--code", help="run the dual_sampling package in this folder instead of the installed one")
    parser.add_argument("--output", help="write every measurement here as JSON")
    parser.add_argument("--child", choices=["run", "resume"], help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--output-file", dest="output_file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.output = args.output_file
        child(args)
        return
    sizes = sorted(args.sizes)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-datagen-") as tmp:
        work = Path(tmp)
        write_input(work / f"in-{sizes[-1]}.jsonl", sizes[-1])
        for size in sizes[:-1]:
            with (work / f"in-{sizes[-1]}.jsonl").open() as src, (work / f"in-{size}.jsonl").open("w") as dst:
                dst.writelines(line for _, line in zip(range(size), src))
        for fmt in args.formats:
            for size in sizes:
                for repeat in range(args.repeats):
                    out = work / f"out-{fmt}-{size}-{repeat}" / f"out.{fmt}"
                    out.parent.mkdir()
                    for mode in ("run", "resume"):
                        figures = measure(mode, work / f"in-{size}.jsonl", out, args.code)
                        rows.append({"format": fmt, "size": size, "repeat": repeat, "mode": mode, **figures})
                        print(
                            f"{fmt:8} {size:>7} #{repeat} {mode:6} {figures['seconds']:8.2f} s "
                            f"{1e6 * figures['cpu_seconds'] / figures['records']:8.1f} µs CPU/record "
                            f"{1e6 * figures['seconds'] / figures['records']:8.1f} µs wall/record "
                            f"peak {figures['peak_kib'] / 1024:7.1f} MiB",
                            file=sys.stderr,
                        )
                    for path in sorted(out.parent.rglob("*"), reverse=True):
                        path.unlink() if path.is_file() else path.rmdir()
    print(f"package: {rows[0]['package']}")
    print(table(rows, sizes))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(rows, indent=1) + "\n")


def table(rows: list[dict], sizes: list[int]) -> str:
    """Markdown: per format and step, the median CPU and wall µs per record at each size, the ratio of the largest
    size's figure to the smallest's, and the median peak RSS (with the base before the measured run)."""
    ratio = f"{sizes[-1] // sizes[0]}×/1×"
    head = [f"CPU µs/record at {s:,}" for s in sizes] + [f"CPU ratio {ratio}"]
    head += [f"wall µs/record at {s:,}" for s in sizes] + [f"wall ratio {ratio}"]
    head += [f"peak RSS at {s:,}, MiB (base)" for s in sizes]
    lines = ["| output | step | " + " | ".join(head) + " |", "|---|---|" + "---:|" * len(head)]
    for fmt in dict.fromkeys(r["format"] for r in rows):
        for mode in ("run", "resume"):
            cells = []
            for key in ("cpu_seconds", "seconds"):
                per = []
                for size in sizes:
                    mine = [r for r in rows if (r["format"], r["mode"], r["size"]) == (fmt, mode, size)]
                    per.append(statistics.median(1e6 * r[key] / r["records"] for r in mine))
                cells += [f"{p:.0f}" for p in per] + [f"{per[-1] / per[0]:.2f}"]
            for size in sizes:
                mine = [r for r in rows if (r["format"], r["mode"], r["size"]) == (fmt, mode, size)]
                peak = statistics.median(r["peak_kib"] for r in mine) / 1024
                base = statistics.median(r["base_kib"] for r in mine) / 1024
                cells.append(f"{peak:.0f} ({base:.0f})")
            lines.append(f"| {fmt} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
