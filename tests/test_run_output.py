"""A run's output: one writer at a time, and no write through a planted symlink (dual_sampling.run_output), by any of
the writers of a data run or a distillation run."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest

import dual_sampling.datagen.sinks as sinks
from dual_sampling.datagen.durable import write_text_durably
from dual_sampling.datagen.report import write_report
from dual_sampling.datagen.run import run_generation
from dual_sampling.datagen.schema import record_schema
from dual_sampling.datagen.sinks import Journal, journal_keys, open_sink, write_rejects
from dual_sampling.distill.loop import plot_run
from dual_sampling.run_output import fresh_dir, open_no_follow, own_dir, remove_path, single_writer, write_no_follow
from dual_sampling.testing.scripted import ScriptedSampler
from tests.test_datagen import tiny_config


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


@pytest.mark.parametrize("mode", ["w", "a", "wb", "ab"])
def test_an_opened_output_file_refuses_a_symlink_or_fifo_and_truncates_or_appends_its_own(tmp_path, mode):
    payload = "x" if "b" not in mode else b"x"
    target = _planted_link(tmp_path / "plot.png")
    with pytest.raises(OSError, match="plot.png cannot be written without following a link"):
        open_no_follow(tmp_path / "plot.png", mode)
    assert target.read_text() == "theirs"
    os.mkfifo(tmp_path / "piped")
    outcome: list[BaseException | None] = []
    worker = threading.Thread(target=lambda: _record(outcome, open_no_follow, tmp_path / "piped", mode), daemon=True)
    worker.start()
    worker.join(30)
    assert outcome and isinstance(outcome[0], OSError), outcome
    own = tmp_path / "own"
    own.write_text("old")
    with open_no_follow(own, mode) as f:
        f.write(payload)
    assert own.read_text() == ("oldx" if mode.startswith("a") else "x")
    with pytest.raises(ValueError, match="mode must be one of"):
        open_no_follow(own, "r+")


def _write_records(path):
    rows = [
        {"id": f"p{i}", "sample_index": 0, "alpha": [0.2, 0.5, 0.7], "num_tokens": 3, "finish_reason": "stop"}
        | {"log_w_theta": -0.1 * i, "log_w_teacher": 0.1 * i}
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet_part(tmp_path):
    sink = open_sink({"parts": tmp_path / "parts"}, resume=False, fmt="records")  # it removes stale part-*.tmp
    planted = tmp_path / "parts" / "part-000000.parquet.tmp"
    return planted, lambda: sink.write([_one_record()])


def _one_record():
    return dict.fromkeys(record_schema("records").names) | {"id": "p0", "sample_index": 0}


PLOT_ROWS = [{"round": r, "wall_s": 10.0 * r, "kl_teacher_student": 1.0 / (r + 1)} for r in range(3)]
WRITERS = {
    # name: (tmp_path -> (the name a link is planted at, the write that must refuse it))
    "new journal": lambda t: (t / "out.jsonl", lambda: Journal(t / "out.jsonl", resume=False)),
    "resumed journal": lambda t: (t / "out.jsonl", lambda: Journal(t / "out.jsonl", resume=True)),
    "journal's torn-tail repair": lambda t: (t / "out.jsonl", lambda: journal_keys(t / "out.jsonl")),
    "rejects": lambda t: (t / "r.jsonl.tmp", lambda: write_rejects(t / "r.jsonl", [{"id": "p1", "why": "empty"}])),
    "manifest or summary": lambda t: (t / "summary.json.tmp", lambda: write_text_durably(t / "summary.json", "{}")),
    "Parquet part": _parquet_part,
    "Parquet from the journal": lambda t: (
        t / "out.parquet.tmp",
        lambda: sinks._write_parquet(t / "none.jsonl", t / "out.parquet", "records"),
    ),
    "distillation plot": lambda t: (t / "plot.png", lambda: plot_run(PLOT_ROWS, t / "plot.png")),
    "report plot": lambda t: (t / "alpha_hist.png", lambda: write_report(_write_records(t / "records.jsonl"), t)),
    "report summary": lambda t: (t / "summary.md", lambda: write_report(_write_records(t / "records.jsonl"), t)),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_of_a_run_refuses_a_planted_link_and_leaves_its_target_alone(tmp_path, writer):
    planted, write = WRITERS[writer](tmp_path)
    target = _planted_link(planted)
    torn = '{"id": "p0", "sample_index": 0}\n{"torn'  # what a repair would cut, were it to follow the link
    target.write_text(torn)
    with pytest.raises(OSError, match=f"{planted.name} cannot be written without following a link"):
        write()
    assert target.read_text() == torn


FOLDER_WRITERS = {
    # name: (tmp_path, tiny_same) -> (the folder a link is planted at, the write that must refuse it)
    "report folder": lambda t, _: (
        t / "report",
        lambda: write_report(_write_records(t / "records.jsonl"), t / "report"),
    ),
    "default report folder": lambda t, _: (
        t / "records.jsonl.report",
        lambda: write_report(_write_records(t / "records.jsonl")),
    ),
    "data run's folder of parts": lambda t, pair: (
        t / "parts",
        lambda: run_generation(tiny_config(pair, t, output=str(t / "parts")), ScriptedSampler(pair)),
    ),
    "Parquet parts sink": lambda t, _: (
        t / "parts",
        lambda: open_sink({"parts": t / "parts"}, False, "records").write([_one_record()]),
    ),
}


@pytest.mark.parametrize("writer", FOLDER_WRITERS)
def test_every_folder_of_a_run_refuses_a_link_by_name_and_nothing_goes_through_it(tmp_path, tiny_same, writer):
    planted, write = FOLDER_WRITERS[writer](tmp_path, tiny_same)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match=f"{re.escape(str(planted))} must be a plain folder, not a link"):
        write()
    assert not list(elsewhere.iterdir()) and planted.is_symlink()


def test_an_own_folder_is_made_or_kept_and_a_file_or_dangling_link_there_refused(tmp_path):
    made = own_dir(tmp_path / "a" / "b")
    assert made.is_dir() and not made.is_symlink()
    (made / "kept").write_text("x")
    assert own_dir(made) == made and (made / "kept").read_text() == "x"
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for taken in (tmp_path / "file", tmp_path / "dangling"):
        with pytest.raises(ValueError, match=f"{re.escape(str(taken))} must be a plain folder"):
            own_dir(taken)
    assert not (tmp_path / "nowhere").exists()


def test_plots_are_pngs_in_their_own_files(tmp_path):
    plot_run(PLOT_ROWS, tmp_path / "plot.png")
    write_report(_write_records(tmp_path / "records.jsonl"), tmp_path / "report")
    for png in (tmp_path / "plot.png", tmp_path / "report" / "alpha_hist.png"):
        assert png.read_bytes().startswith(b"\x89PNG"), png


def _planted_link(path):
    """A symlink at ``path`` to a file of someone else's holding "theirs"; returns that file."""
    target = path.parent / f"{path.name}.target"
    target.write_text("theirs")
    path.symlink_to(target)
    return target
