"""The ``dual-sampling`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]


def _models(args: argparse.Namespace) -> int:
    from dual_sampling import models

    teacher, theta = models.smollm2(), models.smollm2_pruned(args.keep_layers)
    print(f"teacher  {teacher}")
    print(f"theta    {theta}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dual-sampling", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("models", help="build the default SmolLM2 teacher and pruned theta folders (no download)")
    p.add_argument("--keep-layers", type=int, default=24, help="decoder layers the theta model keeps (of 30)")
    p.set_defaults(run=_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
