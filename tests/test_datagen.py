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

import pyarrow.parquet as pq
import pytest

from dual_sampling.cli import _load_config_file, build_parser, main
from dual_sampling.datagen import RunConfig, load_rows, read_journal, read_records, run_generation, shard_of
from dual_sampling.engine import derive_seed
from dual_sampling.protocol import SESSION_PREFIX, SessionLayout, SyncSession

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
    script = "from dual_sampling.datagen import shard_of; print([shard_of(f'row-{i}', 3) for i in range(50)])"
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str([shard_of(f"row-{i}", 3) for i in range(50)])


def test_inputs_jsonl_parquet_and_datasets_folder(tmp_path):
    src = problems(tmp_path / "p.jsonl", 5)
    rows = load_rows(str(src))
    import pyarrow as pa
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
    settings = _load_config_file(args.config)
    settings.update({k: v for k, v in vars(args).items() if k not in ("config", "run", "command")})
    run = RunConfig.from_settings(settings)
    assert run.sampling.temperature == 0.7 and run.sampling.max_tokens == 99 and run.sampling.stop == ["END"]
    assert run.sampling.stop_token_ids == [5, 7] and run.sampling.logit_bias == {11: -5}
    assert run.engine.alpha_method == "ess_balance" and run.chat_template is False
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


# ---------------------------------------------------------------- with the shared engine


def test_records_are_complete_and_consistent(dual_engine, tiny_same, tmp_path):
    src = tmp_path / "in.jsonl"
    problems(src, 6)
    with src.open("a") as f:
        f.write(json.dumps({"id": "empty", "problem": "  ", "solution": "-"}) + "\n")
        f.write(json.dumps({"id": "long", "problem": "word " * 400, "solution": "-"}) + "\n")
    cfg = tiny_config(tiny_same, tmp_path, input=str(src))
    summary = run_generation(cfg, sampler=dual_engine)
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
    assert json.loads((tmp_path / "out.jsonl.summary.json").read_text())["samples_written"] == 12


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
    )
    run_generation(msg, sampler=dual_engine)
    rows = [json.loads(line) for line in (tmp_path / "msg.jsonl").read_text().splitlines()]
    assert len(rows) == 12
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


def test_failed_samples_are_never_training_data_and_resume_draws_them_again(dual_engine, tiny_same, tmp_path):
    pairs = Counter((f"p{i}", j) for i in range(6) for j in range(2))
    for fmt in ("records", "messages"):
        out = tmp_path / f"{fmt}.jsonl"
        first = run_generation(
            tiny_config(tiny_same, tmp_path, output=str(out), format=fmt), sampler=FailingSampler(dual_engine)
        )
        written = read_journal(out)
        failed = [json.loads(line) for line in (tmp_path / f"{fmt}.failed.jsonl").read_text().splitlines()]
        assert failed and first["failed_samples"] == len(failed) and first["failures"] == {"sync_timeout": len(failed)}
        assert first["samples_written"] == len(written) == 12 - len(failed)
        assert not {(f["id"], f["sample_index"]) for f in failed} & {(r["id"], r["sample_index"]) for r in written}
        assert all(f["error"] == "sync_timeout at step 1" for f in failed)
        assert main_exit_code(first) == 3
        resumed = run_generation(
            tiny_config(tiny_same, tmp_path, output=str(out), format=fmt, resume=True), sampler=dual_engine
        )
        assert resumed["samples_written"] == len(failed) and resumed["failed_samples"] == 0
        assert Counter((r["id"], r["sample_index"]) for r in read_journal(out)) == pairs


def main_exit_code(summary: dict) -> int:
    return 0 if summary["failed_samples"] == 0 else 3


def test_a_resumed_sample_gets_the_seed_and_tokens_of_an_uninterrupted_run(dual_engine, tiny_same, tmp_path):
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
        assert a[key]["token_ids"] == b[key]["token_ids"]


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


def test_cli_shard_run_end_to_end(dual_engine, tiny_same, tmp_path):
    common = cli_flags(tiny_same, input=EXAMPLES, max_tokens=8)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dual_sampling.cli",
            "generate",
            *common,
            "--shard",
            "0/2",
            "--output",
            str(tmp_path / "s0.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "s0.jsonl.summary.json").read_text())["failed_samples"] == 0
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
