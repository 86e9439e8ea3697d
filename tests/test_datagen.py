"""Data-generation runs: records, formats, shards, bad input, and kill-and-resume."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dual_sampling.api import derive_seed
from dual_sampling.cli import _run_settings, build_parser, main
from dual_sampling.datagen.inputs import load_rows, shard_of
from dual_sampling.datagen.report import write_report
from dual_sampling.datagen.run import run_generation
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.datagen.schema import record_schema
from dual_sampling.datagen.sinks import read_journal, read_records
from dual_sampling.lockstep import SESSION_PREFIX, SessionLayout, SyncSession
from dual_sampling.testing.scripted import ScriptedSampler
from tests.oracles import assert_written_records_match_rescoring
from tests.test_cli import run_cli_here

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "math_problems.jsonl"


def problems(path: Path, count: int, extra: dict | None = None) -> Path:
    rows = [
        {"id": f"p{i}", "problem": f"What is {i} plus {2 * i}?", "solution": f"{i} + {2 * i} = {3 * i}."}
        for i in range(count)
    ]
    for row in rows[:1]:
        row.update(extra or {})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_config(tiny_same, tmp_path: Path, **overrides) -> RunConfig:
    teacher, theta = tiny_same
    if "input" not in overrides:
        overrides["input"] = str(problems(tmp_path / "in.jsonl", 6))
    settings = dict(
        teacher=str(teacher),
        theta=str(theta),
        output=str(tmp_path / "out.jsonl"),
        hint_field="solution",
        id_field="id",
        n=2,
        max_tokens=12,
        max_num_seqs=4,
        max_model_len=256,
        sync_timeout=30,
        use_tqdm=False,
        batch_size=4,
        seed=7,
    )
    settings.update(overrides)
    return RunConfig.from_settings(settings)


def cli_flags(tiny_same, **settings) -> list[str]:
    """``dual-sampling generate`` flags for the tiny pair and ``settings`` (the same keys as RunConfig's)."""
    teacher, theta = tiny_same
    base = dict(
        teacher=teacher,
        theta=theta,
        hint_field="solution",
        id_field="id",
        max_num_seqs=4,
        max_model_len=256,
        sync_timeout=30,
    )
    flags = [part for key, value in {**base, **settings}.items() for part in (f"--{key.replace('_', '-')}", str(value))]
    return [*flags, "--no-use-tqdm"]


class FailingSampler:
    """The shared engine, but every sample whose seed is divisible by 3 comes back failed (fault injection)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        out = self.engine.generate(*args, **kwargs)
        for req in out.requests:
            for sample in req.samples:
                if sample.seed % 3 == 0:
                    sample.finish_reason, sample.error = "error", "sync_timeout at step 1"
        return out


def strict_json(text: str):
    """JSON as the standard has it: NaN and infinity are refused."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"non-finite number {name} in {text[:200]!r}"))


def all_pairs(count: int = 6, n: int = 2) -> set:
    return {(f"p{i}", j) for i in range(count) for j in range(n)}


# ---------------------------------------------------------------- no engine


def test_torn_last_line_is_cut_and_damage_elsewhere_is_refused(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"id": "a", "sample_index": 0}\n{"id": "b", "sample_index": 0}\n{"id": "c", "samp')
    assert [r["id"] for r in read_journal(path)] == ["a", "b"]
    assert path.read_text().endswith('"sample_index": 0}\n')
    path.write_text('{"id": "a"}\n{"id": \n{"id": "c"}\n')
    with pytest.raises(ValueError, match="j.jsonl:2 is not a complete JSON record"):
        read_journal(path)


def test_shards_are_stable_and_balanced():
    ids = [f"row-{i}" for i in range(3000)]
    sizes = Counter(shard_of(i, 3) for i in ids)
    assert all(800 < sizes[k] < 1200 for k in range(3))
    # The shard of an id depends on the id alone: not on the order, the process or the other ids.
    assert [shard_of(i, 3) for i in reversed(ids)] == [shard_of(i, 3) for i in ids][::-1]
    script = "from dual_sampling.datagen.inputs import shard_of; print([shard_of(f'row-{i}', 3) for i in range(50)])"
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str([shard_of(f"row-{i}", 3) for i in range(50)])


def test_inputs_jsonl_parquet_and_datasets_folder(tmp_path):
    src = problems(tmp_path / "p.jsonl", 5)
    rows = load_rows(str(src))
    from datasets import Dataset

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(str(tmp_path / "p.parquet")) == rows
    assert load_rows(str(tmp_path / "ds")) == rows
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))


def test_config_file_and_flags_merge_and_flags_win(tiny_same, tmp_path):
    teacher, theta = tiny_same
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"max-tokens: 99\ntemperature: 0.5\nstop: ['END']\nalpha_method: ess_balance\nteacher: {teacher}\n")
    args = build_parser().parse_args(
        [
            "generate",
            "--config",
            str(cfg),
            "--temperature",
            "0.7",
            "--no-chat-template",
            "--input",
            "in.jsonl",
            "--output",
            "o.jsonl",
            "--theta",
            str(theta),
            "--stop-token-ids",
            "5",
            "7",
            "--logit-bias",
            '{"11": -5}',
        ]
    )
    run = RunConfig.from_settings(_run_settings(args))
    assert run.sampling.temperature == 0.7 and run.sampling.max_tokens == 99 and run.sampling.stop == ["END"]
    assert run.sampling.stop_token_ids == [5, 7] and run.sampling.logit_bias == {11: -5}
    assert run.engine.alpha_method == "ess_balance" and run.source.chat_template is False
    (tmp_path / "bad.yaml").write_text("max_tokenz: 3\n")
    assert main(["generate", "--config", str(tmp_path / "bad.yaml"), "--input", "x", "--output", "y.jsonl"]) == 2
    with pytest.raises(ValueError, match="unknown setting 'max_tokenz'"):
        RunConfig.from_settings({"input": "x", "output": "y.jsonl", "max_tokenz": 3})


def test_bad_config_values_are_named(tiny_same, tmp_path):
    with pytest.raises(ValueError, match="shard must satisfy"):
        tiny_config(tiny_same, tmp_path, shard="2/2")
    with pytest.raises(ValueError, match="output must be a .jsonl or .parquet file, or a directory"):
        tiny_config(tiny_same, tmp_path, output=str(tmp_path / "out.csv"))
    with pytest.raises(ValueError, match="format must be"):
        tiny_config(tiny_same, tmp_path, format="chat")
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        tiny_config(tiny_same, tmp_path, replicas=0)
    with pytest.raises(ValueError, match="ray_max_retries must be an integer >= 0"):
        tiny_config(tiny_same, tmp_path, ray_max_retries=-1)
    with pytest.raises(ValueError, match="keep_truncated applies to format 'messages' only"):
        tiny_config(tiny_same, tmp_path, keep_truncated=True)


# ---------------------------------------------------------------- scripted samples, no engine


def test_stop_strings_and_stop_tokens_share_one_schema_in_jsonl_parquet_and_parts(tiny_same, tmp_path):
    def script(key, j):
        if key in ("p4", "p5"):  # their batch's part holds no stop at all: its columns are typed all the same
            return {"finish_reason": "length", "stop_reason": None, "theta_version": "step-3"}
        return {"stop_reason": "\n\n"} if j == 0 else {}

    outputs = [tmp_path / "out.jsonl", tmp_path / "out.parquet", tmp_path / "parts"]
    for out in outputs:
        run_generation(
            tiny_config(tiny_same, tmp_path, output=str(out), batch_size=2), ScriptedSampler(tiny_same, script)
        )
    by_key = [{(r["id"], r["sample_index"]): r for r in read_records(str(out))} for out in outputs]
    assert by_key[0].keys() == all_pairs() and by_key[0] == by_key[1] == by_key[2]
    for (key, j), r in by_key[0].items():
        expected = (None, None) if key in ("p4", "p5") else ("\n\n", None) if j == 0 else (None, 2)
        assert (r["stop_reason"], r["stop_token_id"]) == expected, (key, j)
    assert by_key[1][("p0", 0)]["models"]["teacher"]["blake2b"]  # JSON-text columns come back as the same objects
    # Each record names the weights that drew it (a trainer's importance weights depend on them).
    assert {k: (r["teacher_version"], r["theta_version"]) for k, r in by_key[0].items()} == {
        (key, j): ("0", "step-3" if key in ("p4", "p5") else "0") for key, j in all_pairs()
    }
    schema = record_schema("records")
    parts = sorted((tmp_path / "parts").glob("part-*.parquet"))
    assert len(parts) == 3
    for path in [tmp_path / "out.parquet", *parts]:
        assert pq.read_schema(path).equals(schema, check_metadata=False), path
    assert pa.concat_tables(pq.read_table(p) for p in parts).num_rows == 12  # one table: the parts' schemas agree
    # A resume rewrites the Parquet file from the journal with the same schema.
    journal = tmp_path / "out.parquet.journal.jsonl"
    journal.write_text("".join(line + "\n" for line in journal.read_text().splitlines()[:5]))
    resumed = run_generation(
        tiny_config(tiny_same, tmp_path, output=str(tmp_path / "out.parquet"), batch_size=2, resume=True),
        ScriptedSampler(tiny_same, script),
    )
    assert resumed["samples_already_done"] == 5 and resumed["samples_written"] == 7
    assert {(r["id"], r["sample_index"]): r for r in read_records(str(tmp_path / "out.parquet"))} == by_key[0]


@pytest.mark.timeout(50)  # under the holder's 60 s
def test_a_second_run_on_the_same_output_fails_at_once_and_leaves_it_alone(tiny_same, tmp_path):
    out = tmp_path / "out.jsonl"
    run_generation(tiny_config(tiny_same, tmp_path), ScriptedSampler(tiny_same))
    kept = out.read_text().splitlines()[:5]
    # As if another run were writing it: a record half-written, and that run holding the lock.
    out.write_text("".join(line + "\n" for line in kept) + kept[-1][:20])
    before = out.read_bytes()
    lock = Path(str(out) + ".lock")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import time, filelock; held = filelock.FileLock({str(lock)!r}); held.acquire(); print(1); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "1"
        sampler = ScriptedSampler(tiny_same)
        # "At once": the lock is tried without waiting, so a run that waited for it would hang here (the holder
        # keeps it 60 s) and fail on the test's timeout instead.
        with pytest.raises(FileExistsError, match=f"{out} is being written by another run: its lock file {lock}"):
            run_generation(tiny_config(tiny_same, tmp_path, resume=True), sampler)
        assert not sampler.drawn
        assert out.read_bytes() == before  # the other run's torn tail is its own business: not cut
    finally:
        holder.kill()
        holder.wait()
    summary = run_generation(tiny_config(tiny_same, tmp_path, resume=True), ScriptedSampler(tiny_same))
    assert summary["samples_already_done"] == 5 and summary["samples_written"] == 7
    assert Counter((r["id"], r["sample_index"]) for r in read_journal(out)) == Counter(all_pairs())


def test_resume_refuses_a_changed_input_or_a_missing_manifest(tiny_same, tmp_path):
    src = problems(tmp_path / "in.jsonl", 6)
    run_generation(tiny_config(tiny_same, tmp_path, input=str(src)), ScriptedSampler(tiny_same))
    original, stat = src.read_bytes(), src.stat()
    src.write_bytes(original.replace(b"What is 4 plus 8?", b"What is 4 plus 9?"))  # same size ...
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and the same modification time
    with pytest.raises(ValueError, match=f"its input changed since the run started: {src} changed"):
        run_generation(tiny_config(tiny_same, tmp_path, input=str(src), resume=True), ScriptedSampler(tiny_same))
    src.write_bytes(original)
    manifest = tmp_path / "out.jsonl.manifest.json"
    manifest.unlink()
    with pytest.raises(FileNotFoundError, match=f"its manifest {manifest} is missing"):
        run_generation(tiny_config(tiny_same, tmp_path, input=str(src), resume=True), ScriptedSampler(tiny_same))
    # With nothing written yet, --resume starts the run (a job restarted with the same command line).
    fresh = run_generation(
        tiny_config(tiny_same, tmp_path, input=str(src), output=str(tmp_path / "new.jsonl"), resume=True),
        ScriptedSampler(tiny_same),
    )
    assert fresh["samples_written"] == 12 and (tmp_path / "new.jsonl.manifest.json").exists()


def test_resume_refuses_a_datasets_folder_with_a_changed_file(tiny_same, tmp_path):
    from datasets import Dataset

    rows = load_rows(str(problems(tmp_path / "p.jsonl", 6)))
    folder = tmp_path / "ds"
    Dataset.from_list(rows).save_to_disk(str(folder))
    cfg = dict(input=str(folder), output=str(tmp_path / "out.jsonl"))
    run_generation(tiny_config(tiny_same, tmp_path, **cfg), ScriptedSampler(tiny_same))
    rows[4]["problem"] = "What is 4 plus 9?"
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds2"))
    changed = sorted(p.name for p in folder.glob("*.arrow"))
    for name in changed:
        (folder / name).write_bytes((tmp_path / "ds2" / name).read_bytes())
    with pytest.raises(ValueError, match=f"{folder / changed[0]} changed"):
        run_generation(tiny_config(tiny_same, tmp_path, resume=True, **cfg), ScriptedSampler(tiny_same))


def test_messages_leave_out_answers_cut_at_max_tokens_unless_kept(tiny_same, tmp_path):
    def script(key, j):
        return {"finish_reason": "length", "stop_reason": None} if j == 1 else {}

    out = tmp_path / "msg.jsonl"
    cfg = dict(output=str(out), format="messages")
    first = run_generation(tiny_config(tiny_same, tmp_path, **cfg), ScriptedSampler(tiny_same, script))
    written = read_journal(out)
    assert {(r["id"], r["sample_index"]) for r in written} == {(f"p{i}", 0) for i in range(6)}
    assert not any(r["truncated"] for r in written)
    assert first["samples_written"] == 6 and first["truncated_left_out"] == 6 and first["failed_samples"] == 0
    left_out = [json.loads(line) for line in (tmp_path / "msg.truncated.jsonl").read_text().splitlines()]
    assert {(r["id"], r["sample_index"]) for r in left_out} == {(f"p{i}", 1) for i in range(6)}
    # Left out is done: a resume draws none of them again.
    again = ScriptedSampler(tiny_same, script)
    resumed = run_generation(tiny_config(tiny_same, tmp_path, resume=True, **cfg), again)
    assert not again.drawn and resumed["samples_already_done"] == 12 and resumed["samples_written"] == 0
    kept_cfg = dict(output=str(tmp_path / "kept.parquet"), format="messages", keep_truncated=True)
    kept = run_generation(tiny_config(tiny_same, tmp_path, **kept_cfg), ScriptedSampler(tiny_same, script))
    assert kept["samples_written"] == 12 and kept["truncated_samples"] == 6 and kept["truncated_left_out"] == 0
    table = pq.read_table(tmp_path / "kept.parquet")
    assert table.schema.equals(record_schema("messages"), check_metadata=False)
    assert all(r["truncated"] == (r["sample_index"] == 1) for r in table.to_pylist())
    assert table.to_pylist()[0]["messages"][-1] == {"role": "assistant", "content": "answer p0/0"}


def test_non_finite_numbers_make_a_failed_sample_and_never_reach_a_file(tiny_same, tmp_path):
    bad = {
        ("p1", 0): {"logq": [-1.0, math.nan, -1.0]},
        ("p2", 1): {"alpha": [math.inf, 0.5, 0.5]},
        ("p3", 0): {"logp_theta": [-math.inf, -1.0, -1.0]},
    }
    for out in (tmp_path / "out.jsonl", tmp_path / "out.parquet"):
        summary = run_generation(
            tiny_config(tiny_same, tmp_path, output=str(out)),
            ScriptedSampler(tiny_same, lambda k, j: bad.get((k, j), {})),
        )
        assert summary["failures"] == {"non_finite_record": 3} and summary["samples_written"] == 9
        records = read_records(str(out))
        assert {(r["id"], r["sample_index"]) for r in records} == all_pairs() - set(bad)
        assert all(math.isfinite(x) for r in records for k in ("alpha", "logq", "logp_theta") for x in r[k])
        failed = [strict_json(line) for line in out.with_name(out.stem + ".failed.jsonl").read_text().splitlines()]
        assert {(f["id"], f["sample_index"]): f["error"] for f in failed} == {
            ("p1", 0): "non_finite_record at token 1: logq is nan",
            ("p2", 1): "non_finite_record at token 0: alpha is inf",
            ("p3", 0): "non_finite_record at token 0: logp_theta is -inf",
        }
        strict_json(Path(str(out) + ".summary.json").read_text())
    for line in (tmp_path / "out.jsonl").read_text().splitlines() + (
        tmp_path / "out.parquet.journal.jsonl"
    ).read_text().splitlines():
        strict_json(line)


def test_parquet_output_reaches_the_disk_before_and_after_its_rename(tiny_same, tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def logged_replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    out = tmp_path / "out.parquet"
    run_generation(tiny_config(tiny_same, tmp_path, output=str(out)), ScriptedSampler(tiny_same))
    rename = events.index(("replace", f"{out}.tmp", str(out)))
    assert ("fsync", f"{out}.tmp") in events[:rename]  # the file's bytes first ...
    assert ("fsync", str(tmp_path)) in events[rename + 1 :]  # ... then the rename itself


# ---------------------------------------------------------------- with the shared engine


def test_records_are_complete_and_consistent(dual_engine, tiny_same, tmp_path):
    src = tmp_path / "in.jsonl"
    problems(src, 6)
    with src.open("a") as f:
        f.write(json.dumps({"id": "empty", "problem": "  ", "solution": "-"}) + "\n")
        f.write(json.dumps({"id": "long", "problem": "word " * 400, "solution": "-"}) + "\n")
    cfg = tiny_config(tiny_same, tmp_path, input=str(src))
    started = time.monotonic()
    summary = run_generation(cfg, sampler=dual_engine)
    elapsed = time.monotonic() - started
    records = read_journal(Path(cfg.output))
    assert Counter((r["id"], r["sample_index"]) for r in records) == Counter(
        (f"p{i}", j) for i in range(6) for j in range(2)
    )
    rejects = [json.loads(line) for line in (tmp_path / "out.rejects.jsonl").read_text().splitlines()]
    assert {r["id"]: r["reason"] for r in rejects}.keys() == {"empty", "long"}
    assert "max_model_len" in next(r["reason"] for r in rejects if r["id"] == "long")
    assert summary["samples_written"] == 12 and summary["rejected_prompts"] == 2 and summary["failed_samples"] == 0
    for r in records:
        n = r["num_tokens"]
        assert n == len(r["token_ids"]) == len(r["alpha"]) == len(r["logq"]) >= 1
        assert r["sum_logq"] == pytest.approx(math.fsum(r["logq"]))
        assert r["log_w_theta"] == pytest.approx(math.fsum(r["logp_theta"]) - math.fsum(r["logq"]))
        assert r["log_w_teacher"] == pytest.approx(math.fsum(r["logp_teacher"]) - math.fsum(r["logq"]))
        assert "Use it as a hint" in r["teacher_prompt"] and "hint" not in r["theta_prompt"]
        assert r["models"]["teacher"]["blake2b"] and r["alpha_config"]["method"] == "kl_symmetry"
        assert r["error"] is None and r["finish_reason"] in ("stop", "length")
    assert len({r["seed"] for r in records}) == len(records)
    assert json.loads((tmp_path / "out.jsonl.summary.json").read_text()) == summary
    # The summary's statistics, from the written records in float64 (ESS = (Σw)² / Σw², w = exp(log w_θ)).
    alphas = np.array([a for r in records for a in r["alpha"]], dtype=np.float64)
    log_w = np.array([math.fsum(r["logp_theta"]) - math.fsum(r["logq"]) for r in records])
    w = np.exp(log_w - log_w.max())
    assert summary["generated_tokens"] == alphas.size
    assert summary["alpha_mean"] == pytest.approx(alphas.mean(), abs=1e-9)
    assert summary["alpha_std"] == pytest.approx(alphas.std(), abs=1e-6)
    assert summary["ess_theta_weights"] == pytest.approx(w.sum() ** 2 / (w**2).sum(), rel=1e-6)
    assert summary["ess_fraction"] == pytest.approx(summary["ess_theta_weights"] / 12, rel=1e-9)
    assert 0 < summary["wall_seconds"] <= elapsed


def test_parquet_and_messages_outputs_load(dual_engine, tiny_same, tmp_path):
    pandas = pytest.importorskip("pandas")
    cfg = tiny_config(tiny_same, tmp_path, output=str(tmp_path / "out.parquet"))
    run_generation(cfg, sampler=dual_engine)
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.num_rows == 12 and {"alpha", "logq", "log_w_theta", "response"} <= set(table.column_names)
    assert len(pandas.read_parquet(tmp_path / "out.parquet")) == 12
    msg = tiny_config(
        tiny_same,
        tmp_path,
        output=str(tmp_path / "msg.jsonl"),
        format="messages",
        system_prompt_theta="You are a careful student.",
        keep_truncated=True,  # the tiny random models rarely stop before max_tokens
    )
    summary = run_generation(msg, sampler=dual_engine)
    rows = [json.loads(line) for line in (tmp_path / "msg.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    assert summary["truncated_samples"] == sum(r["truncated"] for r in rows)
    roles = [[m["role"] for m in r["messages"]] for r in rows]
    assert all(r == ["system", "user", "assistant"] for r in roles)
    assert rows[0]["messages"][1]["content"].startswith("What is 0 plus 0?")


def test_missing_field_and_duplicate_ids_are_named(dual_engine, tiny_same, tmp_path):
    src = problems(tmp_path / "in.jsonl", 3)
    lines = src.read_text().splitlines()
    lines[2] = json.dumps({"id": "p2", "question": "?"})
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="row 2 has no field 'problem'"):
        run_generation(tiny_config(tiny_same, tmp_path, input=str(src)), sampler=dual_engine)
    src.write_text("\n".join([*lines[:2], lines[0]]) + "\n")
    with pytest.raises(ValueError, match="rows 0 and 2 share the id 'p0'"):
        run_generation(
            tiny_config(tiny_same, tmp_path, input=str(src), output=str(tmp_path / "o2.jsonl")), sampler=dual_engine
        )


def test_resume_refuses_a_different_configuration(dual_engine, tiny_same, tmp_path):
    run_generation(tiny_config(tiny_same, tmp_path), sampler=dual_engine)
    with pytest.raises(FileExistsError, match="--resume"):
        run_generation(tiny_config(tiny_same, tmp_path), sampler=dual_engine)
    with pytest.raises(ValueError, match="temperature: 1.0 -> 0.5"):
        run_generation(tiny_config(tiny_same, tmp_path, temperature=0.5, resume=True), sampler=dual_engine)
    summary = run_generation(
        tiny_config(tiny_same, tmp_path, resume=True, batch_size=2, max_num_seqs=2), sampler=dual_engine
    )
    assert summary["samples_written"] == 0 and summary["samples_already_done"] == 12


def test_directory_output_commits_parts_atomically_and_resumes_exactly_once(dual_engine, tiny_same, tmp_path):
    out = tmp_path / "parts"
    first = run_generation(tiny_config(tiny_same, tmp_path, output=str(out), batch_size=2), sampler=dual_engine)
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 3 and first["samples_written"] == 12  # 6 problems, 2 per batch, one part per batch
    assert (out / "manifest.json").exists() and (out / "summary.json").exists()
    parts[-1].unlink()  # as if the run died before its last batch was committed ...
    (out / "part-000002.parquet.tmp").write_bytes(b"half a parquet file")  # ... while writing it
    resumed = run_generation(
        tiny_config(tiny_same, tmp_path, output=str(out), batch_size=2, resume=True), sampler=dual_engine
    )
    assert resumed["samples_already_done"] == 8 and resumed["samples_written"] == 4
    assert not list(out.glob("*.tmp"))
    records = read_records(str(out))
    assert Counter((r["id"], r["sample_index"]) for r in records) == Counter(
        (f"p{i}", j) for i in range(6) for j in range(2)
    )


def test_failed_samples_are_never_training_data_and_resume_draws_them_again(
    dual_engine, tiny_same, tmp_path, monkeypatch
):
    pairs = Counter((f"p{i}", j) for i in range(6) for j in range(2))
    for fmt in ("records", "messages"):
        out = tmp_path / f"{fmt}.jsonl"
        kept = fmt == "messages"  # every answer is a record here, cut off at max_tokens or not
        first = run_generation(
            tiny_config(tiny_same, tmp_path, output=str(out), format=fmt, keep_truncated=kept),
            sampler=FailingSampler(dual_engine),
        )
        written = read_journal(out)
        failed = [json.loads(line) for line in (tmp_path / f"{fmt}.failed.jsonl").read_text().splitlines()]
        assert failed and first["failed_samples"] == len(failed) and first["failures"] == {"sync_timeout": len(failed)}
        assert first["samples_written"] == len(written) == 12 - len(failed)
        assert not {(f["id"], f["sample_index"]) for f in failed} & {(r["id"], r["sample_index"]) for r in written}
        assert all(f["error"] == "sync_timeout at step 1" for f in failed)
        # The command line's own exit code for this summary (its run replaced by this one's outcome).
        with monkeypatch.context() as m:
            m.setattr("dual_sampling.datagen.run.run_generation", lambda config, summary=first: summary)
            argv = ["generate", "--input", "in.jsonl", "--output", str(tmp_path / "x.jsonl")]
            assert main([*argv, "--teacher", "t", "--theta", "s"]) == 3
        resumed = run_generation(
            tiny_config(tiny_same, tmp_path, output=str(out), format=fmt, keep_truncated=kept, resume=True),
            sampler=dual_engine,
        )
        assert resumed["samples_written"] == len(failed) and resumed["failed_samples"] == 0
        assert Counter((r["id"], r["sample_index"]) for r in read_journal(out)) == pairs


def test_a_resumed_run_draws_each_sample_once_with_its_seed_and_records_that_match_rescoring(
    dual_engine, hf_models, tiny_same, tmp_path
):
    whole = tiny_config(tiny_same, tmp_path, output=str(tmp_path / "whole.jsonl"), temperature=0.8)
    run_generation(whole, sampler=dual_engine)
    part = tiny_config(tiny_same, tmp_path, output=str(tmp_path / "part.jsonl"), temperature=0.8)
    run_generation(part, sampler=dual_engine)
    kept = read_journal(tmp_path / "part.jsonl")[:5]  # as if killed after five records
    (tmp_path / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    run_generation(
        tiny_config(tiny_same, tmp_path, output=str(tmp_path / "part.jsonl"), temperature=0.8, resume=True),
        sampler=dual_engine,
    )
    by_key = lambda path: {(r["id"], r["sample_index"]): r for r in read_journal(path)}
    a, b = by_key(tmp_path / "whole.jsonl"), by_key(tmp_path / "part.jsonl")
    assert a.keys() == b.keys()
    for key in a:
        assert a[key]["seed"] == b[key]["seed"] == derive_seed(7, key[0], key[1])
    # The tokens of the two runs may differ: the resumed samples run in other batches, where vLLM's CPU kernels may
    # round differently (docs/reliability.md). What holds is that each record is right for its own tokens.
    assert assert_written_records_match_rescoring(b.values(), dual_engine.tokenizer, *hf_models, dual_engine.vocab) > 0


def test_a_beam_search_run_writes_each_problems_beams_whole_ranked_with_records_that_match_rescoring(
    dual_engine, hf_models, tiny_same, tmp_path
):
    """--use-beam-search: sample j of a problem is its (j+1)-th best beam over q, as beam_search() finds it, with
    records re-scoring confirms. A problem's beams are written all or none: one failed beam fails its search, and
    --resume draws the whole search again."""
    beams = dict(n=3, max_tokens=6, use_beam_search=True, length_penalty=0.5)
    out = tmp_path / "beams.jsonl"
    first = run_generation(
        tiny_config(tiny_same, tmp_path, output=str(out), **beams), sampler=FailingSampler(dual_engine)
    )
    by_problem = Counter(r["id"] for r in read_journal(out))
    failed = [json.loads(line) for line in (tmp_path / "beams.failed.jsonl").read_text().splitlines()]
    assert set(by_problem.values()) <= {3} and len(by_problem) < 6  # whole searches only, and some failed
    assert {f["id"] for f in failed}.isdisjoint(by_problem)
    assert "beam_search_partial" in first["failures"] and first["failed_samples"] == 18 - 3 * len(by_problem)
    summary = run_generation(
        tiny_config(tiny_same, tmp_path, output=str(out), resume=True, **beams), sampler=dual_engine
    )
    records = {(r["id"], r["sample_index"]): r for r in read_journal(out)}
    assert records.keys() == all_pairs(6, 3) and summary["failed_samples"] == 0
    assert summary["ess_theta_weights"] is None  # beams are no samples of q: their weights weigh nothing
    report = write_report(out, tmp_path / "report") / "summary.md"
    assert "the records are beams, not samples of q" in report.read_text()
    assert all(r["sampling"]["use_beam_search"] and r["sampling"]["length_penalty"] == 0.5 for r in records.values())
    one = records["p0", 0]
    (direct,) = dual_engine.beam_search(
        [one["theta_prompt"]], [one["teacher_prompt"]], beam_width=3, max_tokens=6, length_penalty=0.5
    )
    assert [records["p0", j]["token_ids"] for j in range(3)] == [b.tokens for b in direct]
    tokenizer, vocab = dual_engine.tokenizer, dual_engine.vocab
    tokens = sum(r["num_tokens"] for r in records.values())
    assert assert_written_records_match_rescoring(records.values(), tokenizer, *hf_models, vocab) == tokens > 0
    with pytest.raises(ValueError, match="^temperature is not used by beam search"):
        tiny_config(tiny_same, tmp_path, output=str(tmp_path / "x.jsonl"), temperature=0.5, **beams)


# ---------------------------------------------------------------- the real CLI, killed and resumed


def test_cli_killed_partway_then_resumed_has_every_pair_once(dual_engine, tiny_same, tmp_path):
    src = problems(tmp_path / "in.jsonl", 24)
    out = tmp_path / "run.jsonl"
    flags = cli_flags(tiny_same, input=src, output=out, n=2, max_tokens=24, batch_size=2, seed=7)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dual_sampling.cli", "generate", *flags],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 6:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # The killed driver left its shared memory behind; the next session start removes it, and only it.
    left = {f for f in os.listdir("/dev/shm") if f.startswith(f"{SESSION_PREFIX}{proc.pid}-")}
    assert left
    SyncSession.create(SessionLayout(8, 2, 4, 1)).close()
    remaining = set(os.listdir("/dev/shm"))
    assert not left & remaining and dual_engine.session.name in remaining
    before = out.read_text().count("\n")
    assert 6 <= before < 48
    with out.open("a") as f:  # the kill may or may not tear a line: make sure one is torn
        f.write('{"id": "p9", "sample_index": 1, "respo')
    cfg = tiny_config(tiny_same, tmp_path, input=str(src), output=str(out), max_tokens=24, batch_size=8, resume=True)
    summary = run_generation(cfg, sampler=dual_engine)
    records = read_journal(out, repair=False)
    assert Counter((r["id"], r["sample_index"]) for r in records) == Counter(
        (f"p{i}", j) for i in range(24) for j in range(2)
    )
    assert summary["samples_already_done"] == before and summary["samples_written"] == 48 - before
    report = subprocess.run(
        [sys.executable, "-m", "dual_sampling.cli", "report", str(out)], capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr[-2000:]
    folder = Path(str(out) + ".report")
    for name in ("alpha_hist.png", "alpha_by_position.png", "log_weights.png", "lengths.png", "summary.md"):
        assert (folder / name).stat().st_size > 1000 or name == "summary.md"
    assert "ESS of w_θ" in (folder / "summary.md").read_text()


SCORE = "tests.scores:response_length"
"""A user score by name (``--score``), as a data run imports it."""


def test_cli_shard_run_end_to_end(dual_engine, tiny_same, tmp_path):
    common = cli_flags(tiny_same, input=EXAMPLES, max_tokens=8)
    # In this process (its engines start from the session's fork server): test_cli_killed_partway_... runs the
    # command in an interpreter of its own.
    done = run_cli_here("generate", *common, "--shard", "0/2", "--output", str(tmp_path / "s0.jsonl"), "--score", SCORE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "s0.jsonl.summary.json").read_text())["failed_samples"] == 0
    # The user score (--score) reaches every record, with its name.
    scored_records = read_journal(tmp_path / "s0.jsonl")
    assert scored_records and all(
        r["score"] == float(len(r["response"])) and r["score_name"] == SCORE for r in scored_records
    )
    cfg = tiny_config(
        tiny_same,
        tmp_path,
        input=str(EXAMPLES),
        output=str(tmp_path / "s1.jsonl"),
        max_tokens=8,
        n=1,
        seed=0,
        shard="1/2",
    )
    run_generation(cfg, sampler=dual_engine)
    ids = [{r["id"] for r in read_journal(tmp_path / f"s{k}.jsonl")} for k in range(2)]
    all_ids = {r["id"] for r in load_rows(str(EXAMPLES))}
    assert ids[0].isdisjoint(ids[1]) and ids[0] | ids[1] == all_ids and ids[0] and ids[1]
