"""A run's output: one writer at a time, and no write through a planted symlink (dual_sampling.run_output)."""

from __future__ import annotations

import os
import threading

import pytest

from dual_sampling.run_output import fresh_dir, remove_path, single_writer, write_no_follow


def test_a_second_writer_fails_at_once_naming_the_lock(tmp_path):
    lock = tmp_path / "out.lock"
    refused = pytest.raises(FileExistsError, match=f"{tmp_path / 'out'} is being written by another run.*{lock}")
    with single_writer(tmp_path / "out", lock), refused, single_writer(tmp_path / "out", lock):
        pass
    with single_writer(tmp_path / "out", lock):  # released: the next run takes it
        pass


def test_writes_refuse_a_symlink_and_fresh_dirs_remove_it_without_touching_its_target(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("theirs")
    (tmp_path / "metrics.jsonl").symlink_to(target / "keep.txt")
    with pytest.raises(OSError):
        write_no_follow(tmp_path / "metrics.jsonl", "row\n", append=True)
    assert (target / "keep.txt").read_text() == "theirs"
    os.mkfifo(tmp_path / "piped.jsonl")  # opening it to write would wait for a reader: refused at once instead
    outcome: list[BaseException | None] = []
    worker = threading.Thread(target=lambda: _record(outcome, write_no_follow, tmp_path / "piped.jsonl", "x"))
    worker.start()
    worker.join(30)
    assert outcome and isinstance(outcome[0], OSError), outcome
    write_no_follow(tmp_path / "own.jsonl", "a\n")
    write_no_follow(tmp_path / "own.jsonl", "b\n", append=True)
    assert (tmp_path / "own.jsonl").read_text() == "a\nb\n"
    (tmp_path / "partial").symlink_to(target)
    made = fresh_dir(tmp_path / "partial")
    assert made.is_dir() and not made.is_symlink() and not list(made.iterdir())
    assert (target / "keep.txt").read_text() == "theirs"
    (made / "file").write_text("x")
    fresh_dir(made)  # a folder of its own is emptied
    assert not list(made.iterdir())
    remove_path(made)
    remove_path(made)  # nothing there: nothing to do
    assert not made.exists()


def _record(outcome: list, function, *args) -> None:
    try:
        function(*args)
        outcome.append(None)
    except BaseException as exc:
        outcome.append(exc)
