"""A run's settings: which ones make its identity, and its flat keys, both derived from the dataclasses' fields."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from dual_sampling.datagen.run_config import _NOT_IDENTITY, RunConfig
from dual_sampling.options import SamplingOptions
from dual_sampling.run_settings import changed_settings, flat_keys
from tests.test_datagen import tiny_config


def test_identity_leaves_out_exactly_the_settings_marked_runtime_only(tiny_same, tmp_path):
    # The list that was kept by hand before the field metadata: the manifests of existing runs depend on it.
    assert {
        "ray", "replicas", "cpus_per_replica", "gpus_per_replica", "ray_max_retries", "resume", "batch_size",
        "use_tqdm", "output", "sync_timeout", "max_num_seqs", "max_num_batched_tokens", "cpu_binding",
        "enforce_eager", "enable_prefix_caching", "kv_cache_memory_bytes", "max_dense_logprobs", "row_transport",
        # Where the engines run (driver/placement.py) changes no record: a run resumed on other GPUs is the same run.
        "teacher_device", "theta_device", "teacher_gpu_memory", "theta_gpu_memory",
    } == _NOT_IDENTITY  # fmt: skip
    cfg = tiny_config(tiny_same, tmp_path)
    assert set(cfg.identity()) == set(cfg.flat()) - _NOT_IDENTITY
    assert tiny_config(tiny_same, tmp_path, max_num_seqs=2, batch_size=3).identity() == cfg.identity()
    assert tiny_config(tiny_same, tmp_path, max_tokens=5).identity() != cfg.identity()


def test_a_flat_key_two_parts_share_is_refused():
    keys = flat_keys(RunConfig)
    assert keys["seed"] == "sampling" and keys["teacher"] == "source" and keys["shard"] == "run"
    assert "sampling" not in keys and "source" not in keys  # a composed part is not a key

    @dataclass
    class Clashing:
        max_tokens: int = 3
        inner: SamplingOptions = field(default_factory=SamplingOptions)

    with pytest.raises(TypeError, match="'max_tokens' is a field of both the run and the inner options"):
        flat_keys(Clashing)


def test_a_run_resumes_across_an_upgrade_that_added_settings(tiny_same, tmp_path):
    # A manifest written before the penalties existed lacks their keys: at their defaults they draw as that run
    # did, so they are no change; a value other than the default is one, and so is any other difference.
    import json

    now = json.loads(json.dumps(tiny_config(tiny_same, tmp_path).identity()))
    before = {k: v for k, v in now.items() if not k.endswith("_penalty")}
    assert changed_settings(RunConfig, before, now) == []
    assert changed_settings(RunConfig, before, {**now, "presence_penalty": 0.5}) == ["presence_penalty"]
    assert changed_settings(RunConfig, {**before, "max_tokens": 3}, now) == ["max_tokens"]
    assert changed_settings(RunConfig, {**before, "gone_setting": 1}, now) == ["gone_setting"]
