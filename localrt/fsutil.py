"""Crash-safe file writes: a kill at any moment leaves the old file or the new one; and
what a failed write means to a user (`storage_error`: a full disk, a read-only folder).
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from localrt.errors import DiskFull, HTTPError, InsufficientStorage

# What an OSError's errno says about the disk: no space left (or the user's quota is
# spent), or a folder localrt may not write in (a read-only mount, permissions).
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
# The way out that storage_error offers for localrt's data folder (models, engines).
MOVE_DATA = " (or set dataFolderPath to a folder on another disk)"
DISK_MARGIN = 64 * 1024 * 1024  # free space a big write leaves on a disk of 1.25 GiB or more
MARGIN_SHARE = 20  # on a smaller disk, a twentieth of it: 64 MiB would be most of the disk

# Seconds after which a temp file of atomic_write is a kill's leftover: a write takes far
# less, and a younger one may be another process's write in flight.
STALE_TEMP_AGE = 60.0


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` to `path` through a temp file, fsync and rename.

    A kill before the rename leaves the temp file (`.<name>.<random>.tmp`); the owner of
    `path` calls remove_stale_temps when it first reads it."""
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def write_json(path: Path, data) -> None:
    """Write `data` as indented JSON with atomic_write."""
    atomic_write(path, json.dumps(data, indent=2).encode())


def remove_stale_temps(path: Path, age: float = STALE_TEMP_AGE) -> int:
    """Delete the temp files that atomic_write(path) left when killed mid-write, those
    older than `age` seconds; how many went."""
    path = Path(path)
    removed, now = 0, time.time()
    try:
        stale = list(path.parent.glob(glob.escape(f".{path.name}.") + "*.tmp"))
    except OSError:
        return 0
    for tmp in stale:
        try:
            if now - tmp.stat().st_mtime >= age:
                tmp.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def read_json(path: Path, default: dict) -> dict:
    """A JSON object file's content; `default` when it is missing, unreadable or no object."""
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else default
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as exc:
        logging.getLogger(__name__).warning("ignoring %s: %s", path, exc)
        return default


def private_dir(path: Path) -> Path:
    """Create `path` and its missing parents as folders only their owner can open (0700).

    Path.mkdir(parents=True) gives the parents the umask's mode (often 0755), and
    these folders hold the model definitions, the logs and the settings' neighbours.
    """
    target = path = Path(path)
    missing = []
    while not path.is_dir() and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue
        os.chmod(folder, 0o700)  # whatever the umask took away or left
    return target


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def human_size(n: float) -> str:
    """A byte count for people: 512 B, 1.2 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def existing_folder(path: Path) -> Path:
    """`path` if it is a folder, else its nearest ancestor that is one: where a write
    into `path` takes its space from."""
    path = Path(path)
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def disk_margin(total: int) -> int:
    """The free space kept beyond what a big write (a pull, an import, an unpack) needs on
    a disk of `total` bytes."""
    return min(DISK_MARGIN, total // MARGIN_SHARE)


def space_short(folder: Path, needed: int) -> tuple[int, int, int]:
    """(bytes short, free bytes, margin) for writing `needed` more bytes in `folder`:
    short is 0 when they fit with the margin kept free."""
    usage = shutil.disk_usage(existing_folder(folder))
    margin = disk_margin(usage.total)
    return max(0, needed + margin - usage.free), usage.free, margin


def no_inodes(folder: Path) -> bool:
    """Whether the filesystem of `folder` has bytes but no free inodes (files) left."""
    try:
        st = os.statvfs(existing_folder(folder))
    except OSError:
        return False
    return st.f_files > 0 and st.f_favail == 0


def storage_error(exc: OSError, folder: Path, what: str, hint: str = "",
                  after: str = "") -> HTTPError:
    """The 507 for `exc`, an OSError met while trying to `what` ("write the settings
    file ...") in `folder`: DiskFull (insufficient_storage) when no space is left, else
    InsufficientStorage (storage_error). The message names the folder and what to do;
    `hint` adds a way out ("or set dataFolderPath ..."), `after` a last sentence."""
    folder = existing_folder(folder)
    tail = f" {after}" if after else ""
    if exc.errno in NO_SPACE:
        why = " (it has no free inodes: too many files)" if no_inodes(folder) else ""
        return DiskFull(f"No space left in {folder} to {what}{why}; free some space on "
                        f"that disk{hint}, then try again.{tail}")
    if exc.errno in NOT_WRITABLE:
        return InsufficientStorage(f"{folder} is not writable ({exc.strerror or exc}), so "
                                   f"localrt cannot {what}; make it writable{hint}, then "
                                   f"try again.{tail}")
    return InsufficientStorage(f"Cannot {what} in {folder}: {exc.strerror or exc}.{tail}")
