"""The roster's record schema (``dual_sampling.roster``): one derivation of every record column, which each record
declaration follows, and today's two-model names kept (old runs resume, old files read)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dual_sampling.beams import BeamSequence
from dual_sampling.datagen.schema import Record, record_schema
from dual_sampling.decision.result import Decision
from dual_sampling.lockstep import RECORD_FIELDS
from dual_sampling.records import DENSE_ROLES, SampleRecord
from dual_sampling.roster import PAIR, THETA, TOKEN_COLUMNS, Roster
from dual_sampling.server.protocol import DualRecords


def per_token_columns(cls: type) -> list[str]:
    """The fields of a record class that hold one float per token (annotated ``list[float]``), in order."""
    return [f.name for f in dataclasses.fields(cls) if str(f.type) == "list[float]"]


def test_the_pair_keeps_todays_column_names():
    assert PAIR.names == ("teacher", "theta") == DENSE_ROLES
    assert TOKEN_COLUMNS == ("alpha", "logp_teacher", "logp_theta", "logq") == RECORD_FIELDS
    assert PAIR.sum_columns == ("sum_alpha", "sum_logp_teacher", "sum_logp_theta", "sum_logq")
    assert PAIR.weight_columns == ("log_w_theta", "log_w_teacher")


def test_every_record_declaration_follows_the_roster():
    assert per_token_columns(SampleRecord) == list(TOKEN_COLUMNS)
    assert per_token_columns(BeamSequence) == list(TOKEN_COLUMNS)
    # A decision's records come out in its roster's token columns: each value lands in the column named for it.
    for roster in (PAIR, Roster(("math", "general", THETA))):
        teachers, models = len(roster.teachers), len(roster.names)
        alpha = torch.tensor([0.1]) if teachers == 1 else torch.tensor([[0.1, 0.2]])  # [b], or [b, K]
        logp = -torch.arange(1.0, models + 1).unsqueeze(0)
        decided = Decision(torch.tensor([7]), alpha, logp, torch.tensor([-9.0]), torch.tensor([True]))
        expected = {"logq": -9.0, **{f"logp_{n}": -(p + 1.0) for p, n in enumerate(roster.names)}}
        expected.update(zip(roster.alpha_columns, alpha.reshape(-1).tolist()))
        assert decided.token_records()[0].tolist() == pytest.approx([expected[c] for c in roster.token_columns])
    record = [f.name for f in dataclasses.fields(Record)]
    assert per_token_columns(Record) == list(TOKEN_COLUMNS)
    assert [n for n in record if n.startswith("sum_")] == list(PAIR.sum_columns)
    assert [n for n in record if n.startswith("log_w_")] == list(PAIR.weight_columns)
    parquet = record_schema("records").names
    assert all(name in parquet for name in (*TOKEN_COLUMNS, *PAIR.sum_columns, *PAIR.weight_columns))
    assert all(name in DualRecords.model_fields for name in TOKEN_COLUMNS)
    # Each sample's weights are properties of its record, one per model.
    assert all(isinstance(getattr(SampleRecord, name), property) for name in PAIR.weight_columns)


def test_several_teachers_get_a_weight_each_and_theta_stays_the_student():
    roster = Roster(("math", "general", THETA))
    assert roster.teachers == ("math", "general")
    assert roster.token_columns == ("alpha_math", "alpha_general", "logp_math", "logp_general", "logp_theta", "logq")
    assert roster.sum_columns == tuple(f"sum_{c}" for c in roster.token_columns)
    assert roster.weight_columns == ("log_w_theta", "log_w_math", "log_w_general")


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("teacher",), "at least two"),
        (["teacher", "theta"], "a tuple"),
        (("teacher", "teacher", "theta"), "unique"),
        (("teacher", "student"), "must include 'theta'"),
        (("math-teacher", "theta"), "'math-teacher' is not a model name"),
        ((1, "theta"), "1 is not a model name"),
    ],
)
def test_a_bad_roster_is_refused_by_its_field(names, message):
    with pytest.raises(ValueError, match=rf"^names.*{message}"):
        Roster(names)


def test_weight_versions_are_kept_per_model_of_the_roster():
    from dual_sampling.driver.versions import WeightVersions

    versions = WeightVersions(Roster(("math", "general", THETA)))
    assert versions.snapshot() == {"math": "0", "general": "0", "theta": "0"}
    assert versions.updated("general", None) == "1" and versions.updated(THETA, "step-7") == "step-7"
    versions.relabel("math", "base")
    assert versions.snapshot() == {"math": "base", "general": "1", "theta": "step-7"}
    with pytest.raises(ValueError, match="already labelled earlier general weights"):
        versions.check_new("general", "0")  # a label its weights carried: records of two weights would name one
    for model, label in (("general", "1"), ("theta", "step-7"), ("math", "base")):  # each label a model carried
        with pytest.raises(ValueError, match=f"already labelled earlier {model} weights"):
            versions.check_new(model, label)
    versions.check_new("math", "1")  # another model's label is free for this one
    with pytest.raises(ValueError, match=r"role must be one of \('math', 'general', 'theta'\), got 'teacher'"):
        versions.updated("teacher", None)
    assert versions.updates == {"math": 0, "general": 1, "theta": 1}
    assert WeightVersions().snapshot() == {"teacher": "0", "theta": "0"}  # the pair's, as records name them


def test_records_of_no_tokens_have_the_rosters_width():
    """A round or a batch that emitted nothing still has its columns (the speculative rule builds such rounds)."""
    from dual_sampling.decision.result import token_columns

    empty = torch.zeros(0)
    assert token_columns(empty, empty.reshape(0, 2), empty).shape == (0, len(TOKEN_COLUMNS))
    trio = Roster(("math", "general", THETA))
    assert token_columns(empty.reshape(0, 2), empty.reshape(0, 3), empty).shape == (0, len(trio.token_columns))


def _model_folder(path, name: str) -> str:
    folder = path / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return str(folder)


def test_each_engine_of_several_teachers_gets_its_own_model_settings_and_role(tmp_path, monkeypatch):
    """Without engines: a trio's engine arguments, built as the engines would start. Each engine gets its model's
    folder and its own vLLM arguments (a teacher's by its name), the first teacher's engine leads and the others
    follow, every engine knows the whole roster and reads the first teacher's tokenizer; on two CPUs the engines
    are placed by their models' size, and the leader borrows the followers' CPUs that are not its own."""
    from dual_sampling.driver import engine_processes
    from dual_sampling.driver.pair import EnginePair
    from dual_sampling.lockstep import LockstepConfig
    from dual_sampling.options import DualEngineConfig
    from processors import FollowerLogitsProcessor, FollowerScheduler, LeaderLogitsProcessor, LeaderScheduler

    folders = {name: _model_folder(tmp_path, name) for name in ("math", "general", THETA)}
    config = DualEngineConfig(
        {"math": folders["math"], "general": folders["general"]},
        folders[THETA],
        teacher_engine_kwargs={"general": {"dtype": "bfloat16"}},
        theta_engine_kwargs={"enforce_eager": True},
        kv_cache_memory_bytes=1 << 20,
    )
    assert config.roster.names == (THETA, "math", "general")  # θ leads: it takes part in every mixture
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    # By load (in roster order: θ, math, general): the largest first, each on the CPU with the least so far (θ joins
    # the smaller teacher).
    binding = engine_processes.split_cpu_binding(config.roster.names, [16, 30, 27])
    assert binding == {"math": "0", "general": "1", THETA: "1"}
    small_math = engine_processes.split_cpu_binding(config.roster.names, [16, 10, 27])
    assert small_math == {"math": "1", "general": "0", THETA: "1"}
    assert engine_processes.split_cpu_binding(config.roster.names) == {THETA: "0", "math": "1", "general": "0"}
    pair = object.__new__(EnginePair)  # its engine arguments alone: no engines, no session
    pair.config, pair.session_name, pair.max_model_len, pair.budget = config, "s", 256, 2048
    pair.binding, pair.places, pair.row_transport = binding, {}, "host"
    kwargs = {name: pair.engine_kwargs(name) for name in config.roster.names}
    assert {name: k["model"] for name, k in kwargs.items()} == folders
    assert {k["tokenizer"] for k in kwargs.values()} == {folders["math"]}  # the first teacher's
    assert [k.get("dtype") for k in kwargs.values()] == ["float32", "float32", "bfloat16"]
    assert kwargs[THETA]["enforce_eager"] is True
    assert kwargs[THETA]["scheduler_cls"] is LeaderScheduler
    assert kwargs[THETA]["logits_processors"] == [LeaderLogitsProcessor]
    for name in ("math", "general"):
        assert kwargs[name]["scheduler_cls"] is FollowerScheduler
        assert kwargs[name]["logits_processors"] == [FollowerLogitsProcessor]
    engine_configs = {
        name: LockstepConfig.from_vllm(SimpleNamespace(additional_config=k["additional_config"]), name == THETA, name)
        for name, k in kwargs.items()
    }
    assert {name: c.role for name, c in engine_configs.items()} == {name: name for name in config.roster.names}
    assert {c.roster for c in engine_configs.values()} == {config.roster.names}
    # The math teacher's CPU, idle while θ decides (the general teacher shares θ's own).
    assert engine_configs[THETA].mix_helper_cpus == (0,)
    assert engine_configs["math"].mix_helper_cpus == engine_configs["general"].mix_helper_cpus == ()


def test_several_teachers_settings_are_refused_by_the_field_that_holds_them(tmp_path):
    from dual_sampling.driver.pair import EnginePair
    from dual_sampling.options import DualEngineConfig

    folders = {name: _model_folder(tmp_path, name) for name in ("math", "general", THETA)}
    teachers = {"math": folders["math"], "general": folders["general"]}
    with pytest.raises(ValueError, match=r"teacher_engine_kwargs: with several teachers.*math, general"):
        DualEngineConfig(teachers, folders[THETA], teacher_engine_kwargs={"coach": {}})
    with pytest.raises(ValueError, match="model_teacher: a mapping names several teachers"):
        DualEngineConfig({"math": folders["math"]}, folders[THETA])
    with pytest.raises(FileNotFoundError, match=r"model_teacher\['general'\]"):
        DualEngineConfig({"math": folders["math"], "general": str(tmp_path / "nowhere")}, folders[THETA])
    with pytest.raises(ValueError, match="teacher_device: 'coach' names no teacher here"):
        DualEngineConfig(teachers, folders[THETA], teacher_device={"coach": 0})
    config = DualEngineConfig(teachers, folders[THETA], teacher_engine_kwargs={"general": {"max_num_seqs": 4}})
    with pytest.raises(ValueError, match=r"teacher_engine_kwargs\['general'\] sets max_num_seqs"):
        EnginePair(config, "s", 256)


def test_more_engines_than_cpus_are_placed_by_their_weights_bytes(tmp_path, monkeypatch):
    """The pair reads each model's weight bytes (its engine's share of a step) only where there are more engines than
    CPUs, and places them by it: the largest teacher alone, the smaller teacher and θ together."""
    from safetensors.torch import save_file

    from dual_sampling.driver import engine_processes
    from dual_sampling.driver.pair import EnginePair
    from dual_sampling.options import DualEngineConfig

    folders = {}
    for name, floats in (("math", 300), ("general", 270), (THETA, 160)):
        folders[name] = _model_folder(tmp_path, name)
        save_file({"w": torch.zeros(floats)}, f"{folders[name]}/model.safetensors")
    config = DualEngineConfig({"math": folders["math"], "general": folders["general"]}, folders[THETA])
    pair = object.__new__(EnginePair)
    pair.config = config
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    loads = pair._loads()
    assert loads == [640, 1200, 1080]  # float32 bytes, in roster order (θ, math, general)
    assert engine_processes.split_cpu_binding(config.roster.names, loads) == {"math": "0", "general": "1", THETA: "1"}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    assert pair._loads() is None  # an engine per CPU: no weight file is read


def test_teacher_prompts_by_name_take_the_same_form_for_one_teacher_as_for_several():
    """Front ends hand ``generate`` each teacher's prompts by name whatever the roster; a pair reads the mapping as it
    reads the list, and a name that is no teacher is refused on both."""
    from dual_sampling.driver.requests import prompt_pairs

    theta, hinted = [[5, 6], [7]], [[5, 6, 9], [7, 9]]

    def ids(teachers, roster=PAIR):
        return [p.teacher_ids for p in prompt_pairs(None, 100, 64, theta, teachers, roster)]

    assert ids({"teacher": hinted}) == ids(hinted) == hinted
    assert ids({}) == ids(None) == theta
    with pytest.raises(
        ValueError, match=r"a mapping from teacher names \(teacher\) to their prompts, got dict \['math'\]"
    ):
        ids({"math": hinted})
    trio = Roster(("math", "general", THETA))
    assert ids({"math": hinted}, trio) == [{"math": h, "general": t} for h, t in zip(hinted, theta)]
    with pytest.raises(ValueError, match="with several teachers, a mapping"):
        ids(hinted, trio)
