"""A run's output on disk (data runs, distillation runs): one writer at a time, and writes that never follow a link.

Two runs on one output would interleave their lines and delete each other's checkpoints, so a run holds an
exclusive lock on ``<output>.lock`` from start to end and a second run fails at once. Inside its output a run writes
every file through :func:`open_no_follow` (a symlink or FIFO planted at a file's name is refused, never written
through; :func:`write_no_follow` writes a whole text with it), makes the folders it keeps through :func:`own_dir` (a
link at a folder's name is refused, never written through) and its checkpoint folders through :func:`fresh_dir` (a
link planted at ``checkpoints/round-3.partial`` is removed, never followed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["fresh_dir", "open_no_follow", "own_dir", "remove_path", "single_writer", "write_no_follow"]


@contextmanager
def single_writer(output: str | Path, lock: Path) -> Iterator[None]:
    """Hold the exclusive lock file ``lock`` for ``output`` while the block runs; FileExistsError at once if another
    run holds it (naming both)."""
    from filelock import FileLock, Timeout

    lock.parent.mkdir(parents=True, exist_ok=True)
    held = FileLock(lock, timeout=0)
    try:
        held.acquire()
    except Timeout:
        raise FileExistsError(
            f"{output} is being written by another run: its lock file {lock} is held; wait for that run to end"
        ) from None
    try:
        yield
    finally:
        held.release()


_MODES = {"w": 0, "a": os.O_APPEND, "wb": 0, "ab": os.O_APPEND}
"""The modes :func:`open_no_follow` opens a file in, with the flag each adds: truncated or appended to."""


def open_no_follow(path: Path, mode: str = "w") -> IO[Any]:
    """``path`` opened to write, never through a link: ``mode`` is "w" or "a" (UTF-8 text), "wb" or "ab" (bytes),
    truncated ("w") or appended to ("a"), made (mode 0644) if missing. The caller closes it.

    A symlink at ``path`` is refused (OSError naming it), never followed, and so is anything there that is not a
    regular file (a FIFO is neither waited on nor truncated). Only the last component is checked: the folders above it
    are the run's own.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {tuple(_MODES)}, got {mode!r}")
    # O_NONBLOCK: opening a FIFO planted there would otherwise wait for a reader (it is refused just below); no
    # O_TRUNC yet, so a file that is not regular is never truncated.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | _MODES[mode], 0o644)
    except OSError as exc:
        raise OSError(exc.errno, f"{path} cannot be written without following a link or waiting on a FIFO") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        if not mode.startswith("a"):
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode, encoding=None if mode.endswith("b") else "utf-8")
    except BaseException:
        os.close(fd)
        raise


def write_no_follow(path: Path, text: str, append: bool = False) -> None:
    """Write (or append) ``text`` to ``path``, fsync'd, through :func:`open_no_follow` (a symlink there is refused)."""
    with open_no_follow(path, "a" if append else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def remove_path(path: Path) -> None:
    """Remove whatever is at ``path``: a folder with its contents, a file, or a symlink (the link, not its target)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def own_dir(path: Path) -> Path:
    """The folder ``path``, made (with any missing folders above it) if missing, kept with its contents if there.

    A symlink at its name is refused (ValueError naming it), never written through: the files written into it would
    land wherever it points. So is anything else there that is not a folder. Only the last component is checked: the
    folders above it are the caller's.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)
    # lstat after mkdir, not before: a link planted in between is seen here rather than followed.
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise ValueError(f"{path} must be a plain folder, not a link or a file: nothing is written through it")
    return path


def fresh_dir(path: Path) -> Path:
    """An empty new directory at ``path``: whatever was there is removed first (:func:`remove_path`; a symlink as the
    link itself, where writing into it would follow it). FileExistsError if something takes the name again first."""
    remove_path(path)
    os.mkdir(path, 0o755)
    return path
