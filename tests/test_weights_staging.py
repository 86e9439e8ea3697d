"""A folder of new weights is copied, then checked, then loaded (dual_sampling.driver.weights.staged_folder).

No engines: the checks run before anything reaches one (tests/test_live_weights.py has the loads themselves).
"""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from dual_sampling.driver.weights import WeightsCheck, staged_folder
from dual_sampling.lockstep import listing_dir
from dual_sampling.testing import tiny_models


@pytest.fixture(scope="module")
def theta():
    folder = tiny_models.tiny_pair("same")[1]
    return folder, WeightsCheck(folder), load_file(str(folder / "model.safetensors"))


def write(folder, tensors, name="model.safetensors"):
    folder.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))
    return folder


def test_a_good_folder_is_staged_as_a_private_copy(theta, tmp_path):
    _, check, tensors = theta
    source = write(tmp_path / "new", tensors)
    with staged_folder(check, source, "theta") as staged:
        assert staged != source and (staged.stat().st_mode & 0o077) == 0
        copy = staged / "model.safetensors"
        assert copy.stat().st_ino != (source / "model.safetensors").stat().st_ino
        # A trainer rewriting its folder now (the engines drain first) changes nothing that is loaded.
        write(source, {k: torch.zeros_like(v) for k, v in tensors.items()})
        assert all(torch.equal(load_file(str(copy))[k], v) for k, v in tensors.items())
    assert not staged.exists()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda t: t["model.layers.0.mlp.down_proj.weight"].__setitem__((0, 0), math.nan), "down_proj.weight"),
        (lambda t: t["model.norm.weight"].__setitem__(3, math.inf), "model.norm.weight"),
        (lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].long()), "norm.weight' has dtype I64"),
        (lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"] > 0), "norm.weight' has dtype BOOL"),
        (lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"), "o_proj.weight"),
    ],
    ids=["nan", "inf", "int64", "bool", "missing"],
)
def test_a_folder_is_checked_by_value_not_only_by_its_headers(theta, tmp_path, change, named):
    _, check, tensors = theta
    changed = {k: v.clone() for k, v in tensors.items()}
    change(changed)
    source = write(tmp_path / "bad", changed)
    with pytest.raises(ValueError, match=named), staged_folder(check, source, "theta"):
        pass
    assert not list(listing_dir().glob(f"weights-{os.getpid()}-*")), "a refused folder's copy was left behind"


def test_a_tensor_in_two_files_is_refused_naming_both(theta, tmp_path):
    _, check, tensors = theta
    names = sorted(tensors)
    source = write(tmp_path / "two", {k: tensors[k] for k in names[: len(names) // 2 + 1]}, "a.safetensors")
    write(source, {k: tensors[k] for k in names[len(names) // 2 :]}, "b.safetensors")
    both = r"is in both a\.safetensors and b\.safetensors"
    with pytest.raises(ValueError, match=both), staged_folder(check, source, "theta"):
        pass
    # Split without overlap, the same tensors load.
    os.remove(source / "b.safetensors")
    write(source, {k: tensors[k] for k in names[len(names) // 2 + 1 :]}, "b.safetensors")
    with staged_folder(check, source, "theta") as staged:
        assert sorted(p.name for p in staged.glob("*.safetensors")) == ["a.safetensors", "b.safetensors"]


def test_symlinks_fifos_and_garbage_are_refused_by_name(theta, tmp_path):
    folder, check, _ = theta
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(folder / "model.safetensors")
    # The server's folders (named by clients): a link could point anywhere, and is refused.
    with pytest.raises(ValueError, match="is a symlink"), staged_folder(check, linked, "theta", follow_symlinks=False):
        pass
    # A Python caller's folder may be links, as a Hugging Face cache snapshot is: the file they reach is copied.
    with staged_folder(check, linked, "theta") as staged:
        copy = staged / "model.safetensors"
        assert not copy.is_symlink() and copy.read_bytes() == (folder / "model.safetensors").read_bytes()
    piped = tmp_path / "piped"
    piped.mkdir()
    os.mkfifo(piped / "model.safetensors")
    outcome: list[BaseException | None] = []

    def stage() -> None:  # in a thread: a check that opened the FIFO blocking would hang here, not the suite
        try:
            with staged_folder(check, piped, "theta"):  # followed links or not, a FIFO is refused
                outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=stage, daemon=True)
    worker.start()
    worker.join(30)
    assert outcome and isinstance(outcome[0], ValueError) and "not a regular file" in str(outcome[0])
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match="not valid safetensors"), staged_folder(check, garbage, "theta"):
        pass
