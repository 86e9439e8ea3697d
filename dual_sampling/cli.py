"""The ``dual-sampling`` command line: ``generate``, ``distill``, ``serve``, ``report`` and ``models``.

``generate`` takes every setting of a run (:class:`dual_sampling.datagen.run_config.RunConfig`, its
:class:`SamplingOptions` and its :class:`EngineOptions`) as a flag (``--max-tokens 128``)
or as a key of ``--config run.yaml`` (``max_tokens: 128``); flags win over the file. ``distill`` does the same
with :class:`dual_sampling.distill.DistillConfig`. ``serve`` takes
:class:`ServeOptions` and :class:`EngineOptions` as flags. :class:`transformers.HfArgumentParser` makes the
flags from the dataclasses' fields and their help from the docstring under each field, so the flags, the
file's keys and the dataclasses can never disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dual_sampling.run_settings import composed_parts

__all__ = ["build_parser", "main"]


_MARKUP = re.compile(r":[a-z]+:`(~?)([^`]*)`|``([^`]*)``|`([^`]*)`")
"""Sphinx roles (``:class:`x```), inline literals and default-role text in a docstring."""


def _plain(text: str) -> str:
    """``text`` without reStructuredText markup (a ``~`` role keeps the last dotted part, as Sphinx shows it)."""

    def unmarked(m: re.Match) -> str:
        if m.group(2) is not None:
            return m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
        return m.group(3) if m.group(3) is not None else m.group(4)

    return _MARKUP.sub(unmarked, text)


def _field_help(cls: type) -> dict[str, str]:
    """The docstring written under each field of ``cls`` (or of the base class that declares it), by field name, in
    plain text: the one source of the ``--help`` text."""
    import docstring_parser

    docs = [p for base in reversed(cls.__mro__[:-1]) for p in docstring_parser.parse_from_object(base).params]
    # argparse formats help with %, so a literal one is doubled
    return {p.arg_name: _plain(" ".join((p.description or "").split())).replace("%", "%%") for p in docs}


def _shown(value: Any) -> str:
    """A default as a user would type it: JSON for dicts and lists, true/false, the bare value otherwise."""
    if isinstance(value, bool | dict | list):
        return json.dumps(value)
    return str(value)


class _Switch(argparse.Action):
    """A boolean flag: ``--x`` sets it, ``--no-x`` clears it (each with its underscore spelling too)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        dashed = option_strings[0][2:]
        self.negatives = [f"--no-{dashed}", f"--no_{dashed.replace('-', '_')}"]
        super().__init__([*option_strings, *self.negatives], dest, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)


class _Given(list):
    """The values of a setting given once or once per teacher (:class:`_OneOrNamed`), as typed; :func:`_per_teacher`
    reads them once every setting is known."""


class _OneOrNamed(argparse.Action):
    """A setting of one value or one per teacher: ``--teacher PATH`` once, or ``--teacher NAME=PATH`` once per
    teacher. The values are kept as typed (:class:`_Given`) and read by :func:`_per_teacher`, which knows the
    teachers: a value given once is read as ``NAME=VALUE`` only where NAME names a teacher, so a path or a system
    message holding "=" stays whole."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest, None)
        if not isinstance(given, _Given):
            given = _Given()
            setattr(namespace, self.dest, given)
        given.append(str(values))


def _per_teacher(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with each value of :class:`_OneOrNamed` read: the teachers first (one folder, or ``NAME=PATH``
    each when given more than once), then the other settings per teacher against their names."""

    def read(name: str, given: _Given, teachers: frozenset[str] | None) -> str | dict[str, str]:
        flag = "--" + name.replace("_", "-")
        keys = [text.partition("=")[0] if "=" in text else None for text in given]
        if teachers is not None:  # a setting per teacher: NAME=VALUE where NAME is a teacher's, else one value
            by_name = [key in teachers for key in keys]
            if any(by_name) and not all(by_name):
                raise SystemExit(f"{flag}: give one value, or TEACHER=VALUE for teachers of {sorted(teachers)}")
        else:  # the teachers themselves: NAME=PATH where given more than once
            by_name = [len(given) > 1 and any(key is not None and key.isidentifier() for key in keys)]
        if not all(by_name):
            return given[-1]  # one value; given again, the last wins, as for every other flag
        named: dict[str, str] = {}
        for text in given:
            key, sep, value = text.partition("=")
            if not (sep and key.isidentifier()):
                raise SystemExit(f"{flag}: given more than once, each must be NAME=VALUE; got {text!r}")
            if key in named:
                raise SystemExit(f"{flag}: {key!r} is named twice")
            named[key] = value
        return named

    out = dict(settings)
    if isinstance(out.get("teacher"), _Given):
        out["teacher"] = read("teacher", out["teacher"], None)
    teachers = frozenset(out["teacher"]) if isinstance(out.get("teacher"), dict) else frozenset()
    for name, value in out.items():
        if isinstance(value, _Given):
            out[name] = read(name, value, teachers)
    return out


class _HelpFormatter(argparse.HelpFormatter):
    """Lists each flag by its dashed spellings only (``--max-tokens``; ``--max_tokens`` is accepted too)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        dashed = [s for s in action.option_strings if "_" not in s]
        if not action.option_strings or not dashed:
            return super()._format_action_invocation(action)
        if action.nargs == 0:
            return ", ".join(dashed)
        return ", ".join(
            f"{s} {self._format_args(action, self._get_default_metavar_for_optional(action))}" for s in dashed
        )


def _add_field(parser: argparse.ArgumentParser, f: dataclasses.Field, kind: Any, help_text: str, default: Any) -> None:
    """One field as a flag. No parser default: a flag not given is left out of the namespace, so the ``--config``
    file and then the dataclass supply it; the help shows the default the run would use."""
    names = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
    if default is dataclasses.MISSING:
        help_text += " (required)"
    elif "(default:" not in help_text:  # a docstring may say what its default means itself
        help_text += f" (default: {_shown(default)})".replace("%", "%%")
    common: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
    if kind is bool:
        parser.add_argument(*names, action=_Switch, **common)
        return
    args = typing.get_args(kind)
    if str in args and dict[str, str] in args:  # PerTeacher: one value, or NAME=VALUE once per teacher
        parser.add_argument(*names, action=_OneOrNamed, metavar="[NAME=]VALUE", **common)
        return
    if type(None) in args:  # X | None: the flag takes an X; None is the default a flag cannot name
        kind = next(a for a in args if a is not type(None))
    if typing.get_origin(kind) is dict:
        parser.add_argument(*names, type=json.loads, metavar="JSON", **common)
    elif typing.get_origin(kind) is list:  # `--stop` alone stays the empty list
        parser.add_argument(*names, type=typing.get_args(kind)[0], nargs="*", **common)
    else:
        parser.add_argument(*names, type=kind, metavar=f.name.upper(), **common)


def _add_command(
    sub: Any, name: str, classes: Iterable[type], ignored: frozenset[str] = frozenset(), **kwargs: Any
) -> argparse.ArgumentParser:
    """A subcommand whose flags are the fields of ``classes`` (a composed config is not one: its own fields are);
    ``ignored``: fields the command has no use for, left out. A name two of them share fails here (argparse's
    conflicting option string), never silently resolved.

    ``classes[0]`` may carry ``PART_DEFAULTS`` (a run's own defaults for its parts' fields): the help shows
    those."""
    classes = list(classes)
    run_defaults = getattr(classes[0], "PART_DEFAULTS", {})
    part_of = {part_cls: part for part, part_cls in composed_parts(classes[0]).items()}
    parser = sub.add_parser(name, formatter_class=_HelpFormatter, **kwargs)
    for cls in classes:
        hints, docs = typing.get_type_hints(cls), _field_help(cls)
        overrides = run_defaults.get(part_of.get(cls), {})
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]) or f.name in ignored:
                continue
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            _add_field(parser, f, hints[f.name], docs.get(f.name, ""), overrides.get(f.name, default))
    return parser


def _read_config(path: str) -> dict[str, Any]:
    """The settings of a ``--config`` file, its keys spelled as fields (``max-tokens`` is ``max_tokens``).

    Read here rather than by ``HfArgumentParser.parse_yaml_file``, which builds the dataclasses from the file
    alone: a run's settings are the file's and the flags' together (see :func:`_run_settings`)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of run settings, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A run's flat settings: the ``--config`` file's, then the flags given (which win).

    A key that is no setting is refused by :meth:`RunConfig.from_settings`, naming it."""
    given = {k: v for k, v in vars(args).items() if k not in ("config", "run", "command")}
    return _per_teacher({**(_read_config(args.config) if args.config else {}), **given})


def _generate(args: argparse.Namespace) -> int:
    from dual_sampling.datagen.run_config import RunConfig

    settings = _run_settings(args)
    required = [f.name for f in dataclasses.fields(RunConfig) if f.default is f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in settings]
    if missing:
        raise SystemExit(f"dual-sampling generate: missing {', '.join('--' + m for m in missing)} (flag or config key)")
    config = RunConfig.from_settings(settings)
    from dual_sampling.datagen.run import run_generation

    summary = run_generation(config)
    print(json.dumps(summary, indent=1))
    return 0 if summary["failed_samples"] == 0 else 3


def _distill(args: argparse.Namespace) -> int:
    from dual_sampling.distill import DistillConfig, run_distillation

    settings = _run_settings(args)
    required = [
        f.name for f in dataclasses.fields(DistillConfig) if f.default is f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in settings]
    if missing:
        raise SystemExit(f"dual-sampling distill: missing {', '.join('--' + m for m in missing)} (flag or config key)")
    rows = run_distillation(DistillConfig.from_settings(settings))
    print(json.dumps(rows[-1], indent=1))
    return 0


def _start_engine_server_early() -> None:
    """Once a command's settings are checked and before it imports vLLM: the engines' fork server starts now, so its
    imports run beside this process's. Not before the checks: the server holds this process's output streams until
    its imports end, so a refused command's caller would wait for them."""
    from dual_sampling import start_engine_server_early

    start_engine_server_early()


def _report(args: argparse.Namespace) -> int:
    from dual_sampling.datagen.report import write_report

    out_dir = write_report(args.records, args.out_dir)
    print(f"report written to {out_dir}")
    return 0


def _models(args: argparse.Namespace) -> int:
    from dual_sampling import models

    teacher, theta = models.smollm2(), models.smollm2_pruned(args.keep_layers)
    print(f"teacher  {teacher}")
    print(f"theta    {theta}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from dual_sampling.options import EngineOptions
    from dual_sampling.run_settings import ModelsAndPrompts
    from dual_sampling.server.serve_options import ServeOptions

    settings = _per_teacher({k: v for k, v in vars(args).items() if k not in ("run", "command")})
    source = ModelsAndPrompts(settings.pop("teacher", None), settings.pop("theta", None))
    serve_keys = {f.name for f in dataclasses.fields(ServeOptions)}
    options = ServeOptions(**{k: v for k, v in settings.items() if k in serve_keys})
    engine = EngineOptions(**{k: v for k, v in settings.items() if k not in serve_keys})
    engine.check_roster(source.roster)  # before the fork server starts: a refused command waits for nothing
    teacher, theta = source.teacher, source.theta
    _start_engine_server_early()
    from dual_sampling.api import OptimalSamplingDual
    from dual_sampling.server.app import serve

    with OptimalSamplingDual(teacher, theta, engine=engine, use_tqdm=False) as dual:
        serve(dual, options)
    return 0


_NO_PROGRESS_BAR = frozenset({"use_tqdm"})
"""What ``serve`` and ``distill`` leave out: they draw no progress bar (a server has no terminal to draw on, and a
distillation round logs its own line)."""


_CONFIG_HELP = "YAML file with the same keys as the flags, in either spelling; flags override it (default: none)"


def build_parser() -> argparse.ArgumentParser:
    from dual_sampling.datagen.run_config import RunConfig
    from dual_sampling.distill import DistillConfig
    from dual_sampling.options import EngineOptions
    from dual_sampling.server.serve_options import ServeOptions

    parser = argparse.ArgumentParser(
        prog="dual-sampling", description="Sample from the geometric mixture of two models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = _add_command(
        sub,
        "generate",
        (RunConfig, *composed_parts(RunConfig).values()),
        help="run (or resume) a distillation data-generation run",
        description="Generate one record per (problem, sample) from the teacher/theta mixture.",
    )
    g.add_argument("--config", help=_CONFIG_HELP)
    g.set_defaults(run=_generate)

    d = _add_command(
        sub,
        "distill",
        (DistillConfig, *composed_parts(DistillConfig).values()),
        ignored=_NO_PROGRESS_BAR,
        help="run (or resume) on-policy distillation: sample from q, train θ, push its weights, evaluate",
        description="Each round samples from the mixture with the current θ, trains θ on the samples (importance "
        "weights π_θ/q), pushes the new weights into the theta engine without a restart and evaluates on held-out "
        "prompts. Writes metrics.jsonl, a checkpoint per round and plot.png to --output.",
    )
    d.add_argument("--config", help=_CONFIG_HELP)
    d.set_defaults(run=_distill)

    r = sub.add_parser("report", help="plots and a Markdown summary of the records a generate run wrote")
    r.add_argument("records", help="what generate wrote: a .jsonl or .parquet file, or a directory of Parquet parts")
    r.add_argument("--out-dir", "--out_dir", help="where to write (default: RECORDS.report/)")
    r.set_defaults(run=_report)

    s = _add_command(
        sub,
        "serve",
        (ServeOptions, EngineOptions),
        ignored=_NO_PROGRESS_BAR,
        help="serve the mixture behind an OpenAI-compatible HTTP API",
        description="Serve the teacher/theta mixture: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics.",
    )
    s.add_argument(
        "--teacher",
        action=_OneOrNamed,
        metavar="[NAME=]PATH",
        help="teacher model folder (default: the local SmolLM2-135M-Instruct); NAME=PATH once per teacher for several",
    )
    s.add_argument("--theta", help="theta model folder (default: the 24-layer pruned SmolLM2)")
    s.set_defaults(run=_serve)

    m = sub.add_parser("models", help="build the default SmolLM2 teacher and pruned theta folders (no download)")
    m.add_argument(
        "--keep-layers",
        "--keep_layers",
        type=int,
        default=24,
        help="decoder layers the theta model keeps, of 30 (default: 24)",
    )
    m.set_defaults(run=_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"dual-sampling {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
