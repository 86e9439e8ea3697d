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
import functools
import json
import sys
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


def _field_help(cls: type) -> dict[str, str]:
    """The docstring written under each field of ``cls``, by field name: the one source of the ``--help`` text."""
    import docstring_parser

    docs = docstring_parser.parse_from_object(cls).params
    # argparse formats help with %, so a literal one is doubled
    return {p.arg_name: " ".join((p.description or "").split()).replace("%", "%%") for p in docs}


def _flags(cls: type) -> type:
    """The fields of ``cls`` that are flags, as the dataclass :class:`HfArgumentParser` reads.

    The parser is handed this copy, not ``cls``: it rewrites the fields it reads (their types), and it
    would make a flag of a composed dataclass (``RunConfig.sampling``).
    Each field carries its docstring as ``metadata["help"]`` and no default: a flag not given is left
    out, so the ``--config`` file and then the dataclass supply it.
    """
    hints = typing.get_type_hints(cls)
    docs = _field_help(cls)
    specs = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):  # a composed config: its own fields are the flags
            continue
        metadata: dict[str, Any] = {"help": docs.get(f.name, "")}
        if typing.get_origin(kind) is dict:  # HfArgumentParser cannot parse a dict: it is given as JSON
            kind, metadata["metavar"] = json.loads, "JSON"
        elif typing.get_origin(kind) is list:  # its lists take 1+ values; `--stop` alone stays the empty list
            kind, metadata["nargs"] = typing.get_args(kind)[0], "*"
        specs.append((f.name, kind, dataclasses.field(default=argparse.SUPPRESS, metadata=metadata)))
    return dataclasses.make_dataclass(cls.__name__, specs)


def _add_command(sub: Any, name: str, classes: Iterable[type], **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose flags are the fields of ``classes``; a name two of them share fails here (argparse's
    conflicting option string), never silently resolved."""
    views = [_flags(cls) for cls in classes]
    parser = sub.add_parser(name, dataclass_types=views, **kwargs)
    # HfArgumentParser adds --no-x only to a flag whose default is True; every boolean has --x and --no-x.
    for view in views:
        for f in dataclasses.fields(view):
            if f.type is bool:
                no = [f"--no_{f.name}", f"--no-{f.name.replace('_', '-')}"]
                parser.add_argument(
                    *no, action="store_false", dest=f.name, default=argparse.SUPPRESS, help=f"set {f.name} to false"
                )
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
    return {**(_read_config(args.config) if args.config else {}), **given}


def _generate(args: argparse.Namespace) -> int:
    from dual_sampling.datagen.run import run_generation
    from dual_sampling.datagen.run_config import RunConfig

    settings = _run_settings(args)
    required = [f.name for f in dataclasses.fields(RunConfig) if f.default is f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in settings]
    if missing:
        raise SystemExit(f"dual-sampling generate: missing {', '.join('--' + m for m in missing)} (flag or config key)")
    summary = run_generation(RunConfig.from_settings(settings))
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
    from dual_sampling import models
    from dual_sampling.api import OptimalSamplingDual
    from dual_sampling.options import EngineOptions
    from dual_sampling.server.app import serve
    from dual_sampling.server.serve_options import ServeOptions

    settings = {k: v for k, v in vars(args).items() if k not in ("run", "command")}
    teacher, theta = models.default_pair(settings.pop("teacher", None), settings.pop("theta", None))
    serve_keys = {f.name for f in dataclasses.fields(ServeOptions)}
    options = ServeOptions(**{k: v for k, v in settings.items() if k in serve_keys})
    engine = EngineOptions(**{k: v for k, v in settings.items() if k not in serve_keys})
    with OptimalSamplingDual(teacher, theta, **{**dataclasses.asdict(engine), "use_tqdm": False}) as dual:
        serve(dual, options)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from transformers import HfArgumentParser

    from dual_sampling.datagen.run_config import RunConfig
    from dual_sampling.distill import DistillConfig
    from dual_sampling.options import EngineOptions
    from dual_sampling.run_settings import composed_parts
    from dual_sampling.server.serve_options import ServeOptions

    parser = argparse.ArgumentParser(
        prog="dual-sampling", description="Sample from the geometric mixture of two models."
    )
    # HfArgumentParser's own formatter adds "(default: ...)", which the flags (none has a parser default) never show
    commands = functools.partial(HfArgumentParser, formatter_class=argparse.HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=commands)

    g = _add_command(
        sub,
        "generate",
        (RunConfig, *composed_parts(RunConfig).values()),
        help="run (or resume) a distillation data-generation run",
        description="Generate one record per (problem, sample) from the teacher/theta mixture.",
    )
    g.add_argument("--config", help="YAML file with the same keys as the flags (flags override it)")
    g.set_defaults(run=_generate)

    d = _add_command(
        sub,
        "distill",
        (DistillConfig, *composed_parts(DistillConfig).values()),
        help="run (or resume) on-policy distillation: sample from q, train θ, push its weights, evaluate",
        description="Each round samples from the mixture with the current θ, trains θ on the samples (importance "
        "weights π_θ/q), pushes the new weights into the theta engine without a restart and evaluates on held-out "
        "prompts. Writes metrics.jsonl, a checkpoint per round and plot.png to --output.",
    )
    d.add_argument("--config", help="YAML file with the same keys as the flags (flags override it)")
    d.set_defaults(run=_distill)

    r = sub.add_parser("report", help="plots and a Markdown summary of a records file")
    r.add_argument("records", help="a .jsonl or .parquet records file written by generate")
    r.add_argument("--out-dir", help="where to write (default: RECORDS.report/)")
    r.set_defaults(run=_report)

    s = _add_command(
        sub,
        "serve",
        (ServeOptions, EngineOptions),
        help="serve the mixture behind an OpenAI-compatible HTTP API",
        description="Serve the teacher/theta mixture: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics.",
    )
    s.add_argument("--teacher", help="teacher model folder (default: the local SmolLM2-135M-Instruct)")
    s.add_argument("--theta", help="theta model folder (default: the 24-layer pruned SmolLM2)")
    s.set_defaults(run=_serve)

    m = sub.add_parser("models", help="build the default SmolLM2 teacher and pruned theta folders (no download)")
    m.add_argument("--keep-layers", type=int, default=24, help="decoder layers the theta model keeps (of 30)")
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
