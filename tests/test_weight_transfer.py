"""The shared-memory weight-transfer engine's chunks, and vLLM's weight-sync surface on a model (no engines).

A chunk is a file of tensors back to back (processors.weight_transfer); WeightSync (dual_sampling.driver.weight_sync)
copies and checks each chunk as it comes and loads only at finish. The loads into running engines are in
tests/test_live_weights.py; here a stand-in engine records what vLLM's start, update and finish would be given.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from dual_sampling.driver.weight_sync import WeightSync
from dual_sampling.driver.weights import WeightsCheck
from dual_sampling.testing import tiny_models
from processors.weight_transfer import (
    ALIGN,
    SharedMemoryTrainerInitInfo,
    copy_chunk,
    read_chunk,
    register,
    weights_folder,
    write_chunk,
)


@pytest.fixture
def folder():
    made = weights_folder()
    yield made
    for path in made.iterdir():
        path.unlink()
    made.rmdir()


@pytest.fixture(scope="module")
def theta():
    model = tiny_models.tiny_pair("same")[1]
    return WeightsCheck(model), load_file(str(model / "model.safetensors"))


def test_a_chunk_holds_each_tensor_bit_for_bit_at_aligned_offsets(folder):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "half": torch.randn(3, 5, generator=g).half(),
        "brain": torch.randn(7, generator=g).bfloat16(),
        "single": torch.randn(4, 3, generator=g).t(),  # not contiguous
        "double": torch.randn(2, 2, 2, generator=g, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "special": torch.tensor([float("nan"), float("inf"), -0.0]),  # the format carries any value; checks refuse
    }
    info = write_chunk(tensors.items(), folder)
    assert all(offset % ALIGN == 0 for offset in info["offsets"])
    assert Path(info["path"]).stat().st_mode & 0o777 == 0o600
    back = read_chunk(info)
    assert [name for name, _ in back] == list(tensors)
    for name, tensor in back:
        want = tensors[name]
        assert tensor.dtype == want.dtype and tensor.shape == want.shape
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))


def test_a_chunk_outside_this_users_weights_folders_is_refused_by_field(folder, tmp_path):
    info = write_chunk([("w", torch.ones(4))], folder)
    elsewhere = tmp_path / "chunk"
    elsewhere.write_bytes(Path(info["path"]).read_bytes())
    link = folder / "link"
    os.symlink(info["path"], link)
    with pytest.raises(ValueError, match="'i' has dtype int32"):
        write_chunk([("i", torch.ones(2, dtype=torch.int32))], folder, "ints")
    for path in (str(elsewhere), "/etc/passwd", str(link), str(folder / ".." / folder.name / "chunk"), "chunk"):
        with pytest.raises(ValueError, match="update_info.path"):
            read_chunk({**info, "path": path})
    other = folder.parent / "ipc-1-00"  # this user's listing folder, but not a weights folder
    with pytest.raises(ValueError, match="update_info.path"):
        read_chunk({**info, "path": str(other / "chunk")})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"dtype_names": ["int64"]}, "update_info.dtype_names: 'w'"),
        ({"shapes": [[4, -1]]}, "update_info.shapes: 'w'"),
        ({"shapes": [[5]]}, "'w' ends at byte 20, past the file's"),
        ({"offsets": [3]}, "update_info.offsets: 'w'"),
        ({"offsets": [0, 64]}, "update_info.offsets has 2 entries for 1 names"),
        ({"names": []}, "update_info.dtype_names has 1 entries for 0 names"),
        ({"names": "w"}, "update_info.names must be a list"),
        ({"extra": 1}, "unknown field extra"),
    ],
)
def test_a_chunk_description_that_does_not_fit_is_refused_by_field(folder, change, named):
    info = write_chunk([("w", torch.ones(4))], folder)
    info["path"] = str(Path(info["path"]))
    Path(info["path"]).write_bytes(Path(info["path"]).read_bytes()[:16])  # 4 floats: 16 bytes, no padding
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        read_chunk({**info, **change})


def test_a_copy_takes_only_the_listed_bytes_and_refuses_a_file_that_ends_first(folder):
    tensors = [("a", torch.arange(10.0)), ("b", torch.arange(3.0).double())]
    info = write_chunk(tensors, folder, "source")
    copied = copy_chunk(info, folder, "copy")
    assert copied["path"] != info["path"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(read_chunk(copied), tensors, strict=True))
    os.truncate(info["path"], info["offsets"][1] + 8)  # b's first double only
    with pytest.raises(ValueError, match="'b' ends at byte 88, past the file's 72"):  # checked before any copy
        copy_chunk(info, folder, "copy-2")
    assert not (folder / "copy-2").exists()


class StandInEngine:
    """Records what vLLM's AsyncLLM would be asked: the start (target or draft), each chunk's tensors, the finish."""

    def __init__(self):
        self.calls: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}

    async def start_weight_update(self):
        self.calls.append("start")

    async def start_draft_weight_update(self):
        self.calls.append("start_draft")

    async def update_weights(self, request):
        self.calls.append("update")
        self.loaded.update({name: t.clone() for name, t in read_chunk(request.update_info)})

    async def finish_weight_update(self):
        self.calls.append("finish")


def module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose ``named_parameters()`` are ``tensors`` by their checkpoint names (dots nest modules)."""
    module = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        parent = module
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(tensor))
    return module


def sync_into(check, engine, versions, draft=False):
    def apply(load, version):
        asyncio.run(load(engine))
        versions.append(version)
        return version or str(len(versions))

    return WeightSync(check, "theta", apply, draft)


def test_chunks_are_checked_as_they_come_and_loaded_only_at_finish(theta, folder):
    check, weights = theta
    engine, versions = StandInEngine(), []
    sync = sync_into(check, engine, versions)
    before = set(folder.parent.glob("weights-*"))
    names = sorted(weights)
    new = {name: weights[name] + 1 for name in names}
    half = len(names) // 2
    sync.init_weight_transfer_engine({})
    with pytest.raises(ValueError, match="init_info.master_address"):
        sync.init_weight_transfer_engine({"master_address": "x"})
    with pytest.raises(ValueError, match="start_weight_update first"):
        sync.update_weights(write_chunk([(names[0], new[names[0]])], folder, "early"))
    sync.start_weight_update()
    with pytest.raises(ValueError, match="an update is open"):  # a second trainer, or a retry, would mix chunks
        sync.start_weight_update()
    sync.update_weights([write_chunk([(n, new[n]) for n in names[:half]], folder, "first")])
    huge = {**write_chunk([(names[half], new[names[half]])], folder, "huge"), "shapes": [[1 << 40]]}
    bad = {
        "nan": (names[half], torch.full_like(new[names[half]], float("nan")), f"{names[half]!r} holds a NaN"),
        "shape": (names[half], new[names[half]].reshape(-1)[:-1], f"{names[half]!r} has shape"),
        "name": ("model.no_such.weight", torch.ones(2), "'model.no_such.weight' is not a tensor of the theta model"),
        "again": (names[0], new[names[0]], f"{names[0]!r} came in an earlier chunk"),
    }
    for label, (name, tensor, message) in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            sync.update_weights(write_chunk([(name, tensor)], folder, label))
    with pytest.raises(ValueError, match=f"{names[half]!r} has shape \\(1099511627776,\\)"):
        sync.update_weights(huge)  # refused by its claimed shape, before a byte is reserved for a copy
    assert engine.calls == [] and versions == []  # nothing reached the engine
    sync.update_weights(write_chunk([(n, new[n]) for n in names[half:]], folder, "second"))
    assert sync.finish_weight_update("v1") == "v1"
    assert engine.calls == ["start", "update", "update", "finish"] and versions == ["v1"]
    assert engine.loaded.keys() == new.keys() and all(torch.equal(engine.loaded[n], new[n]) for n in names)
    assert not sync.updating
    assert set(folder.parent.glob("weights-*")) == before  # the update's private copies are gone


@pytest.fixture(scope="module")
def tied_theta():
    model = tiny_models.tiny_pair("same", tied=True)[1]
    return WeightsCheck(model), load_file(str(model / "model.safetensors"))


def test_a_refused_finish_drops_the_update_and_one_call_runs_at_a_time(tied_theta, folder):
    check, weights = tied_theta
    assert check.tied and "lm_head.weight" not in weights
    engine, versions = StandInEngine(), []
    sync = sync_into(check, engine, versions, draft=True)
    sync.start_weight_update()
    sync.update_weights(write_chunk([(n, t * 0) for n, t in list(weights.items())[:3]], folder, "zeros"))
    with pytest.raises(ValueError, match="missing"):
        sync.finish_weight_update()
    assert not sync.updating  # dropped: a client that knows only the four methods starts again
    sync.start_weight_update()
    tied = ("lm_head.weight", weights["model.embed_tokens.weight"])  # as a tied model's state_dict() lists it
    sync.update_weights(write_chunk([*weights.items(), tied], folder, "same"))

    def busy(load, version):  # another call while the finish runs is refused, not queued behind it
        with pytest.raises(ValueError, match="another weight-sync call is running"):
            sync.shutdown_weight_transfer_engine()
        asyncio.run(load(engine))
        return "v"

    sync._apply = busy
    sync.finish_weight_update()
    assert engine.calls == ["start_draft", "update", "finish"]  # the draft model's start, one chunk: the second
    assert engine.loaded.keys() == weights.keys()  # a tied output projection left out
    assert all(torch.equal(engine.loaded[n], t) for n, t in weights.items())


def test_vllms_trainer_factory_drives_a_weight_sync_through_the_shared_memory_engine(theta):
    """vLLM's own trainer-side entry point with our engine's init info, an nn.Module as the source, small chunks."""
    check, weights = theta
    module = module_of({n: t * 2 for n, t in weights.items()})
    engine, versions = StandInEngine(), []
    register()
    sender = WeightTransferTrainerFactory.trainer_init(
        SharedMemoryTrainerInitInfo(rank=0, chunk_bytes=4096),
        client=sync_into(check, engine, versions),
        source=ModuleSource(module),
    )
    sender.send_weights()
    assert engine.calls[0] == "start" and engine.calls[-1] == "finish" and engine.calls.count("update") > 2
    assert all(torch.equal(engine.loaded[n], t * 2) for n, t in weights.items())


def test_a_send_that_fails_half_way_finishes_and_leaves_the_engine_as_it_was(theta):
    """vLLM's trainer-side engine whose source fails after some chunks: the send calls finish (as TRL's clients do
    after an error), which misses tensors and so drops the update; the engine saw nothing, and the next send starts."""
    check, weights = theta
    engine, versions = StandInEngine(), []
    sync = sync_into(check, engine, versions)

    class Failing(ModuleSource):
        def __iter__(self):
            for number, pair in enumerate(super().__iter__()):
                if number == 3:
                    raise RuntimeError("the trainer's gather failed")
                yield pair

    module = module_of({n: t * 2 for n, t in weights.items()})
    register()
    init = SharedMemoryTrainerInitInfo(rank=0, chunk_bytes=1)  # a chunk per tensor
    sender = WeightTransferTrainerFactory.trainer_init(init, client=sync, source=Failing(module))
    with pytest.raises(RuntimeError, match="gather failed"):
        sender.send_weights()
    assert engine.calls == [] and not sync.updating
    WeightTransferTrainerFactory.trainer_init(init, client=sync, source=ModuleSource(module)).send_weights()
    assert engine.calls[0] == "start" and engine.calls[-1] == "finish"
    assert all(torch.equal(engine.loaded[n], t * 2) for n, t in weights.items())


def test_without_room_in_dev_shm_chunks_go_to_a_private_temporary_folder(monkeypatch, tmp_path):
    """/dev/shm too small for an update: its folder is made in the temporary directory (mode 0700), whose chunks the
    engine reads as it reads /dev/shm's; a folder of that name made by anyone else is not read."""
    import shutil as shutil_module
    import tempfile
    from types import SimpleNamespace

    from dual_sampling.lockstep import SHM_DIR

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    usage = shutil_module.disk_usage
    monkeypatch.setattr(
        shutil_module,
        "disk_usage",
        lambda path: SimpleNamespace(total=1 << 30, used=1 << 30, free=0) if Path(path) == SHM_DIR else usage(path),
    )
    made = weights_folder(1 << 20)
    try:
        assert made.parent == tmp_path and made.stat().st_mode & 0o777 == 0o700
        info = write_chunk([("w", torch.arange(6.0))], made)
        assert torch.equal(read_chunk(info)[0][1], torch.arange(6.0))
        made.chmod(0o755)  # a folder others may write into is not one of ours
        with pytest.raises(ValueError, match="update_info.path"):
            read_chunk(info)
    finally:
        made.chmod(0o700)
        shutil_module.rmtree(made)
