"""Which files of a weights folder are staged, and how much of them: exactly the files vLLM's loader reads, each
exactly as long as its header says, opened below one folder descriptor (dual_sampling.driver.weights).

No engines: every refusal here comes before anything reaches one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from dual_sampling.driver import weights
from dual_sampling.driver.weights import WeightsCheck, staged_folder
from dual_sampling.lockstep import janitor, listing_dir

O_PROJ = "model.layers.1.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def theta():
    from dual_sampling.testing import tiny_models

    folder = tiny_models.tiny_pair("same")[1]
    return folder, WeightsCheck(folder), load_file(str(folder / "model.safetensors"))


def write(folder, tensors, name="model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))
    return folder


@pytest.fixture
def leftovers(tmp_path, monkeypatch):
    """The staging folders of this process now: in /dev/shm (``.new`` ones included) and in a temporary directory
    of this test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return lambda: sorted(listing_dir().glob(f"weights-{os.getpid()}-*")) + sorted((tmp_path / "tmp").iterdir())


@pytest.fixture
def staging_made(monkeypatch):
    """The staging folders made during the test (one per staging that got as far as copying)."""
    made = []
    make = weights.weights_folder

    def recorded(*args):
        made.append(make(*args))
        return made[-1]

    monkeypatch.setattr(weights, "weights_folder", recorded)
    return made


def refused(check, source, match, **kwargs):
    with pytest.raises(ValueError, match=match), staged_folder(check, source, "theta", **kwargs):
        pass


def test_a_hidden_safetensors_file_is_refused_by_name(theta, tmp_path, staging_made):
    # vLLM's loader globs "*.safetensors", which skips hidden names: a folder of only a dot-file reloads nothing, and
    # the engine is then lost for good; a dot-file beside good files would pass the check and never load.
    _, check, tensors = theta
    only_hidden = write(tmp_path / "only-hidden", tensors, ".model.safetensors")
    refused(check, only_hidden, r"\.model\.safetensors is a hidden file, which vLLM's loader skips")
    split = write(tmp_path / "split", {k: v for k, v in tensors.items() if k != O_PROJ})
    write(split, {O_PROJ: tensors[O_PROJ]}, ".o_proj.safetensors")
    refused(check, split, r"\.o_proj\.safetensors is a hidden file")
    assert not staging_made, "a refused folder was copied"


def test_the_files_vllms_index_or_consolidated_rule_leaves_out_are_refused(theta, tmp_path):
    _, check, tensors = theta
    names = sorted(tensors)
    first, second = {k: tensors[k] for k in names[:10]}, {k: tensors[k] for k in names[10:]}
    sharded = write(
        write(tmp_path / "sharded", first, "model-00001-of-00002.safetensors"), second, "model-2.safetensors"
    )
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors" for k in first}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    # vLLM reads only the files the index maps tensors to; the staged copy (no index) would load all of them.
    refused(check, sharded, r"model-2\.safetensors is not in model\.safetensors\.index\.json")
    index["weight_map"].update({k: "model-2.safetensors" for k in second})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with staged_folder(check, sharded, "theta") as staged:
        assert sorted(p.name for p in staged.glob("*.safetensors")) == [
            "model-00001-of-00002.safetensors",
            "model-2.safetensors",
        ]
    # A consolidated*.safetensors file makes vLLM read those alone (Mistral's format).
    mixed = write(write(tmp_path / "mixed", first, "consolidated.safetensors"), second, "model.safetensors")
    refused(check, mixed, r"mixed/model\.safetensors is beside consolidated\*\.safetensors files")


def test_the_model_folders_tensors_are_those_vllm_loaded(theta, tmp_path):
    folder, _, tensors = theta
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    write(model, {"not.loaded.weight": torch.ones(3)}, ".stray.safetensors")
    assert set(WeightsCheck(model).shapes) == set(tensors)


def test_a_file_longer_than_its_header_says_is_refused_before_it_is_copied(theta, tmp_path, staging_made):
    _, check, tensors = theta
    source = write(tmp_path / "sparse", tensors)
    described = (source / "model.safetensors").stat().st_size
    os.truncate(source / "model.safetensors", 256 << 20)  # sparse: 256 MiB on paper, no more blocks on disk
    refused(check, source, f"is {256 << 20} bytes, but its header describes {described}")
    assert not staging_made, "a file longer than its header says was copied before it was refused"


def test_a_file_that_grows_after_its_check_is_copied_only_as_far_as_its_header_says(theta, tmp_path, monkeypatch):
    _, check, tensors = theta
    source = write(tmp_path / "growing", tensors)
    original = (source / "model.safetensors").read_bytes()
    make = weights.weights_folder

    def grow_then_make(*args):  # after the checks, before the copy: a writer appends 64 MiB
        with open(source / "model.safetensors", "ab") as f:
            f.truncate(len(original) + (64 << 20))
        return make(*args)

    monkeypatch.setattr(weights, "weights_folder", grow_then_make)
    with staged_folder(check, source, "theta") as staged:
        assert (staged / "model.safetensors").read_bytes() == original


def test_no_room_is_answered_clearly_and_leaves_no_folder_behind(theta, tmp_path, monkeypatch, leftovers):
    _, check, tensors = theta
    source = write(tmp_path / "new", tensors)
    before = leftovers()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:  # the copy runs out of room half way
        m.setattr(os, "sendfile", full)
        refused(check, source, r"no room left in .* to stage a copy of \d+ bytes \(No space left on device\)")
    assert leftovers() == before
    with monkeypatch.context() as m:  # /dev/shm is full as the staging folder is made (its owner file)
        m.setattr(janitor, "owner_tag", full)
        refused(check, source, "no room to stage their .* bytes: No space left on device")
    assert leftovers() == before, "a half-made staging folder (.new) was left behind"
    with monkeypatch.context() as m:  # neither /dev/shm nor the temporary directory has room: nothing is copied
        m.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 40, used=1 << 40, free=0))
        refused(check, source, r"no room to stage their \d+ bytes: neither .* has that much free")
    assert leftovers() == before


def test_a_folder_swapped_for_a_symlink_after_it_was_resolved_is_refused(theta, tmp_path):
    # The server resolves the path (allowed_weights_path), then stages: a part of the path swapped for a link in
    # between must not lead outside the allowed folders.
    _, check, tensors = theta
    root = tmp_path.resolve()
    outside = write(root / "outside" / "new", tensors)
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "new").symlink_to(outside)
    refused(check, allowed / "new", "'new' in its path is a symlink", follow_symlinks=False)
    (allowed / "trainer").symlink_to(outside.parent)
    refused(check, allowed / "trainer" / "new", "'trainer' in its path is a symlink", follow_symlinks=False)
    with staged_folder(check, outside, "theta", follow_symlinks=False) as staged:  # the real folder stages
        assert (staged / "model.safetensors").read_bytes() == (outside / "model.safetensors").read_bytes()


def test_a_float8_tensor_is_refused_by_name(theta, tmp_path):
    _, check, tensors = theta
    changed = dict(tensors, **{O_PROJ: tensors[O_PROJ].to(torch.float8_e4m3fn)})
    refused(check, write(tmp_path / "fp8", changed), r"o_proj\.weight' has dtype F8_E4M3")
    with pytest.raises(ValueError, match=r"o_proj\.weight' has dtype torch\.float8_e4m3fn"):
        check.check_state_dict(changed, "theta")
