"""Benchmark: new theta weights without a restart, against a restart and against vLLM's plain reload.

Measured side by side in one run, on one pair (default: the SmolLM2 teacher and its 24-layer theta):

  update_vs_restart   (update_theta of a state dict → the first token of a new request)
                      / (close both engines → start a fresh dual engine on the same weights → the first token)
  update_overhead     update_theta's time / vLLM's own reload_weights of the same weights on the theta
                      engine alone (collective_rpc, by path), for a folder and for a state dict (the state dict
                      goes through vLLM's weight-transfer protocol with the shared-memory engine)
  transfer_overhead   vLLM's start, update and finish on the theta engine alone, with the shared-memory engine
                      and a chunk written beforehand / the same plain reload: the transport against vLLM's own

Each update figure is the median of --repeats; the restart is timed --restarts times (it costs a minute
here). The state dict is theta's own weights, read with transformers, so every update changes nothing a
sample could see and the runs stay comparable.

    python examples/bench_update.py --output bench-out/update.json
    python examples/bench_update.py --quick          # the tiny pair, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from dual_sampling import OptimalSamplingDual, models
from dual_sampling.driver.weight_loads import chunk_of, transfer
from dual_sampling.driver.weights import WeightsCheck
from dual_sampling.testing import tiny_models

SETTINGS = dict(max_num_seqs=8, max_model_len=1024, sync_timeout=60, use_tqdm=False)


def first_token_s(s: OptimalSamplingDual, t0: float) -> float:
    """Seconds from ``t0`` until a new request's first token arrives."""
    s.generate(["Name a prime number."], max_tokens=1, seed=0)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny random pair instead of SmolLM2")
    parser.add_argument("--repeats", type=int, default=7, help="updates timed per kind (median reported)")
    parser.add_argument("--restarts", type=int, default=2, help="restarts timed (median reported)")
    parser.add_argument("--output", default="bench-out/update.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    teacher, theta = tiny_models.tiny_pair("same") if args.quick else (models.smollm2(), models.smollm2_pruned(24))
    state = AutoModelForCausalLM.from_pretrained(theta, dtype=torch.float32).state_dict()
    weights_mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20

    s = OptimalSamplingDual(teacher, theta, **SETTINGS)
    try:
        first_token_s(s, time.perf_counter())  # warm both engines
        plain, transport, from_folder, from_state, update_to_token = [], [], [], [], []
        engine = s.driver.engines.theta
        # The chunk update_theta sends (a tied output projection dropped: the engine shares the embedding).
        with chunk_of(WeightsCheck(theta).check_state_dict(state, "theta").items()) as chunk:
            alone = transfer(chunk)
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                s.driver.call(engine.collective_rpc("reload_weights", kwargs={"weights_path": str(theta)}))
                plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                s.driver.call(alone(engine))
                transport.append(time.perf_counter() - t0)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            s.update_theta(str(theta))
            from_folder.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s.update_theta(state)
            from_state.append(time.perf_counter() - t0)
            update_to_token.append(first_token_s(s, t0))
        restarts = []
        for _ in range(args.restarts):
            t0 = time.perf_counter()
            s.close()
            s = OptimalSamplingDual(teacher, theta, **SETTINGS)
            restarts.append(first_token_s(s, t0))
    finally:
        s.close()

    med = statistics.median
    result = {
        "pair": "tiny" if args.quick else "smollm2",
        "theta_weights_mib": round(weights_mb, 1),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "median_s": {
            "plain_reload_weights": med(plain),
            "transfer_engine_alone": med(transport),
            "update_theta_folder": med(from_folder),
            "update_theta_state_dict": med(from_state),
            "update_to_first_token": med(update_to_token),
            "restart_to_first_token": med(restarts),
        },
        "samples_s": {
            "plain_reload_weights": plain,
            "transfer_engine_alone": transport,
            "update_theta_folder": from_folder,
            "update_theta_state_dict": from_state,
            "update_to_first_token": update_to_token,
            "restart_to_first_token": restarts,
        },
    }
    result["update_vs_restart"] = med(update_to_token) / med(restarts)
    result["update_overhead_folder"] = med(from_folder) / med(plain)
    result["update_overhead_state_dict"] = med(from_state) / med(plain)
    result["transfer_overhead"] = med(transport) / med(plain)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for key in ("update_vs_restart", "update_overhead_folder", "update_overhead_state_dict", "transfer_overhead"):
        print(f"{key:28s} {result[key]:.3f}")
    for key, value in result["median_s"].items():
        print(f"  {key:28s} {value:.3f} s")


if __name__ == "__main__":
    main()
