"""The ``dual-sampling`` command line: ``generate``, ``serve``, ``report`` and ``models``.

``generate`` takes every setting of a run (:class:`dual_sampling.datagen.run_config.RunConfig`, its
:class:`SamplingOptions` and its :class:`EngineOptions`) as a flag (``--max-tokens 128``)
or as a key of ``--config run.yaml`` (``max_tokens: 128``); flags win over the file. The
flags and their help are derived from the dataclasses, so they can never disagree.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each dataclass field, by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(getattr(nxt, "value", None), ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _config_classes() -> list[type]:
    from dual_sampling.datagen.run_config import RunConfig
    from dual_sampling.options import EngineOptions, SamplingOptions

    return [RunConfig, SamplingOptions, EngineOptions]


def _add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            continue  # a composed config: its own fields are flags
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": docs.get(f.name, "")}
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif kind.startswith("list["):
            parser.add_argument(flag, nargs="*", metavar="VALUE", type=int if kind == "list[int]" else str, **kwargs)
        elif kind.startswith("dict["):
            parser.add_argument(flag, type=json.loads, metavar="JSON", **kwargs)
        else:
            base = kind.split("|")[0].strip()
            parser.add_argument(flag, type={"int": int, "float": float}.get(base, str), **kwargs)


def _load_config_file(path: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of run settings, got {type(data).__name__}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    known = {f.name for cls in _config_classes() for f in dataclasses.fields(cls)} - {"sampling", "engine"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
    return data


def _generate(args: argparse.Namespace) -> int:
    from dual_sampling.datagen.run import run_generation
    from dual_sampling.datagen.run_config import RunConfig

    settings = _load_config_file(args.config) if args.config else {}
    settings.update({k: v for k, v in vars(args).items() if k not in ("config", "run", "command")})
    missing = [name for name in ("input", "output") if name not in settings]
    if missing:
        raise SystemExit(f"dual-sampling generate: missing {', '.join('--' + m for m in missing)} (flag or config key)")
    summary = run_generation(RunConfig.from_settings(settings))
    print(json.dumps(summary, indent=1))
    return 0 if summary["failed_samples"] == 0 else 3


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
    teacher = settings.pop("teacher", None) or str(models.smollm2())
    theta = settings.pop("theta", None) or str(models.smollm2_pruned())
    serve_keys = {f.name for f in dataclasses.fields(ServeOptions)}
    options = ServeOptions(**{k: v for k, v in settings.items() if k in serve_keys})
    engine = EngineOptions(**{k: v for k, v in settings.items() if k not in serve_keys})
    with OptimalSamplingDual(teacher, theta, **{**dataclasses.asdict(engine), "use_tqdm": False}) as dual:
        serve(dual, options)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dual-sampling", description="Sample from the geometric mixture of two models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="run (or resume) a distillation data-generation run",
        description="Generate one record per (problem, sample) from the teacher/theta mixture.",
    )
    g.add_argument("--config", help="YAML file with the same keys as the flags (flags override it)")
    for cls in _config_classes():
        _add_config_flags(g, cls)
    g.set_defaults(run=_generate)

    r = sub.add_parser("report", help="plots and a Markdown summary of a records file")
    r.add_argument("records", help="a .jsonl or .parquet records file written by generate")
    r.add_argument("--out-dir", help="where to write (default: RECORDS.report/)")
    r.set_defaults(run=_report)

    s = sub.add_parser(
        "serve",
        help="serve the mixture behind an OpenAI-compatible HTTP API",
        description="Serve the teacher/theta mixture: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics.",
    )
    s.add_argument("--teacher", help="teacher model folder (default: the local SmolLM2-135M-Instruct)")
    s.add_argument("--theta", help="theta model folder (default: the 24-layer pruned SmolLM2)")
    from dual_sampling.options import EngineOptions
    from dual_sampling.server.serve_options import ServeOptions

    for cls in (ServeOptions, EngineOptions):
        _add_config_flags(s, cls)
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
