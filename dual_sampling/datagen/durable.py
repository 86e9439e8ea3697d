"""How every file of a run is written: JSON that holds no NaN or infinity, and renames whose bytes, and then the
rename itself, reach the disk before anything counts on them. A temporary file is written through
:func:`~dual_sampling.run_output.open_no_follow`: a link planted at its name is refused, never written through.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dual_sampling.run_output import open_no_follow

__all__ = ["dumps", "replace_durably", "write_text_durably"]


def dumps(value: Any) -> str:
    """JSON as every file of a run holds it: NaN and infinity are refused (they are not JSON)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` survive a crash."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename a finished ``tmp`` over ``path``: its bytes reach the disk first, then the rename does."""
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_text_durably(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) through ``<path>.tmp`` (:func:`replace_durably`)."""
    tmp = path.with_name(path.name + ".tmp")
    with open_no_follow(tmp) as f:
        f.write(text)
    replace_durably(tmp, path)
