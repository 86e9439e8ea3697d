"""The ``dual-sampling`` command line: its flags are the config dataclasses' fields, its help their docstrings.

No engine starts here: the behaviours are the help text, the exit code and the settings a run is given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import subprocess
import sys
import typing
from dataclasses import dataclass

import pytest

from dual_sampling import cli
from dual_sampling.datagen.run_config import RunConfig
from dual_sampling.distill import DistillConfig
from dual_sampling.options import EngineOptions, SamplingOptions
from dual_sampling.run_settings import ModelsAndPrompts, composed_parts
from dual_sampling.server.serve_options import ServeOptions

COMMANDS = {
    "generate": (RunConfig, *composed_parts(RunConfig).values()),
    "distill": (DistillConfig, *composed_parts(DistillConfig).values()),
    "serve": (ServeOptions, EngineOptions),
}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dual_sampling.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def run_cli_here(*args: str) -> subprocess.CompletedProcess:
    """``dual-sampling ARGS`` in this process (each subprocess costs seconds of imports): its exit status as the
    interpreter would make it (``SystemExit("text")`` prints the text and exits 1), and what it wrote."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:
            code = exc.code
            if isinstance(code, str):
                print(code, file=sys.stderr)
                code = 1
    return subprocess.CompletedProcess(args, code or 0, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """Each command's ``--help``, its whitespace made single spaces (argparse wraps the lines)."""
    out = {}
    for command in COMMANDS:
        done = run_cli_here(command, "--help")
        assert done.returncode == 0, done.stderr
        out[command] = " ".join(done.stdout.split())
    return out


def has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


@pytest.mark.parametrize(
    ("command", "owner", "text"),
    [
        ("generate", RunConfig, "Field holding a unique id; None uses the row number."),
        ("generate", ModelsAndPrompts, "Field of a problem's row holding its text."),
        ("generate", SamplingOptions, "Nucleus filter on the tempered q, in (0, 1]; 1 is off."),
        ("generate", EngineOptions, "Seconds an engine waits for its partner before failing the requests it waits on."),
        ("distill", DistillConfig, "Optimizer steps per round; each takes an equal share of the round's samples."),
        ("serve", ServeOptions, "Largest n (and best_of) a request may ask for."),
        ("serve", EngineOptions, "Lower clamp on the teacher weight α."),
    ],
)
def test_help_is_the_docstring_under_each_field(helps, command, owner, text):
    assert text in helps[command], f"{owner.__name__}'s field docstring {text!r} is not in `{command} --help`"


IGNORED = {"generate": set(), "distill": {"use_tqdm"}, "serve": {"use_tqdm"}}
"""Fields a command has no use for, so no flag (neither draws a progress bar)."""


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_flag_and_a_composed_config_is_not(helps, command):
    for cls in COMMANDS[command]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if dataclasses.is_dataclass(hints[f.name]) or f.name in IGNORED[command]:
                # RunConfig.sampling / .engine: their fields are flags; an ignored field is refused, not taken
                assert not has_flag(helps[command], flag), f"{flag} is in `{command} --help`"
                continue
            assert has_flag(helps[command], flag), f"{cls.__name__}.{f.name} has no {flag} in `{command}`"
            if hints[f.name] is bool:  # every boolean can be turned off as well as on
                assert has_flag(helps[command], "--no-" + flag[2:]), f"no --no-{flag[2:]} in `{command}`"
    for name in IGNORED[command]:
        done = run_cli_here(command, "--" + name.replace("_", "-"))
        assert done.returncode == 2 and "unrecognized arguments" in done.stderr, done.stderr


def _flags_of(command: str) -> list[argparse.Action]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return [a for a in sub._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("command", [*COMMANDS, "report", "models"])
def test_every_flag_shows_its_default_in_plain_text_and_takes_both_spellings(command):
    """Each flag's help ends with its default (or says it is required); no reStructuredText markup reaches it; the
    dashed spelling comes first (usage shows it) and the underscore spelling is accepted too; a boolean is listed
    as --x, --no-x."""
    help_text = " ".join(run_cli_here(command, "--help").stdout.split())
    usage = help_text.split(" options: ")[0]
    for action in _flags_of(command):
        dashed, *others = action.option_strings
        assert dashed.startswith("--") and "_" not in dashed, action.option_strings
        assert "(default:" in action.help or "(required)" in action.help, f"{dashed}: {action.help!r}"
        assert not re.search(r"``|:[a-z]+:`|`", action.help), f"{dashed} has markup: {action.help!r}"
        assert "_" not in " ".join(re.findall(r"\[(--[^ \]]+)", usage)), usage
        name = dashed[2:].replace("-", "_")
        if "_" in name:
            assert f"--{name}" in others, f"{dashed}: --{name} is not accepted"
        if isinstance(action, cli._Switch):
            assert f"--no-{dashed[2:]}" in action.option_strings and f"{dashed}, --no-{dashed[2:]}" in help_text


def test_both_spellings_parse_to_one_setting():
    parser = cli.build_parser()
    for spelled in ("--max-tokens", "--max_tokens"):
        assert parser.parse_args(["generate", spelled, "7"]).max_tokens == 7
    for spelled, value in (("--no-resume", False), ("--no_resume", False), ("--resume", True)):
        assert parser.parse_args(["generate", spelled]).resume is value
    assert parser.parse_args(["serve", "--api-key", "k"]).api_key == "k"


def test_unknown_flag_and_unknown_config_key_exit_2_naming_them(tmp_path):
    # Were a flag taken, the settings given with it stop the command before it loads or starts a model.
    paths = ["--input", "x", "--output", "y.jsonl", "--teacher", "t", "--theta", "th"]
    done = run_cli_here("generate", *paths, "--shard", "2/2", "--max-tokenz", "3")
    assert done.returncode == 2 and "--max-tokenz" in done.stderr, done.stderr
    done = run_cli_here("serve", "--teacher", "t", "--theta", "th", "--port", "0", "--max-queue-size", "3")
    assert done.returncode == 2 and "--max-queue-size" in done.stderr, done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_tokens: 8\nmax_tokenz: 3\n")
    done = run_cli_here("generate", "--config", str(bad), "--input", "x", "--output", "y.jsonl")
    assert done.returncode == 2 and "unknown setting 'max_tokenz'" in done.stderr, done.stderr


def test_a_missing_input_exits_1_naming_it():
    done = run_cli_here("generate", "--output", "y.jsonl")
    assert done.returncode == 1 and "missing --input" in done.stderr, done.stderr


def test_flags_win_over_the_config_file(tmp_path, monkeypatch):
    """main() hands the run the file's settings with the flags given on top (the run itself is stubbed)."""
    import dual_sampling.datagen.run as run_module

    seen: list[RunConfig] = []
    monkeypatch.setattr(run_module, "run_generation", lambda config: seen.append(config) or {"failed_samples": 0})
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "max_tokens: 99\ntemperature: 0.5\nstop: [END]\nresume: true\nalpha-method: ess_balance\n"
        "teacher_engine_kwargs: {seed: 3}\n"
    )
    flags = ["--input", "in.jsonl", "--output", "o.jsonl", "--teacher", "t", "--theta", "th"]
    overrides = ["--temperature", "0.7", "--stop", "--no-resume", "--teacher-engine-kwargs", '{"seed": 4}']
    assert cli.main(["generate", "--config", str(cfg), *flags, *overrides]) == 0
    (run,) = seen
    assert run.sampling.temperature == 0.7 and run.sampling.max_tokens == 99  # the flag won, the file filled in
    assert run.sampling.stop == [] and run.resume is False  # `--stop` alone empties a list; --no-x turns x off
    assert run.engine.teacher_engine_kwargs == {"seed": 4} and run.engine.alpha_method == "ess_balance"
    assert run.source.teacher == "t" and run.source.chat_template is True  # a setting given nowhere keeps its default


def test_a_name_two_configs_share_fails_when_the_parser_is_built():
    @dataclass
    class One:
        top_k: int = 1
        """One's top_k."""

    @dataclass
    class Two:
        top_k: int = 2
        """Two's top_k."""

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    with pytest.raises(argparse.ArgumentError, match="conflicting option strings?: --top-k"):
        cli._add_command(sub, "both", (One, Two))
    assert cli._add_command(sub, "one", (One,)).parse_args(["--top-k", "5"]).top_k == 5  # alone it builds


@pytest.mark.engine
def test_distill_runs_from_a_config_file_and_resumes(tmp_path, tiny_same):
    """The whole command on the tiny pair: one round from a YAML file (in this process: its engines start from the
    session's fork server); a resume with another setting is refused by name, and a missing flag is named, each by
    an interpreter of its own, as a user's shell runs it."""
    import json

    teacher, theta = tiny_same
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"Count to {i}."}) + "\n" for i in range(12)))
    config = tmp_path / "distill.yaml"
    config.write_text(
        f"prompts: {prompts}\nteacher: {teacher}\ntheta: {theta}\nchat_template: false\neval_prompts: 2\n"
        "eval_max_tokens: 4\nprompts_per_round: 4\nsteps_per_round: 2\nmax_tokens: 6\nloss_top_k: 4\n"
        "max_num_seqs: 2\nmax_model_len: 128\nplot: false\n"
    )
    out = tmp_path / "run"
    args = ("distill", "--config", str(config), "--output", str(out))
    first = run_cli_here(*args, "--rounds", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = first.stdout[first.stdout.rindex("\n{") + 1 :] if "\n{" in first.stdout else first.stdout
    assert json.loads(summary)["round"] == 1 and "round 1: KL" in first.stderr
    rounds = [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1] and (out / "checkpoints" / "round-1" / "trainer_state.pt").exists()
    # --resume is the same flag as every other (resuming itself is test_distill's): a changed setting is refused.
    again = run_cli(*args, "--rounds", "2", "--resume", "--learning-rate", "1.0")
    assert again.returncode == 2 and "learning_rate" in again.stderr
    missing = run_cli("distill", "--output", str(tmp_path / "other"))
    assert missing.returncode != 0 and "--prompts" in missing.stderr
