"""Engine placement on CUDA (``dual_sampling.driver.placement``): the layout arithmetic, its refusals by name, and
the environment each engine's processes are spawned with. No GPU here: the GPUs are described to the planner, and
the spawn is a real one of a stand-in for vLLM's engine."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from dual_sampling.driver import placement
from dual_sampling.driver.pair import EnginePair, _resolve_row_transport
from dual_sampling.options import DualEngineConfig, EngineOptions
from dual_sampling.roster import PAIR, THETA, Role, Roster
from dual_sampling.testing import tiny_models
from tests.spawned_probe import write_visible_devices

GiB = 1 << 30
BOTH = (Role.TEACHER, Role.THETA)
TRIO = Roster.of_teachers(("math", "general"))


@pytest.fixture(scope="module", autouse=True)
def model_folders(tmp_path_factory):
    """A folder per model name (a config.json is all the placement settings' checks read)."""
    root = tmp_path_factory.mktemp("placed-models")
    for name in ("teacher", *TRIO.names):
        (root / name).mkdir()
        (root / name / "config.json").write_text("{}")
    MODELS.clear()
    MODELS.update({name: str(root / name) for name in ("teacher", *TRIO.names)})
    return root


MODELS: dict[str, str] = {}


def config(roster: Roster = PAIR, **options) -> DualEngineConfig:
    """The run's config for ``roster``'s models with ``options``, as a user gives them."""
    teachers = MODELS["teacher"] if roster == PAIR else {t: MODELS[t] for t in roster.teachers}
    return DualEngineConfig(teachers, MODELS[THETA], **options)


def plan(needs_gib, gpus_gib: list[float], visible: str | None = None, roles=BOTH, roster: Roster = PAIR, **options):
    """The placement of the engines of ``roles`` (by name), each needing ``needs_gib`` (the teachers', then θ's)."""
    models = tuple(m for m in config(roster, **options).model_engines() if m.name in roles)
    needs = {name: int(n * GiB) for name, n in zip((*roster.teachers, THETA), needs_gib)}
    return placement.plan_placement(models, roster, needs, [int(g * GiB) for g in gpus_gib], visible)


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
        ((29.6, 10.6), [80], {"theta_gpu_memory": 0.7}, r"but the other engines on it take at least 29.6 GiB: lower"),
        ((16, 4), [], {}, "no CUDA device is visible"),
    ],
)
def test_layouts_that_cannot_start_are_refused_naming_the_setting(needs, gpus, options, named):
    with pytest.raises(ValueError, match=named):
        plan(needs, gpus, **options)


def test_the_speculative_mode_places_its_one_engine():
    places = plan((20, 0), [80], roles=(Role.TEACHER,), mode="speculative", teacher_device=0)
    assert list(places) == [Role.TEACHER] and places[Role.TEACHER].memory_share == pytest.approx(0.25)


def test_several_teachers_each_take_the_gpu_and_share_given_by_name():
    """Two teachers and theta over two GPUs: each teacher's engine goes where ``teacher_device`` names it (one GPU for
    all when given once), each asks for its own need, and the rows take host memory (the device buffer holds one
    follower's)."""
    from dual_sampling.lockstep.row_channel import resolve_transport

    trio = dict(roster=TRIO, roles=TRIO.names)
    places = plan((29.6, 14.0, 10.6), [80, 40], visible="3,6", teacher_device={"general": 1}, theta_device=1, **trio)
    assert {n: (p.device, p.visible_devices) for n, p in places.items()} == {
        "math": (0, "3"),  # not named: the first GPU
        "general": (1, "6"),
        THETA: (1, "6"),
    }
    assert places["general"].memory_share == pytest.approx(14.0 / 40)
    assert places[THETA].memory_share == pytest.approx(10.6 / 40)
    one = plan((20, 20, 10), [80], teacher_device=0, teacher_gpu_memory={"math": 0.4}, **trio)
    assert (one["math"].memory_share, one["general"].memory_share) == (0.4, pytest.approx(0.25))
    assert resolve_transport("auto", "cuda", same_device=True, followers=2) == "pinned"
    with pytest.raises(ValueError, match="row_transport='device' shares one follower's rows buffer; these engines"):
        resolve_transport("device", "cuda", same_device=True, followers=2)


@pytest.mark.parametrize(
    ("needs", "gpus", "options", "named"),
    [
        (
            (20, 20, 10),
            [80],
            {"teacher_device": {"general": 2}},
            r"^teacher_device\['general'\]=2: this process sees 1 CUDA device\(s\)",
        ),
        (
            (40, 30, 10),
            [80, 80],
            {"teacher_device": {"general": 1}, "theta_device": 1, "teacher_gpu_memory": {"general": 0.9}},
            r"^teacher_gpu_memory\['general'\]=0.90 asks GPU 1 \(80.0 GiB\) for 72.0 GiB free when the general "
            r"engine starts, but the other engines on it take at least 10.0 GiB",
        ),
        (
            (40, 30, 20),
            [80],
            {},
            r"^GPU 0 has 80.0 GiB; the theta engine 20.0 GiB and the math engine 40.0 GiB and the general engine 30.0 "
            r"GiB need more at least .*: place theta on another GPU \(theta_device\)",
        ),
    ],
)
def test_several_teachers_layouts_that_cannot_start_are_refused_naming_the_teachers_setting(
    needs, gpus, options, named
):
    with pytest.raises(ValueError, match=named):
        plan(needs, gpus, roster=TRIO, roles=TRIO.names, **options)


@pytest.mark.parametrize(
    ("roster", "options", "named"),
    [
        (
            TRIO,
            {"teacher_device": {"physics": 1}},
            r"^teacher_device: 'physics' names no teacher here \(math, general\)",
        ),
        (TRIO, {"teacher_gpu_memory": {}}, "^teacher_gpu_memory: an empty mapping names no teacher"),
        (TRIO, {"teacher_device": {"math": -1}}, r"^teacher_device\['math'\] must be a GPU index >= 0, got -1"),
        (TRIO, {"teacher_gpu_memory": {"math": 1.5}}, r"^teacher_gpu_memory\['math'\] must be a share"),
        (PAIR, {"teacher_device": {"teacher": 1}}, "^teacher_device: a value per teacher name needs several teachers"),
        (PAIR, {"theta_device": {"theta": 1}}, "^theta_device must be a GPU index >= 0"),
    ],
)
def test_per_teacher_placement_values_are_refused_by_name(roster, options, named):
    with pytest.raises(ValueError, match=named):
        config(roster, **options)


def test_a_teachers_placement_off_cuda_or_given_twice_is_refused_by_its_entry():
    cfg = config(TRIO, teacher_device={"general": 0})
    with pytest.raises(ValueError, match=r"^teacher_device\['general'\]=0 places an engine on a CUDA device"):
        placement.check_placement_settings(cfg, cfg.model_engines(), TRIO, "cpu")
    cfg = config(
        TRIO, teacher_gpu_memory={"math": 0.3}, teacher_engine_kwargs={"math": {"gpu_memory_utilization": 0.2}}
    )
    with pytest.raises(ValueError, match=r"^teacher_gpu_memory\['math'\] and teacher_engine_kwargs\['math'\]"):
        placement.check_placement_settings(cfg, cfg.model_engines(), TRIO, "cuda")


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
    cfg = config(**options)
    with pytest.raises(ValueError, match=named):
        placement.check_placement_settings(cfg, cfg.model_engines(), PAIR, device_type)


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


def _save(folder: Path, name: str, tensors: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    save_file(tensors, str(folder / name))


@pytest.mark.parametrize("layout", ["hidden", "index", "consolidated"])
def test_weight_bytes_count_only_the_files_vllms_loader_reads(tmp_path, layout):
    """vLLM's loader skips hidden names, reads only consolidated*.safetensors beside other files, and only the files
    an index maps tensors to: a file it skips takes no memory, so counting it refused layouts that start."""
    import torch

    read = {"a": torch.zeros(10, 10), "b": torch.zeros(5)}  # 105 float32 elements
    name = "consolidated.safetensors" if layout == "consolidated" else "model-1.safetensors"
    _save(tmp_path, name, read)
    skipped = {"hidden": ".x.safetensors", "index": "model-2.safetensors", "consolidated": "model-1.safetensors"}
    _save(tmp_path, skipped[layout], {"c": torch.zeros(1000)})
    if layout == "index":
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(read, name)}))
    assert placement.weight_bytes(tmp_path, "bfloat16") == 2 * 105


def test_weight_bytes_count_quantised_and_packed_dtypes_at_their_stored_size(tmp_path):
    """Only the plain floating tensors take the engine's dtype; an integer, boolean or float8 tensor (a quantised
    checkpoint's packed weights and scales) stays as stored, and F4 packs two elements to a byte."""
    import torch

    _save(
        tmp_path,
        "model.safetensors",
        {
            "f32": torch.zeros(8),  # 8 x 2 bytes at bfloat16
            "packed": torch.zeros(64, dtype=torch.uint8),  # 64 x 1
            "zeros": torch.zeros(6, dtype=torch.int16),  # 6 x 2
            "fp8": torch.zeros(16, dtype=torch.float8_e4m3fn),  # 16 x 1, not cast
            "mask": torch.zeros(3, dtype=torch.bool),  # 3 x 1
        },
    )
    # F4 (float4_e2m1fn_x2), which safetensors' torch helper cannot save: its header written by hand.
    header = json.dumps({"w": {"dtype": "F4", "shape": [2, 5], "data_offsets": [0, 5]}}).encode()
    (tmp_path / "model-f4.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(5))
    assert placement.weight_bytes(tmp_path, "bfloat16") == 16 + 64 + 12 + 16 + 3 + 5
    bad = json.dumps({"q": {"dtype": "Q3", "shape": [4], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model-q3.safetensors").write_bytes(len(bad).to_bytes(8, "little") + bad + bytes(4))
    with pytest.raises(ValueError, match=r"model-q3\.safetensors: 'q' has dtype 'Q3', which safetensors does not"):
        placement.weight_bytes(tmp_path, "bfloat16")


@pytest.mark.parametrize("theta_dtype", ["bfloat16", "torch.bfloat16"])
def test_each_engines_kv_cache_and_need_are_sized_at_its_own_dtype(tmp_path, theta_dtype):
    """A dtype in theta_engine_kwargs is the one theta's engine runs, and its KV cache is of it (vLLM's
    kv_cache_dtype "auto"); sizing it at the run's dtype asked the GPU for twice theta's cache. A torch.dtype there
    is read by its name."""
    import torch

    from dual_sampling.driver.speculative_engine import SpeculativeEngine
    from dual_sampling.options import DualEngineConfig, default_kv_cache_bytes

    models = {}
    for role in ("teacher", "theta"):
        models[role] = tmp_path / role
        _save(models[role], "model.safetensors", {"w": torch.zeros(100)})
        config = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
        (models[role] / "config.json").write_text(json.dumps(config))
    given = torch.bfloat16 if theta_dtype.startswith("torch.") else theta_dtype
    options = {"model_teacher": str(models["teacher"]), "model_theta": str(models["theta"]), "dtype": "float32"}
    pair = object.__new__(EnginePair)  # its sizing alone: no engines
    pair.config = DualEngineConfig(**options, theta_engine_kwargs={"dtype": given})
    pair.max_model_len = 256
    kv = {
        "teacher": default_kv_cache_bytes(str(models["teacher"]), 8, 256, "float32"),
        "theta": default_kv_cache_bytes(str(models["theta"]), 8, 256, "bfloat16"),
    }
    assert pair.kv_cache_bytes(Role.TEACHER) == kv["teacher"]
    assert pair.kv_cache_bytes(Role.THETA) == kv["theta"]
    assert pair.engine_need_bytes(Role.THETA) == 2 * 100 + kv["theta"]
    # An engine short of KV blocks is told the cache it needs at its dtype: 129 blocks x 16 tokens x 512 bytes.
    short = SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=1, block_size=16),
        model_config=SimpleNamespace(max_model_len=256),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )
    assert "(about 1 MiB)" in pair._kv_problems("theta", short)[0]
    speculative = object.__new__(SpeculativeEngine)  # one engine: the teacher's dtype is the draft's too
    speculative.config = DualEngineConfig(**options, mode="speculative", teacher_engine_kwargs={"dtype": given})
    speculative.max_model_len = 256
    assert speculative.kv_cache_bytes() == 2 * kv["theta"]
    assert speculative.engine_need_bytes(Role.TEACHER) == 2 * (2 * 100) + 2 * kv["theta"]


@pytest.mark.parametrize("roster", [PAIR, TRIO], ids=["pair", "two-teachers"])
def test_each_engine_process_is_spawned_seeing_its_own_gpu(tmp_path, monkeypatch, roster):
    """The pair's real start path, with vLLM's engine replaced by a stand-in that spawns one process (as vLLM's
    EngineCore is spawned) and records the CUDA_VISIBLE_DEVICES it sees, and the start method vLLM is told to use
    (spawn: on CUDA vLLM would fork, and the pair waits for a spawned process before switching the environment)."""
    import shutil

    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm

    def spawn_like_an_engine(role: str) -> str:
        child = multiprocessing.get_context("spawn").Process(target=write_visible_devices, args=(str(tmp_path / role),))
        child.start()
        child.join(60)
        return f"engine of {role}"

    monkeypatch.setattr(vllm.engine.arg_utils, "AsyncEngineArgs", lambda **kwargs: kwargs["role"])
    monkeypatch.setattr(vllm.v1.engine.async_llm.AsyncLLM, "from_engine_args", staticmethod(spawn_like_an_engine))
    monkeypatch.setattr(EnginePair, "engine_kwargs", lambda self, role: {"role": str(role)})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,7")
    pair = object.__new__(EnginePair)  # its start path alone: no engines, no session
    # A trio: the second teacher shares theta's GPU.
    devices = {"theta_device": 1} if roster == PAIR else {"theta_device": 1, "teacher_device": {"general": 1}}
    pair.config = config(roster, **devices)
    pair.binding, pair.engines = {}, {}
    pair.from_forkserver = False  # as __init__ sets it where engines are placed on GPUs
    pair.places = plan((16, 4, 4), [80, 80], visible="4,7", roles=roster.names, roster=roster, **devices)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    try:
        pair._start_engines()
    finally:
        shutil.rmtree(pair.ipc_dir, ignore_errors=True)
    seen = {name: (tmp_path / name).read_text() for name in roster.names}
    wanted = {"teacher": "4", "math": "4", "general": "7", THETA: "7"}
    assert seen == {name: f"{wanted[name]} spawn" for name in roster.names}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,7" and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    assert pair.engines == {name: f"engine of {name}" for name in roster.names}
