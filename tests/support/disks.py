"""A small real filesystem for the disk-fault tests: a tmpfs that a test mounts where
localrt writes (its data folder, its home), fills up, frees again or makes read-only.

`small_disk` is a pytest fixture (tests/conftest.py takes it in): it gives a function
`mount(path, size="8m", inodes=None) -> SmallDisk`, and unmounts every disk it mounted
after the test, after the fixtures that the test asked for later (an app) are closed.
Mounting needs root (tests run as root here); where it is impossible, the test is
skipped and says why.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

FILL_BLOCK = 1 << 20  # bytes the filler writes at once; the last write is cut short


class SmallDisk:
    """A tmpfs mounted at `path`: fill it, free it, make it read-only and back."""

    def __init__(self, path: Path):
        self.path = path
        self._fillers: list[Path] = []

    def fill(self) -> int:
        """Take every free byte (and, where inodes are limited, the inodes) with filler
        files at the disk's top; the bytes taken."""
        taken = 0
        filler = self.path / f".filler{len(self._fillers)}"
        self._fillers.append(filler)
        with open(filler, "wb", buffering=0) as out:
            block = bytes(FILL_BLOCK)
            try:
                while True:
                    taken += out.write(block)  # short once the disk is nearly full
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        return taken

    def use_inodes(self) -> int:
        """Take every free inode with empty files (bytes stay free); how many."""
        folder = self.path / ".inodes"
        folder.mkdir()
        self._fillers.append(folder)
        n = 0
        try:
            while True:
                (folder / str(n)).touch()
                n += 1
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        return n

    def free(self) -> None:
        """Give back what fill and use_inodes took."""
        for filler in self._fillers:
            if filler.is_dir():
                shutil.rmtree(filler)
            else:
                filler.unlink(missing_ok=True)
        self._fillers.clear()

    def free_bytes(self) -> int:
        """The bytes free on the disk now."""
        return shutil.disk_usage(self.path).free

    def free_inodes(self) -> int:
        """The inodes free on the disk now."""
        return os.statvfs(self.path).f_favail

    def read_only(self) -> None:
        """Remount the disk read-only: no write succeeds, root's neither."""
        _run("mount", "-o", "remount,ro", str(self.path))

    def writable(self) -> None:
        """Remount the disk read-write."""
        _run("mount", "-o", "remount,rw", str(self.path))

    def unmount(self) -> None:
        """Unmount it; lazily if something still holds a file open there."""
        if subprocess.run(["umount", str(self.path)], capture_output=True).returncode:
            _run("umount", "-l", str(self.path))


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")


@pytest.fixture
def small_disk():
    """mount(path, size="8m", inodes=None): a SmallDisk (a tmpfs of `size`, with at most
    `inodes` files) mounted at `path`, created if missing; each is unmounted after the
    test. Skips the test where a tmpfs cannot be mounted (not root, no mount(8))."""
    mounted: list[SmallDisk] = []

    def mount(path: Path, size: str = "8m", inodes: int | None = None) -> SmallDisk:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs for the disk-fault tests needs root")
        if shutil.which("mount") is None:
            pytest.skip("mount(8) is not installed, so no small tmpfs can be made")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        options = f"size={size},mode=0700" + (f",nr_inodes={inodes}" if inodes else "")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs at {path}: {result.stderr.strip()}")
        disk = SmallDisk(path)
        mounted.append(disk)
        return disk

    yield mount
    for disk in reversed(mounted):
        disk.unmount()
