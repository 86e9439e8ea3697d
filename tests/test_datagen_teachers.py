"""Data runs of several teachers without engines: the flags and settings that name teachers, what each model is
shown, and records whose columns follow the roster in JSONL, Parquet and parts alike (a :class:`ScriptedSampler`
stands in for the engines; ``tests/test_teachers_engine.py`` runs one on a trio of engines and re-scores it)."""

from __future__ import annotations

import dataclasses
import json
import math

import pyarrow.parquet as pq
import pytest

from dual_sampling.cli import _per_teacher, _run_settings, build_parser
from dual_sampling.datagen.run import run_generation
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.datagen.schema import record_fields, record_schema
from dual_sampling.datagen.sinks import read_records
from dual_sampling.distill import DistillConfig
from dual_sampling.roster import THETA, Roster
from dual_sampling.testing.scripted import ScriptedSampler
from tests.test_datagen import all_pairs, problems, strict_json

ROSTER = Roster.of_teachers(("math", "general"))


def teachers_config(tiny_same, tmp_path, **overrides) -> RunConfig:
    """A run of two teachers ("math" sees the solution as its hint, "general" none) on the tiny pair's folders."""
    teacher, theta = tiny_same
    settings = dict(
        input=str(problems(tmp_path / "in.jsonl", 6)),
        output=str(tmp_path / "out.jsonl"),
        teacher={"math": str(teacher), "general": str(theta)},
        theta=str(theta),
        hint_field={"math": "solution"},
        system_prompt_teacher={"general": "You are a careful writer."},
        id_field="id",
        n=2,
        max_tokens=12,
        use_tqdm=False,
        batch_size=4,
        seed=7,
        alpha_method="fixed",
        alpha_config={"alpha": [0.3, 0.2]},
    )
    return RunConfig.from_settings({**settings, **overrides})


def test_teacher_flags_name_each_teacher_and_its_hint(tiny_same, tmp_path):
    teacher, theta = tiny_same

    def settings(*flags: str) -> dict:
        return _run_settings(build_parser().parse_args(["generate", *flags]))

    out = ["--input", "in.jsonl", "--output", str(tmp_path / "o.jsonl"), "--theta", str(theta)]
    named = settings(
        *out,
        *("--teacher", f"math={teacher}", "--teacher", f"general={theta}", "--hint-field", "math=solution"),
        *("--system-prompt-teacher", "Note=be brief"),
        *("--alpha-method", "fixed", "--alpha-config", '{"alpha": [0.3, 0.2]}'),
    )
    assert named["teacher"] == {"math": str(teacher), "general": str(theta)}
    # A value given once is NAME=VALUE only where NAME is a teacher's: this system message is one for every teacher.
    assert named["hint_field"] == {"math": "solution"} and named["system_prompt_teacher"] == "Note=be brief"
    config = RunConfig.from_settings(named)
    assert config.roster == ROSTER
    assert config.source.hint_fields == {"math": "solution", "general": None}
    # θ's template is given a hint only where every teacher sees the same field, as a pair's is.
    assert config.source.model_hint_fields == {"math": "solution", "general": None, THETA: None}
    shared = dataclasses.replace(config.source, hint_field="solution")
    assert shared.model_hint_fields == {"math": "solution", "general": "solution", THETA: "solution"}
    assert list(config.source.folders) == [THETA, "math", "general"]  # roster order: θ leads
    served = _per_teacher(
        vars(build_parser().parse_args(["serve", "--teacher", f"math={teacher}", "--teacher", "g=x"]))
    )
    assert served["teacher"] == {"math": str(teacher), "g": "x"}  # the server takes them alike
    # One teacher: every value stays whole, "=" and all (a folder, a field, a system message).
    pair = settings(*out, "--teacher", "runs/lr=3e-4/model", "--hint-field", "a=b", "--system-prompt-teacher", "x=1")
    assert (pair["teacher"], pair["hint_field"], pair["system_prompt_teacher"]) == ("runs/lr=3e-4/model", "a=b", "x=1")
    for mixed in (["--teacher", str(teacher), "--teacher", f"b={theta}"], ["--teacher", "a=x", "--teacher", "a=y"]):
        with pytest.raises(SystemExit, match="--teacher: "):
            settings(*out, *mixed)
    # Given again, one value is replaced by the last, as every other flag is; names and values do not mix.
    again = settings(*out, "--teacher", "/m/a", "--teacher", "/m/b", "--hint-field", "a", "--hint-field", "b")
    assert (again["teacher"], again["hint_field"]) == ("/m/b", "b")
    with pytest.raises(SystemExit, match="--hint-field: give one value, or TEACHER=VALUE"):
        settings(*out, "--teacher", "m=x", "--teacher", "g=y", "--hint-field", "m=a", "--hint-field", "b")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hint_field": {"physics": "solution"}}, "hint_field: 'physics' names no teacher"),
        ({"teacher_template": {"physics": "{{ problem }}"}}, "teacher_template: 'physics' names no teacher"),
        ({"system_prompt_teacher": {"math": 3}}, "system_prompt_teacher: each teacher's value must be a string"),
        ({"alpha_config": {"alpha": 0.3}}, "alpha must list one weight per teacher (2)"),
        ({"teacher": {"math": "a"}}, "teacher: a mapping names several teachers"),
        ({"teacher": {"math": "a", "theta": "b"}}, "teacher: names must be unique"),
        ({"teacher": {"math": "a", "two words": "b"}}, "teacher: names: 'two words' is not a model name"),
        ({"teacher": {"math": "a", "general": ""}}, "teacher must be a model folder"),
        ({"teacher": {"config": "a", "general": "b"}, "hint_field": None}, "teacher: the teachers' names make record"),
        ({"hint_field": {}}, "hint_field: an empty mapping names no teacher"),
        ({"mode": "speculative"}, "mode='speculative' runs one teacher"),
        ({"teacher_engine_kwargs": {"max_num_seqs": 4}}, "teacher_engine_kwargs: with several teachers"),
    ],
)
def test_a_setting_that_does_not_fit_the_teachers_is_refused_by_name(tiny_same, tmp_path, overrides, field):
    with pytest.raises(ValueError, match="^" + field.replace("(", r"\(").replace(")", r"\)")):
        teachers_config(tiny_same, tmp_path, **overrides)


def test_a_pair_refuses_settings_per_teacher_and_distillation_names_its_loss_teacher(tiny_same, tmp_path):
    teacher, theta = tiny_same
    with pytest.raises(ValueError, match="^hint_field: a value per teacher name needs several teachers"):
        RunConfig.from_settings(
            {"input": "x", "output": "y.jsonl", "teacher": str(teacher), "theta": str(theta), "hint_field": {"a": "b"}}
        )
    several = {"prompts": "x", "output": "y", "teacher": {"a": str(teacher), "b": str(theta)}, "theta": str(theta)}
    assert DistillConfig.from_settings(several).loss_teacher_name == "a"  # the first teacher by default
    assert DistillConfig.from_settings({**several, "loss_teacher": "b"}).loss_teacher_name == "b"
    with pytest.raises(ValueError, match="^loss_teacher='coach' is not a teacher of this run"):
        DistillConfig.from_settings({**several, "loss_teacher": "coach"})
    with pytest.raises(ValueError, match="^loss_teacher='a' names one of several teachers"):
        DistillConfig.from_settings({**several, "teacher": str(teacher), "loss_teacher": "a"})


def test_records_of_two_teachers_follow_the_roster_in_jsonl_parquet_and_parts(tiny_same, tmp_path):
    """Each teacher is shown its own prompt (its hint, its system message), and each record holds every model's
    prompt, α per teacher, log π per model, log q, their sums and one log weight per model, under the roster's
    names, in one schema across the three outputs; the sums and weights are re-added here from the columns."""
    outputs = [tmp_path / "out.jsonl", tmp_path / "out.parquet", tmp_path / "parts"]
    samplers = []
    for out in outputs:
        samplers.append(ScriptedSampler((teachers_config(tiny_same, tmp_path).source.teacher, tiny_same[1])))
        summary = run_generation(teachers_config(tiny_same, tmp_path, output=str(out)), samplers[-1])
        assert summary["samples_written"] == 12 and summary["failed_samples"] == 0
    by_key = [{(r["id"], r["sample_index"]): r for r in read_records(str(out))} for out in outputs]
    assert by_key[0].keys() == all_pairs() and by_key[0] == by_key[1] == by_key[2]
    fields = record_fields("records", ROSTER)
    for r in by_key[0].values():
        assert list(r) == list(fields)
        assert "alpha" not in r and "logp_teacher" not in r and "teacher_prompt" not in r
        solution = f"{int(r['id'][1:])} + {2 * int(r['id'][1:])} ="
        assert solution in r["math_prompt"] and solution not in r["general_prompt"] + r["theta_prompt"]
        assert "You are a careful writer." in r["general_prompt"]
        assert "careful writer" not in r["math_prompt"] + r["theta_prompt"]
        for column in ROSTER.token_columns:
            assert r[f"sum_{column}"] == pytest.approx(math.fsum(r[column]), abs=0)
        for name in ROSTER.names:
            expected = math.fsum(a - b for a, b in zip(r[f"logp_{name}"], r["logq"]))
            assert r[f"log_w_{name}"] == pytest.approx(expected, abs=1e-12)
        assert r["alpha_math"] == r["alpha_general"] == [0.125, 0.25, 0.375]
        assert r["models"].keys() == {"math", "general", THETA}
    # The engines were given each teacher's prompts by name, as the records hold them.
    (theta_prompts, teacher_prompts), *_ = samplers[0].prompts
    assert set(teacher_prompts) == {"math", "general"}
    first = by_key[0][("p0", 0)]
    assert (teacher_prompts["math"][0], teacher_prompts["general"][0], theta_prompts[0]) == (
        first["math_prompt"],
        first["general_prompt"],
        first["theta_prompt"],
    )
    schema = record_schema("records", ROSTER)
    for path in [tmp_path / "out.parquet", *sorted((tmp_path / "parts").glob("part-*.parquet"))]:
        assert pq.read_schema(path).equals(schema, check_metadata=False), path
    # The summary: the mean of the total teacher weight at each token, and each teacher's.
    assert summary["alpha_mean"] == pytest.approx(0.5)
    assert summary["alpha_mean_by_teacher"] == pytest.approx({"math": 0.25, "general": 0.25})


def test_a_non_finite_teacher_column_fails_its_sample_and_a_resume_draws_only_it(tiny_same, tmp_path):
    bad = {("p2", 1): {"alpha_general": [0.1, math.nan, 0.1]}, ("p4", 0): {"logp_math": [-1.0, -1.0, -math.inf]}}
    config = teachers_config(tiny_same, tmp_path)
    models = (config.source.teacher, tiny_same[1])
    summary = run_generation(config, ScriptedSampler(models, lambda k, j: bad.get((k, j), {})))
    assert summary["failures"] == {"non_finite_record": 2} and summary["samples_written"] == 10
    failed = [strict_json(line) for line in (tmp_path / "out.failed.jsonl").read_text().splitlines()]
    assert {(f["id"], f["sample_index"]): f["error"] for f in failed} == {
        ("p2", 1): "non_finite_record at token 1: alpha_general is nan",
        ("p4", 0): "non_finite_record at token 2: logp_math is -inf",
    }
    for line in (tmp_path / "out.jsonl").read_text().splitlines():
        strict_json(line)
    again = ScriptedSampler(models)
    resumed = run_generation(teachers_config(tiny_same, tmp_path, resume=True), again)
    assert {key for key, _ in again.drawn} == {"p2", "p4"} and resumed["samples_written"] == 2
    assert {(r["id"], r["sample_index"]) for r in read_records(str(tmp_path / "out.jsonl"))} == all_pairs()
    # The teachers in another order weight other models (each α is its teacher's, the first leads): refused.
    swapped = {"general": config.source.teacher["general"], "math": config.source.teacher["math"]}
    with pytest.raises(ValueError, match="the configuration differs .*teacher"):
        run_generation(
            teachers_config(tiny_same, tmp_path, resume=True, teacher=swapped), ScriptedSampler((swapped, models[1]))
        )
    manifest = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())
    assert manifest["config"]["teacher"] == [[k, v] for k, v in config.source.teacher.items()]
    assert manifest["config"]["models"].keys() == {
        "math",
        "general",
        THETA,
    }


def test_a_sampler_of_other_models_is_refused_by_name(tiny_same, tmp_path):
    config = teachers_config(tiny_same, tmp_path)
    with pytest.raises(ValueError, match=r"runs the models \['teacher', 'theta'\]"):
        run_generation(config, ScriptedSampler(tiny_same))
    swapped = {"math": tiny_same[1], "general": tiny_same[0]}
    with pytest.raises(ValueError, match="the sampler runs math"):
        run_generation(config, ScriptedSampler((swapped, tiny_same[1])))
    # Refused before anything was written (the lock file stays, as after every run).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl.lock"]


def test_the_report_of_a_run_of_two_teachers_shows_the_total_weight_and_each_teachers(tiny_same, tmp_path):
    """``dual-sampling report`` on a run of two teachers: Σα per token (the scripted 0.25, 0.5, 0.75 split evenly),
    each teacher's mean α, and a log weight per model; a pair's run reports α as before."""
    from dual_sampling.datagen.report import write_report

    config = teachers_config(tiny_same, tmp_path, output=str(tmp_path / "two.parquet"))
    run_generation(config, ScriptedSampler((config.source.teacher, config.source.theta)))
    summary = (write_report(tmp_path / "two.parquet", tmp_path / "two-report") / "summary.md").read_text()
    assert "| Σα (total teacher weight) mean ± std | 0.500 ± 0.204 |" in summary
    assert "| alpha_math mean | 0.250 |" in summary and "| alpha_general mean | 0.250 |" in summary
    assert all((tmp_path / "two-report" / f"{plot}.png").stat().st_size for plot in ("alpha_hist", "log_weights"))
    pair = teachers_config(
        tiny_same,
        tmp_path,
        output=str(tmp_path / "pair.jsonl"),
        teacher=str(tiny_same[0]),
        hint_field="solution",
        system_prompt_teacher=None,
        alpha_config={"alpha": 0.5},
    )
    run_generation(pair, ScriptedSampler(tiny_same))
    summary = (write_report(tmp_path / "pair.jsonl", tmp_path / "pair-report") / "summary.md").read_text()
    assert "| α mean ± std | 0.500 ± 0.204 |" in summary and "alpha_math" not in summary
