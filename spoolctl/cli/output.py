"""The CLI's one checked write: every byte a command hands to stdout, to a metrics textfile
or to an archive file is written whole or the command fails (exit 3).

``os.write`` may write less than it was given (a disk that fills up part-way), and Python's
unbuffered text stdout (``PYTHONUNBUFFERED=1``, the default in many container images)
drops the rest of a short write without a word: ``ls --json > FILE`` on a nearly full disk
wrote a cut document and exited 0. Here a short write is resumed, and the error that ends
it (ENOSPC, EIO) raises. A file is written under a temp name and renamed into place only
when whole, so a reader (node_exporter) never sees a cut one.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from spoolctl.errors import ConfigError, OutputWriteError

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to ``fd``, resuming short writes; OSError if the
    descriptor refuses more (a full disk ends a short write with ENOSPC on the next one)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def output_failed(exc: OSError, where: str | Path, fix: str) -> OutputWriteError:
    """The command's error for output that could not be written whole at ``where``."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return OutputWriteError(f"cannot write the output whole: {reason}", path=str(where),
                            fix=fix, errno=exc.errno)


def replace_file(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a same-directory temp file, fsynced, then renamed
    into place: a reader sees the old file or the whole new one. The mode is set with
    ``fchmod`` (whatever the umask: a textfile is read by another user). A file that cannot
    be created is a ConfigError (exit 2); one that cannot be written whole is an
    OutputWriteError (exit 3), the old file left as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    sweep_leftovers(path, ".tmp")
    try:
        if os.path.lexists(tmp):  # a leftover (or anything planted there): never open it
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                     mode)
    except OSError as exc:
        raise ConfigError(f"cannot create the file: {os.strerror(exc.errno or 0)}",
                          path=path, fix="check the directory's permissions") from None
    try:
        try:
            os.fchmod(fd, mode)
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise output_failed(exc, path, "free space on its filesystem (or check the "
                                       "disk); the previous file is unchanged") from None


# A temp file untouched this long whose writer's process is gone is a leftover (a writer
# killed with -9). The age also spares a live writer on another host of a shared directory.
STALE_TEMP_S = 60.0


def sweep_leftovers(path: Path, suffix: str) -> list[Path]:
    """Remove ``.NAME.<pid><suffix>`` temp files of ``path`` (what ``replace_file`` and an
    export write before the rename) whose writer is no longer running; the removed ones."""
    import re
    import time

    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+){re.escape(suffix)}")
    removed: list[Path] = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        found = pattern.fullmatch(name)
        if found is None or _running(int(found.group(1))):
            continue
        leftover = path.parent / name
        with contextlib.suppress(OSError):
            if time.time() - os.lstat(leftover).st_mtime >= STALE_TEMP_S:
                os.unlink(leftover)
                removed.append(leftover)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or no such pid number): leave it
    return True
