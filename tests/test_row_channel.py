"""The row channel (``dual_sampling.lockstep.row_channel``): the choice of transport, the host transport's rows, and
the GPU transports where a GPU is (tests marked ``gpu``, run by ``make gpu-check``).

The lockstep protocol around it (a row announced only after its write, slots, failures) runs on the host transport in
every engine test; here the channel itself is checked against what was written, slot by slot.
"""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import pickle
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dual_sampling.lockstep import SessionLayout, SyncSession, cleanup_stale_sessions
from dual_sampling.lockstep.engine_config import LockstepConfig
from dual_sampling.lockstep.janitor import listing_dir
from dual_sampling.lockstep.layout import SyncError
from dual_sampling.lockstep.row_channel import (
    BufferHandle,
    DeviceRows,
    HostRows,
    PinnedRows,
    open_row_channel,
    read_handle,
    resolve_transport,
    write_handle,
)
from dual_sampling.options import EngineOptions


@pytest.mark.parametrize(
    ("requested", "device", "same", "chosen"),
    [
        ("auto", "cpu", True, "host"),
        ("auto", "cuda", True, "device"),
        ("auto", "cuda", False, "pinned"),
        ("host", "cuda", True, "host"),
        ("pinned", "cuda", False, "pinned"),
        ("device", "cuda", True, "device"),
    ],
)
def test_auto_picks_device_then_pinned_then_host(requested, device, same, chosen):
    assert resolve_transport(requested, device, same) == chosen


@pytest.mark.parametrize(
    ("requested", "device", "same", "words"),
    [
        ("device", "cpu", True, "needs CUDA engines"),
        ("pinned", "cpu", True, "needs CUDA engines"),
        ("device", "cuda", False, "both engines on one GPU"),
        ("shm", "cpu", True, "must be one of"),
    ],
)
def test_a_transport_these_engines_cannot_use_is_refused_by_name(requested, device, same, words):
    with pytest.raises(ValueError, match="row_transport") as error:
        resolve_transport(requested, device, same)
    assert words in str(error.value)


def test_the_option_and_the_engine_setting_are_checked_where_they_are_made():
    with pytest.raises(ValueError, match="row_transport must be one of"):
        EngineOptions(row_transport="gpu")
    with pytest.raises(ValueError, match="row_transport must be one of"):
        LockstepConfig("teacher", "s", 10.0, row_transport="auto")  # the driver resolves it before it crosses
    assert LockstepConfig("theta", "s", 10.0, row_transport="device").to_engine()
    for transport in ("pinned", "device"):
        with pytest.raises(ValueError, match=f"row_transport='{transport}' needs a CUDA engine"):
            open_row_channel(transport, "theta", np.zeros((2, 4), np.float32), torch.device("cpu"), None, 1.0)


def test_host_rows_read_back_what_was_published_slot_by_slot():
    shared = np.full((6, 50), np.nan, dtype=np.float32)
    channel = HostRows(shared)
    g = torch.Generator().manual_seed(0)
    rows = torch.log_softmax(torch.randn(3, 50, generator=g, dtype=torch.float64), -1)  # converted to float32
    channel.publish([4, 1, 2], rows)
    np.testing.assert_array_equal(shared[[4, 1, 2]], rows.float().numpy())
    assert np.isnan(shared[[0, 3, 5]]).all(), "a slot not published was written"
    consecutive = channel.read([1, 2], torch.device("cpu"))
    assert consecutive.data_ptr() == torch.from_numpy(shared)[1].data_ptr(), "consecutive slots are read in place"
    torch.testing.assert_close(consecutive, rows[1:].float())
    scattered = channel.read([4, 1], torch.device("cpu"))
    torch.testing.assert_close(scattered, rows[[0, 1]].float())
    again = channel.read([2, 4], torch.device("cpu"))  # the kept buffer, refilled
    torch.testing.assert_close(again, rows[[2, 0]].float())


def test_the_device_handle_goes_with_its_session_and_with_a_dead_drivers_session(tmp_path):
    session = SyncSession.create(SessionLayout(8, 2, 4, 1), shm_dir=tmp_path)
    handle = session.rows_handle_path
    handle.write_bytes(b"handle")
    session.close()
    assert not handle.exists()
    # A driver that died: its session and handle stay until the next session's cleanup.
    private = listing_dir(tmp_path)
    dead = private / "dual-sampling-999999999-abcdef.rows"
    torn = private / "dual-sampling-999999998-abcdef.rows.tmp"  # died between writing and renaming it
    older = tmp_path / "dual-sampling-999999997-abcdef.rows"  # an older version's, beside its session
    alive = private / f"dual-sampling-{os.getpid()}-abcdef.rows"  # a running driver's: left alone
    for path in (dead, torn, older, alive):
        path.write_bytes(b"handle")
    removed = cleanup_stale_sessions(tmp_path)
    assert {dead.name, torn.name, older.name} <= set(removed)
    assert not dead.exists() and not torn.exists() and not older.exists()
    assert alive.exists()


def test_the_device_handle_lies_in_the_users_private_folder_not_in_the_shared_one(tmp_path):
    tmp_path.chmod(0o1777)  # as /dev/shm: anyone may make a name there
    with SyncSession.create(SessionLayout(8, 2, 4, 1), shm_dir=tmp_path) as session:
        folder = session.rows_handle_path.parent
        assert folder == listing_dir(tmp_path) and folder != tmp_path
        assert stat.S_IMODE(folder.lstat().st_mode) == 0o700 and folder.lstat().st_uid == os.getuid()
        assert session.rows_handle_path.name == f"{session.name}.rows"


HANDLE = BufferHandle(
    tensor_size=(4, 8),
    tensor_stride=(8, 1),
    tensor_offset=0,
    storage_device=0,
    storage_handle=bytes(range(64)),
    storage_size_bytes=128,
    storage_offset_bytes=512,
    ref_counter_handle=b"/torch_123_456_0",
    ref_counter_offset=3,
    event_handle=b"\0" * 64,
    event_sync_required=True,
)


def test_a_handle_is_written_as_json_and_read_back_field_for_field(tmp_path):
    path = tmp_path / "session.rows"
    assert read_handle(path) is None  # not written yet: theta keeps waiting
    write_handle(path, HANDLE)
    assert read_handle(path) == HANDLE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not (tmp_path / "session.rows.tmp").exists()
    fields = json.loads(path.read_bytes())
    assert fields["tensor_size"] == [4, 8] and base64.b64decode(fields["storage_handle"]) == bytes(range(64))
    with pytest.raises(TimeoutError, match="never appeared"):
        DeviceRows.attach(tmp_path / "other.rows", timeout=0.05)


class _Planted:
    """A pickle that runs code when loaded: it makes the folder ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _plant(path: Path, case: str, monkeypatch) -> str:
    """Put what ``case`` names at the handle ``path``; return words the refusal must hold."""
    if case == "pickle":
        path.write_bytes(pickle.dumps(_Planted(path.parent / "ran")))
        return "not JSON"
    write_handle(path, HANDLE)
    if case == "symlink":
        path.rename(path.with_name("elsewhere"))
        path.symlink_to(path.with_name("elsewhere"))
        return "Too many levels of symbolic links"
    if case == "fifo":
        path.unlink()
        os.mkfifo(path, 0o600)
        return "not a regular file"
    if case == "another user's":
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
        return "owned by uid"
    if case in ("group-writable", "world-writable"):
        path.chmod(0o620 if case == "group-writable" else 0o602)
        return "writable by its group or by others"
    fields = json.loads(path.read_bytes())
    if case == "missing field":
        del fields["event_handle"]
        words = "missing or unknown"
    elif case == "bad base64":
        fields["storage_handle"] = "not base64!"
        words = "storage_handle must be non-empty base64"
    elif case == "bool for int":
        fields["storage_size_bytes"] = True
        words = "storage_size_bytes must be an integer"
    else:
        fields["format"] = "something else"
        words = "format is not"
    path.write_text(json.dumps(fields))
    path.chmod(0o600)
    return words


@pytest.mark.parametrize(
    "case",
    [
        "pickle",
        "symlink",
        "fifo",
        "another user's",
        "group-writable",
        "world-writable",
        "missing field",
        "bad base64",
        "bool for int",
        "format",
    ],
)
def test_theta_refuses_a_handle_it_cannot_trust_at_once_and_runs_nothing_in_it(tmp_path, monkeypatch, case):
    path = tmp_path / "session.rows"
    words = _plant(path, case, monkeypatch)
    outcome: list[BaseException | None] = []
    # In a thread: reading a FIFO planted there would block for ever (the code before the fix did).
    worker = threading.Thread(target=_attach, args=(path, outcome), daemon=True)
    worker.start()
    worker.join(60)
    assert outcome, "theta waited on the planted handle instead of refusing it"
    refused = outcome[0]
    assert isinstance(refused, SyncError), refused
    assert f"row_transport='device': the rows handle {path} is refused" in str(refused) and words in str(refused)
    assert not (tmp_path / "ran").exists(), "the planted pickle ran"


def _attach(path: Path, outcome: list) -> None:
    try:
        DeviceRows.attach(path, timeout=30)
        outcome.append(None)
    except BaseException as exc:
        outcome.append(exc)


def _theta_side(handle_path: str, done) -> None:
    channel = DeviceRows.attach(Path(handle_path), timeout=60)
    channel.publish([3, 0], torch.arange(2 * 8, dtype=torch.float32, device="cuda").reshape(2, 8))
    done.set()


@pytest.mark.gpu
def test_on_a_gpu_theta_writes_the_teachers_buffer_from_its_own_process(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    teacher = DeviceRows.create(tmp_path / "session.rows", 4, 8, torch.device("cuda"))
    context = multiprocessing.get_context("spawn")
    done = context.Event()
    theta = context.Process(target=_theta_side, args=(str(tmp_path / "session.rows"), done))
    theta.start()
    assert done.wait(120), "theta's process never published"
    theta.join(60)
    got = teacher.read([3, 0], torch.device("cuda")).cpu()
    torch.testing.assert_close(got, torch.arange(16, dtype=torch.float32).reshape(2, 8))
    assert torch.isnan(teacher.read([1, 2], torch.device("cuda"))).all()


@pytest.mark.gpu
def test_on_a_gpu_pinned_rows_round_trip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    shared = np.full((4, 1000), np.nan, dtype=np.float32)
    channel = PinnedRows(shared, torch.device("cuda"))
    try:
        rows = torch.randn(2, 1000, device="cuda")
        channel.publish([2, 0], rows)
        np.testing.assert_array_equal(shared[[2, 0]], rows.cpu().numpy())
        torch.testing.assert_close(channel.read([0, 2], torch.device("cuda")), rows[[1, 0]])
    finally:
        channel.close()
