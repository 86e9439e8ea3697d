"""Benchmark: how long a dual engine takes to start and to close, spawned against forked from the fork server.

Measured side by side in one run, on the tiny pair (two-layer random Llamas: the start is all process and import
cost, which is what ``dual_sampling.driver.engine_start`` removes), alternating the two ways:

  spawn        DUAL_SAMPLING_ENGINE_START=spawn: vLLM's own way on CPUs, each EngineCore and worker imports vLLM
  forkserver   the default: forked from a server that imported vLLM once (its first start in a process waits for
               those imports and is reported apart, as ``forkserver_first_s``)

For each: the time of ``OptimalSamplingDual(...)`` (start: both engines up and verified, then one request's first
token) and of ``close()``, medians and ranges over --repeats; ``start_ratio`` is the forkserver's median start over
spawn's.

    python examples/bench_engine_start.py --output docs/engine_start_benchmark.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from dual_sampling import OptimalSamplingDual
from dual_sampling.driver.engine_start import ENGINE_START_VARIABLE
from dual_sampling.testing import tiny_models

SETTINGS = dict(max_num_seqs=4, max_model_len=256, sync_timeout=30, use_tqdm=False)
WAYS = ("spawn", "forkserver")


def start_and_close(teacher: Path, theta: Path, way: str) -> tuple[float, float]:
    """(seconds to start and draw a first token, seconds to close) of one dual engine started ``way``."""
    os.environ[ENGINE_START_VARIABLE] = way
    t0 = time.perf_counter()
    s = OptimalSamplingDual(teacher, theta, **SETTINGS)
    try:
        s.generate(["Name a prime number."], max_tokens=1, seed=0)
        started = time.perf_counter() - t0
    finally:
        t1 = time.perf_counter()
        s.close()
    return started, time.perf_counter() - t1


def summary(values: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="starts timed per way, alternating (median reported)")
    parser.add_argument("--output", default="bench-out/engine_start.json")
    args = parser.parse_args()

    teacher, theta = tiny_models.tiny_pair("same")
    first, _ = start_and_close(teacher, theta, "forkserver")  # the fork server's imports, once per process
    times: dict[str, dict[str, list[float]]] = {way: {"start": [], "close": []} for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            started, closed = start_and_close(teacher, theta, way)
            times[way]["start"].append(started)
            times[way]["close"].append(closed)
            print(f"{way:>10}: start {started:6.2f} s, close {closed:5.2f} s", flush=True)
    result = {
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "python": platform.python_version()},
        "settings": SETTINGS,
        "forkserver_first_s": first,
        **{way: {part: summary(values) for part, values in parts.items()} for way, parts in times.items()},
        "start_ratio": statistics.median(times["forkserver"]["start"]) / statistics.median(times["spawn"]["start"]),
        "close_ratio": statistics.median(times["forkserver"]["close"]) / statistics.median(times["spawn"]["close"]),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
