"""Engine placement on CUDA (``dual_sampling.driver.placement``): the layout arithmetic, its refusals by name, and
the environment each engine's processes are spawned with. No GPU here: the GPUs are described to the planner, and
the spawn is a real one of a stand-in for vLLM's engine."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from dual_sampling.driver import placement
from dual_sampling.driver.pair import EnginePair, _resolve_row_transport
from dual_sampling.lockstep import Role
from dual_sampling.options import EngineOptions
from dual_sampling.testing import tiny_models

GiB = 1 << 30
BOTH = (Role.TEACHER, Role.THETA)


def plan(needs_gib: tuple[float, float], gpus_gib: list[float], visible: str | None = None, roles=BOTH, **options):
    needs = {role: int(n * GiB) for role, n in zip(BOTH, needs_gib)}
    return placement.plan_placement(EngineOptions(**options), roles, needs, [int(g * GiB) for g in gpus_gib], visible)


def test_two_engines_on_one_gpu_each_ask_for_their_own_need():
    """A 7B/1.5B-like pair (29.6 + 10.6 GiB of weights and KV cache) on one 80 GiB GPU: each engine's start gate
    (vLLM's gpu_memory_utilization) asks for its own need, which is free whichever engine starts first; both see the
    same GPU, so theta's rows can go through a buffer on it."""
    places = plan((29.6, 10.6), [80])
    assert places[Role.TEACHER].memory_share == pytest.approx(29.6 / 80)
    assert places[Role.THETA].memory_share == pytest.approx(10.6 / 80)
    assert places[Role.TEACHER].visible_devices == places[Role.THETA].visible_devices == "0"
    assert _resolve_row_transport("auto", places) == "host"  # this machine is a CPU one: no CUDA transport here
    from dual_sampling.lockstep.row_channel import resolve_transport

    assert resolve_transport("auto", "cuda", same_device=True) == "device"


def test_one_gpu_each_maps_through_this_processs_visible_devices():
    places = plan((29.6, 10.6), [80, 24], visible="2,5", theta_device=1)
    assert (places[Role.TEACHER].visible_devices, places[Role.THETA].visible_devices) == ("2", "5")
    assert places[Role.THETA].memory_share == pytest.approx(10.6 / 24)
    with pytest.raises(ValueError, match="row_transport='device' needs both engines on one GPU"):
        from dual_sampling.lockstep.row_channel import resolve_transport

        resolve_transport("device", "cuda", same_device=False)


def test_a_share_may_ask_for_whatever_the_other_engine_leaves():
    assert plan((29.6, 10.6), [80], teacher_gpu_memory=0.8)[Role.TEACHER].memory_share == 0.8  # 64 + 10.6 ≤ 80
    places = plan((29.6, 10.6), [80], theta_engine_kwargs={"gpu_memory_utilization": 0.05})
    assert places[Role.THETA].memory_share == 0.05  # below its need: vLLM's gate passes, its cache is fixed anyway


@pytest.mark.parametrize(
    ("needs", "gpus", "options", "named"),
    [
        ((16, 4), [80], {"theta_device": 1}, r"theta_device=1: this process sees 1 CUDA device\(s\), 0 to 0"),
        ((29.6, 10.6), [32], {}, r"GPU 0 has 32.0 GiB; the teacher engine 29.6 GiB and the theta engine 10.6 GiB"),
        ((29.6, 10.6), [80], {"teacher_gpu_memory": 0.9}, r"teacher_gpu_memory=0.90 asks GPU 0 \(80.0 GiB\) for 72.0"),
        ((29.6, 10.6), [80], {"theta_gpu_memory": 0.7}, r"but the other engine on it takes at least 29.6 GiB: lower"),
        ((16, 4), [], {}, "no CUDA device is visible"),
    ],
)
def test_layouts_that_cannot_start_are_refused_naming_the_setting(needs, gpus, options, named):
    with pytest.raises(ValueError, match=named):
        plan(needs, gpus, **options)


def test_the_speculative_mode_places_its_one_engine():
    places = plan((20, 0), [80], roles=(Role.TEACHER,), mode="speculative", teacher_device=0)
    assert list(places) == [Role.TEACHER] and places[Role.TEACHER].memory_share == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("options", "device_type", "named"),
    [
        (
            {"teacher_device": 0},
            "cpu",
            "teacher_device=0 places an engine on a CUDA device; these engines run on 'cpu'",
        ),
        ({"theta_gpu_memory": 0.3}, "cpu", "theta_gpu_memory=0.3 places an engine on a CUDA device"),
        ({"theta_device": 1, "mode": "speculative"}, "cuda", "theta_device: in mode='speculative' theta runs in the"),
        (
            {"teacher_gpu_memory": 0.5, "teacher_engine_kwargs": {"gpu_memory_utilization": 0.4}},
            "cuda",
            r"teacher_gpu_memory and teacher_engine_kwargs\['gpu_memory_utilization'\] both set",
        ),
    ],
)
def test_placement_settings_these_engines_cannot_use_are_refused(options, device_type, named):
    with pytest.raises(ValueError, match=named):
        placement.check_placement_settings(EngineOptions(**options), device_type)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"teacher_gpu_memory": 1.0}, "teacher_gpu_memory must be a share of the GPU's memory in \\(0, 1\\)"),
        ({"theta_gpu_memory": 0}, "theta_gpu_memory must be"),
        ({"theta_device": -1}, "theta_device must be a GPU index >= 0"),
        ({"teacher_device": True}, "teacher_device must be"),
    ],
)
def test_bad_placement_values_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named):
        EngineOptions(**options)


def test_weight_bytes_count_every_stored_tensor_at_the_engines_dtype():
    import torch
    from transformers import AutoModelForCausalLM

    for tied in (False, True):
        folder = tiny_models.tiny_pair("same", tied=tied)[1]
        params = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).num_parameters()
        assert placement.weight_bytes(folder, "float32") == 4 * params
        assert placement.weight_bytes(folder, "bfloat16") == 2 * params


def _write_visible_devices(path: str) -> None:
    seen = (os.environ.get(name, "unset") for name in ("CUDA_VISIBLE_DEVICES", "VLLM_WORKER_MULTIPROC_METHOD"))
    Path(path).write_text(" ".join(seen))


def test_each_engine_process_is_spawned_seeing_its_own_gpu(tmp_path, monkeypatch):
    """The pair's real start path, with vLLM's engine replaced by a stand-in that spawns one process (as vLLM's
    EngineCore is spawned) and records the CUDA_VISIBLE_DEVICES it sees, and the start method vLLM is told to use
    (spawn: on CUDA vLLM would fork, and the pair waits for a spawned process before switching the environment)."""
    import shutil

    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm

    def spawn_like_an_engine(role: str) -> str:
        child = multiprocessing.get_context("spawn").Process(
            target=_write_visible_devices, args=(str(tmp_path / role),)
        )
        child.start()
        child.join(60)
        return f"engine of {role}"

    monkeypatch.setattr(vllm.engine.arg_utils, "AsyncEngineArgs", lambda **kwargs: kwargs["role"])
    monkeypatch.setattr(vllm.v1.engine.async_llm.AsyncLLM, "from_engine_args", staticmethod(spawn_like_an_engine))
    monkeypatch.setattr(EnginePair, "engine_kwargs", lambda self, role: {"role": str(role)})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,7")
    pair = object.__new__(EnginePair)  # its start path alone: no models, no session
    pair.binding, pair.engines = {}, {}
    pair.places = plan((16, 4), [80, 80], visible="4,7", theta_device=1)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    try:
        pair._start_engines()
    finally:
        shutil.rmtree(pair.ipc_dir, ignore_errors=True)
    seen = {role: (tmp_path / role).read_text() for role in ("teacher", "theta")}
    assert seen == {"teacher": "4 spawn", "theta": "7 spawn"}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,7" and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    assert pair.engines == {Role.TEACHER: "engine of teacher", Role.THETA: "engine of theta"}
