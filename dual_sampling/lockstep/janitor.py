"""Cleanup after a crash: the sessions and segment listings whose driver is gone.

Every :meth:`~dual_sampling.lockstep.session.SyncSession.create` runs
:func:`cleanup_stale_sessions` first. It acts only on this user's regular files, never
follows a symlink, and removes from a listing only names of the shared-memory segments
engines make. A session's header carries its driver's boot, PID namespace and start time; a
session of another PID namespace (a container sharing /dev/shm) is left alone, since its
driver's liveness cannot be seen from here: only a session of its own namespace removes it.
Listings live in this user's private directory (:func:`listing_dir`, mode 0700).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from stat import S_IMODE, S_ISDIR, S_ISLNK, S_ISREG

import numpy as np

from dual_sampling.lockstep.layout import HEADER_WORDS, MAGIC, SESSION_PREFIX, SHM_DIR, Header, SyncError

logger = logging.getLogger(__name__)

_LISTING_DIR_PREFIX = "dual-sampling."
"""This user's listing directory is ``<shm dir>/dual-sampling.<uid>`` (no session name starts so)."""
_SESSION_NAME = re.compile(re.escape(SESSION_PREFIX) + r"(?P<pid>\d+)-[0-9a-f]+")
SCRATCH_KINDS = ("weights", "ipc")
"""Private folders a process keeps in this user's :func:`listing_dir`, named ``<kind>-<pid>-<hex>``: weights on their
way into an engine, and vLLM's ZMQ sockets of one engine pair. Each holds its maker's :func:`owner_tag` in
:data:`OWNER_FILE`. The name stays short: vLLM binds its sockets at ``<ipc folder>/<uuid4>``, and a Unix socket's
path may not pass 107 characters (``zmq.IPC_PATH_MAX_LEN``)."""
_NEW_SCRATCH_GRACE_S = 60.0
"""How long a scratch folder still being made (``.new``, no owner file yet) is never judged stale."""
OWNER_FILE = ".owner"
"""The file in a scratch folder holding its maker's boot, PID namespace and start time (decimal, one line)."""
_SCRATCH_NAME = re.compile(r"(?:" + "|".join(SCRATCH_KINDS) + r")-(?P<pid>\d+)-[0-9a-f]+(?P<new>\.new)?")
"""A scratch folder's name; ``.new`` while it is being made (before its owner file is in it)."""
_LISTING_NAME = re.compile(r"(?P<session>" + _SESSION_NAME.pattern + r")\.segments(?P<tmp>\.tmp)?")
_ROWS_HANDLE_NAME = re.compile(r"(?P<session>" + _SESSION_NAME.pattern + r")\.rows(?P<tmp>\.tmp)?")
"""The device row channel's buffer handle (``lockstep.row_channel``): in this user's :func:`listing_dir` (older versions
put it beside its session)."""
_LISTED_NAME = re.compile(
    r"psm_[0-9A-Za-z_]+"  # multiprocessing.shared_memory (vLLM's message queues and buffers)
    r"|sem\.mp-[0-9a-z_]+"  # multiprocessing's named semaphores
    r"|torch_\d+_\d+_\d+"  # torch's file_system sharing strategy
    r"|vllm_[0-9A-Za-z_-]+\.mmap"  # vLLM's CPU KV-offload and encoder-cache regions
)
"""Names a listing may hold: the shared-memory segments engines create. No '/', no '..', no NUL."""


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` of this PID namespace, in clock ticks after boot (/proc/<pid>/stat field 22).

    None if no such process runs (zombies count as gone). A pid and its start time name one
    process: a later process given the same pid has a later start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the command name before ")" may hold spaces
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists in this PID namespace (zombies count as gone)."""
    return process_start_time(pid) is not None


def owner_tag() -> tuple[int, int, int]:
    """(boot, PID namespace inode, start time) of this process, as the header of a session it creates records them.

    Read on each call, never cached: a forked child has its own start time, and may have its own namespace.
    """
    boot = int(Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:15], 16)
    start = process_start_time(os.getpid())
    assert start is not None  # this process runs
    return boot, os.stat("/proc/self/ns/pid").st_ino, start


def cleanup_stale_sessions(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove what dead drivers of this user left in ``shm_dir``: session files, and the files their engines listed.

    Session files are ``dual-sampling-<pid>-<token>``; listings are in this user's private
    :func:`listing_dir` (or, from older versions, next to the sessions). A session is stale when
    its header's driver (pid and start time) no longer runs; one of another boot is stale too.
    One of another PID namespace is left alone with a warning: its pid means nothing here. A
    session file without that tag (older versions) or a listing without its session file is
    judged by its pid alone. Only this user's regular files are touched (symlinks never); another
    user's leftovers are theirs, logged and left. A session file goes only once its listing has.
    Never raises for what it finds. Returns the names removed.
    """
    own = owner_tag()
    gone: dict[str, bool] = {}

    def stale(session: str, pid: int) -> bool:
        if session not in gone:
            gone[session] = _session_gone(shm_dir / session, pid, own)
        return gone[session]

    removed: list[str] = []
    listed: set[str] = set()  # sessions whose listing stays (a file it names is still mapped)
    private = own_listing_dirs(shm_dir)
    listings = []
    for directory in private:
        with contextlib.suppress(FileNotFoundError):  # removed, empty, by another process's cleanup meanwhile
            listings += sorted(directory.iterdir())
    for path in listings:  # scratch folders of a process that died before removing them
        m = _SCRATCH_NAME.fullmatch(path.name)
        if m and _own_dir(path) and _scratch_gone(path, m, own):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    for path in [*listings, *sorted(shm_dir.glob(SESSION_PREFIX + "*.segments*"))]:
        m = _LISTING_NAME.fullmatch(path.name)
        if not m or not _own_file(path) or not stale(m["session"], int(m["pid"])):
            continue
        if m["tmp"]:  # its writer died between writing and renaming it
            path.unlink(missing_ok=True)
            removed.append(path.name)
            continue
        gone_now = _remove_listed(path, shm_dir)
        removed += gone_now
        if path.name not in gone_now:
            listed.add(m["session"])
    for path in [*listings, *sorted(shm_dir.glob(SESSION_PREFIX + "*.rows*"))]:
        m = _ROWS_HANDLE_NAME.fullmatch(path.name)
        if m and _own_file(path) and stale(m["session"], int(m["pid"])):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    for path in sorted(shm_dir.glob(SESSION_PREFIX + "*")):
        m = _SESSION_NAME.fullmatch(path.name)
        if m and path.name not in listed and stale(path.name, int(m["pid"])):
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(path.name)
    for directory in private:
        remove_if_empty(directory)
    return removed


def _session_gone(path: Path, pid: int, own: tuple[int, int, int]) -> bool:
    """Whether the driver of session ``path`` (``pid`` in its name) is gone, as far as this process can tell.

    ``own`` is this process's :func:`owner_tag`. A file that is not this user's regular file is
    never judged gone.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return not pid_alive(pid)
    except OSError as exc:  # a symlink (ELOOP), or another user's file (EACCES)
        logger.warning("session file %s is left alone: %s", path, exc.strerror)
        return False
    try:
        st = os.fstat(fd)
        if not _own_stat(path, st):
            return False
        raw = os.pread(fd, 8 * HEADER_WORDS, 0)
    finally:
        os.close(fd)
    header = np.frombuffer(raw, np.int64) if len(raw) == 8 * HEADER_WORDS else None
    if header is None or int(header[Header.MAGIC]) != MAGIC or int(header[Header.OWNER_PID_NS]) == 0:
        return not pid_alive(pid)  # no tag: an older version's session
    tag = (int(header[Header.OWNER_BOOT]), int(header[Header.OWNER_PID_NS]), int(header[Header.OWNER_START]))
    return _owner_gone(path, int(header[Header.OWNER_PID]), tag, own)


def _scratch_gone(path: Path, m: re.Match, own: tuple[int, int, int]) -> bool:
    """Whether the process that made scratch folder ``path`` (its name parsed as ``m``) is gone."""
    tag = _read_owner_file(path / OWNER_FILE)
    if tag is None:  # no owner file: an older version's folder, or one whose maker died while making it
        if m["new"]:  # being made, perhaps by a process of another namespace: only an old one is stale
            with contextlib.suppress(OSError):
                if time.time() - os.lstat(path).st_mtime < _NEW_SCRATCH_GRACE_S:
                    return False
        return not pid_alive(int(m["pid"]))
    return _owner_gone(path, int(m["pid"]), tag, own)


def _read_owner_file(path: Path) -> tuple[int, int, int] | None:
    """(boot, PID namespace, start time) from an owner file of this user's; None if there is no readable one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not _own_stat(path, os.fstat(fd)):
            return None
        words = os.read(fd, 128).split()
        boot, namespace, start = (int(w) for w in words)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return boot, namespace, start


def _owner_gone(path: Path, pid: int, tag: tuple[int, int, int], own: tuple[int, int, int]) -> bool:
    """Whether process ``pid`` with owner tag ``tag`` (boot, PID namespace, start time) is gone, seen from a process
    whose tag is ``own``. One of another PID namespace (a container sharing /dev/shm) is never judged gone: its pid
    means nothing here, and only a process of its own namespace may remove what it made."""
    boot, namespace, start = tag
    if boot != own[0]:
        return True
    if namespace != own[1]:
        logger.warning(
            "%s is left alone: its maker ran in another PID namespace (inode %d, this one's is %d), "
            "whose processes cannot be seen from here",
            path,
            namespace,
            own[1],
        )
        return False
    return process_start_time(pid) != start


def _own_stat(path: Path, st: os.stat_result) -> bool:
    """Whether ``st`` (of ``path``, not followed) is a regular file of this user; logs why not."""
    if not S_ISREG(st.st_mode):
        logger.warning("%s is left alone: not a regular file (mode %o)", path, st.st_mode)
        return False
    if st.st_uid != os.getuid():
        logger.warning("%s is left to its owner, uid %d (this is uid %d)", path, st.st_uid, os.getuid())
        return False
    return True


def _own_dir(path: Path) -> bool:
    """Whether ``path`` is a directory of this user (not a symlink to one)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def scratch_dir(kind: str, shm_dir: Path = SHM_DIR) -> Path:
    """A new private folder (mode 0700) in this user's :func:`listing_dir`, of a kind in :data:`SCRATCH_KINDS`.

    Named ``<kind>-<pid>-<hex>`` and holding this process's :func:`owner_tag` in :data:`OWNER_FILE`, so a cleanup
    removes it once this process is gone, should it die before removing it itself, and a process of another PID
    namespace sharing /dev/shm (another container) leaves it alone. It is made as ``<name>.new`` and renamed once its
    owner file is written: a cleanup never sees it untagged.
    """
    if kind not in SCRATCH_KINDS:
        raise ValueError(f"kind must be one of {SCRATCH_KINDS}, got {kind!r}")
    path = listing_dir(shm_dir) / f"{kind}-{os.getpid()}-{secrets.token_hex(6)}"
    new = path.with_name(path.name + ".new")
    os.mkdir(new, 0o700)
    try:
        fd = os.open(new / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, " ".join(str(word) for word in owner_tag()).encode() + b"\n")
        finally:
            os.close(fd)
        os.rename(new, path)
    except BaseException:  # a full /dev/shm (ENOSPC) must not leave a half-made folder behind
        shutil.rmtree(new, ignore_errors=True)
        raise
    return path


def _own_file(path: Path) -> bool:
    """Whether ``path`` exists and is a regular file of this user, without following a symlink."""
    try:
        return _own_stat(path, os.lstat(path))
    except FileNotFoundError:
        return False


def session_owners(shm_dir: Path = SHM_DIR) -> set[int]:
    """Pids named by the session files in ``shm_dir`` (their drivers, alive or not)."""
    return {int(m["pid"]) for path in shm_dir.glob(SESSION_PREFIX + "*") if (m := _SESSION_NAME.fullmatch(path.name))}


def _remove_listed(listing: Path, shm_dir: Path) -> list[str]:
    """Remove the files a stale listing names (segments of this user no live process maps), then the listing.

    Names of any other form (a path, '..', an unknown kind) and files that are not this
    user's regular files are dropped from the listing, with a warning, and never touched.
    """
    try:
        names = json.loads(listing.read_text())
    except (FileNotFoundError, ValueError):
        names = []
    candidates = []
    for name in names if isinstance(names, list) else []:
        if not (isinstance(name, str) and _LISTED_NAME.fullmatch(name)):
            logger.warning("%s lists %r, not a shared-memory segment name; it is not removed", listing, name)
        elif _own_file(shm_dir / name):
            candidates.append(name)
    mapped = mapped_shm_files() if candidates else set()
    removed, kept = [], []
    for name in candidates:
        if name in mapped:
            kept.append(name)  # an engine of the dead driver may still be exiting: a later cleanup removes it
            continue
        # /dev/shm is sticky: no other user can swap the file checked above for one of theirs before this.
        try:
            (shm_dir / name).unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("cannot remove %s: %s", shm_dir / name, exc.strerror)
            continue
        removed.append(name)
    if kept:
        try:
            moved = segments_listing(listing.name.removesuffix(".segments"), shm_dir)  # an older version's: moved
            write_listing(moved, kept)
        except SyncError as exc:
            logger.warning("%s is kept as it is: %s", listing, exc)
            return removed
        if moved != listing:
            listing.unlink(missing_ok=True)
        return removed
    listing.unlink(missing_ok=True)
    return [*removed, listing.name]


def mapped_shm_files(pids: list[int] | None = None) -> set[str]:
    """Names in /dev/shm of the files mapped by the given processes (every readable one when None).

    Matched by inode, not by the path a mapping shows: a POSIX semaphore is mapped under the
    temporary name it was created with and reached through a link (``sem.mp-*``) made after.
    Only processes of this PID namespace can be seen.
    """
    if pids is None:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    inodes = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(str(SHM_DIR) + "/"):
                inodes.add(int(parts[4]))
    names = set()
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                if entry.inode() in inodes:
                    names.add(entry.name)
    return names


def listing_dir(shm_dir: Path = SHM_DIR) -> Path:
    """This user's private directory (mode 0700) in ``shm_dir`` for listings and scratch folders.

    ``dual-sampling.<uid>`` when it is this user's and private, made if missing. /dev/shm is writable by every
    user, so anyone can make that name first (or a symlink, or a directory open to others) and block it: then a
    private directory with a name no one can guess, ``dual-sampling.<uid>.<hex>``, is made instead, with a warning.
    An existing one of this user's is reused, and :func:`cleanup_stale_sessions` reads every one
    (:func:`own_listing_dirs`). A directory is checked (type, owner, mode, with ``lstat``) before it is used.
    """
    for _ in range(3):  # a cleanup removes an empty one; look again
        found = own_listing_dirs(shm_dir)
        if found:
            return found[0]
        plain = listing_dir_path(shm_dir)
        with contextlib.suppress(FileExistsError):
            os.mkdir(plain, 0o700)
        try:
            st = os.lstat(plain)
        except FileNotFoundError:
            continue
        problem = _not_private(st)
        if problem is None:
            return plain
        logger.warning(
            "%s is %s (the listings of shared-memory segments must be private to uid %d): it is left alone, and a "
            "private directory with a random name is used instead",
            plain,
            problem,
            os.getuid(),
        )
        path = shm_dir / f"{plain.name}.{secrets.token_hex(6)}"
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            if _not_private(os.lstat(path)) is None:
                return path
    raise SyncError(f"no private directory for the listings could be made in {shm_dir}")


def listing_dir_path(shm_dir: Path) -> Path:
    """The plain name of this user's listing directory, ``<shm_dir>/dual-sampling.<uid>``."""
    return shm_dir / f"{_LISTING_DIR_PREFIX}{os.getuid()}"


def own_listing_dirs(shm_dir: Path = SHM_DIR) -> list[Path]:
    """This user's private listing directories in ``shm_dir``, the plain name first; others of those names are logged
    and left alone (another user could plant listings in them that a cleanup would act on)."""
    plain = listing_dir_path(shm_dir)
    pattern = re.compile(re.escape(plain.name) + r"(?:\.[0-9a-f]{12})?")
    found = []
    try:
        names = sorted((name for name in os.listdir(shm_dir) if pattern.fullmatch(name)), key=lambda n: (len(n), n))
    except FileNotFoundError:
        return []
    for name in names:
        try:
            st = os.lstat(shm_dir / name)
        except FileNotFoundError:
            continue
        problem = _not_private(st)
        if problem is None:
            found.append(shm_dir / name)
        else:
            logger.warning("%s is %s: the listings there are not used or cleaned up", shm_dir / name, problem)
    return found


def _not_private(st: os.stat_result) -> str | None:
    """None if ``st`` (from lstat) is a directory of this user with mode 0700; else what it is."""
    if S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        return None
    kind = "a symlink" if S_ISLNK(st.st_mode) else "a directory" if S_ISDIR(st.st_mode) else "a file"
    return f"{kind} of uid {st.st_uid} with mode {S_IMODE(st.st_mode):04o}"


def remove_if_empty(directory: Path) -> None:
    """Remove the listing directory once it holds nothing; a writer makes it again (:func:`write_listing`)."""
    with contextlib.suppress(OSError):  # not empty, already gone, or not this user's to remove
        os.rmdir(directory)


def write_listing(listing: Path, names: Iterable[str]) -> None:
    """Replace ``listing`` with these /dev/shm names in one rename (a reader never sees half a list).

    ``listing`` is in one of this user's listing directories; if a cleanup removed that directory, the listing goes
    to the current :func:`listing_dir` instead (a removed name is never made again: someone could have taken it).
    """
    text = json.dumps(sorted(names))
    for attempt in range(3):
        try:
            private = _not_private(os.lstat(listing.parent)) is None
        except FileNotFoundError:
            private = False
        if not private:  # removed by a cleanup (or taken by someone else): never make that name again
            listing = listing_dir(listing.parent.parent) / listing.name
        tmp = listing.with_name(listing.name + ".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, listing)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise  # the directory was removed again between making it and writing (a cleanup found it empty)


def rows_handle(session_name: str, shm_dir: Path = SHM_DIR) -> Path:
    """Where the device row channel's buffer handle of a session lies: in this user's :func:`listing_dir`, which is
    made (or checked) here, out of reach of other users (/dev/shm itself is writable by all)."""
    if not _SESSION_NAME.fullmatch(session_name):
        raise ValueError(f"{session_name!r} is not a session name ({SESSION_PREFIX}<pid>-<hex>)")
    return listing_dir(shm_dir) / f"{session_name}.rows"


def segments_listing(session_name: str, shm_dir: Path = SHM_DIR) -> Path:
    """Where a session lists the /dev/shm files its engines created, for cleanup after a crash.

    In this user's :func:`listing_dir`, which is made (or checked) here.
    """
    if not _SESSION_NAME.fullmatch(session_name):
        raise ValueError(f"{session_name!r} is not a session name ({SESSION_PREFIX}<pid>-<hex>)")
    return listing_dir(shm_dir) / f"{session_name}.segments"
