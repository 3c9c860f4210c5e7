"""A passthrough FUSE filesystem the tests control (issue 32), run as its own process:
``python tests/fusefs.py BACKING MOUNT CONTROL``. Every operation passes through to BACKING,
except on paths (inside the mount) that a line of the file CONTROL names:

* ``PATTERN`` (a plain line): opens and reads of matching paths fail with EIO, as a failing
  sector or a broken network mount does;
* ``hang PATTERN``: every operation on a matching path (lookups, stats, opens, reads,
  writes, listings) blocks, as on a hung mount, until the line is removed from CONTROL;
  ``hang /`` hangs the whole mount;
* ``nolink``: hard links fail with EPERM, as on a filesystem without them (vfat, many FUSE
  and SMB mounts).

The tests drive it through ``tests/fusemount.py``, which always releases and unmounts it.
Needs the kernel's FUSE (``/dev/fuse``), libfuse3 (Debian ``fuse3``) and ``mfusepy``.
A whole store can live on it (files created on it open read-write, so SQLite's WAL index
can be mapped; hard links pass through, so a drive marker can be written), or only a
store's ``manifests/`` or ``objects/`` directory (a publish into it from the store's
``tmp/`` is then a cross-device rename, refused before it gets here).
"""

from __future__ import annotations

import errno
import os
import sys
import time

import mfusepy as fuse

# How often a hung operation looks at CONTROL again (only bounds how soon a release is
# seen; nothing waits on it but the hung operation itself).
HANG_POLL_S = 0.02


class Controlled(fuse.Operations):
    use_ns = True

    def __init__(self, backing: str, control: str):
        self.backing = backing
        self.control = control

    def _p(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _rules(self) -> tuple[list[str], list[str]]:
        """(EIO patterns, hang patterns) from CONTROL now."""
        try:
            with open(self.control) as f:
                lines = [line.strip() for line in f if line.strip()]
        except FileNotFoundError:
            return [], []
        hang = [line[5:].strip() for line in lines if line.startswith("hang ")]
        return [line for line in lines if not line.startswith("hang ")
                and line != "nolink"], hang

    def _gate(self, path: str) -> list[str]:
        """Block while a ``hang`` line matches ``path``; then the EIO patterns."""
        while True:
            eio, hang = self._rules()
            if not any(p in path for p in hang):
                return eio
            time.sleep(HANG_POLL_S)

    def _failing(self, path: str) -> bool:
        return any(p in path for p in self._gate(path))

    def getattr(self, path, fh=None):
        self._gate(path)
        st = os.lstat(self._p(path))
        out = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size")}
        return out | {"st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns,
                      "st_ctime": st.st_ctime_ns}

    def readdir(self, path, fh):
        self._gate(path)
        return [".", "..", *os.listdir(self._p(path))]

    def open(self, path, flags):
        if self._failing(path):
            raise fuse.FuseOSError(errno.EIO)
        return os.open(self._p(path), flags)

    def read(self, path, size, offset, fh):
        if self._failing(path):
            raise fuse.FuseOSError(errno.EIO)
        return os.pread(fh, size, offset)

    # Writes pass through too (a rename from outside the mount is still EXDEV: the kernel
    # refuses it before it gets here); they hang with the rest.

    def create(self, path, mode, fi=None):
        self._gate(path)
        # The kernel does not pass the caller's flags here (fusepy without raw_fi): open for
        # reading too, or a shared writable mmap of the file (SQLite's WAL index) reads its
        # pages through a write-only handle and the process gets SIGBUS.
        return os.open(self._p(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)

    def write(self, path, data, offset, fh):
        self._gate(path)
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        self._gate(path)
        os.truncate(self._p(path), length)

    def fsync(self, path, datasync, fh):
        self._gate(path)
        os.fsync(fh)

    def mkdir(self, path, mode):
        self._gate(path)
        os.mkdir(self._p(path), mode)

    def unlink(self, path):
        self._gate(path)
        os.unlink(self._p(path))

    def rmdir(self, path):
        self._gate(path)
        os.rmdir(self._p(path))

    def rename(self, old, new):
        self._gate(old)
        self._gate(new)
        os.replace(self._p(old), self._p(new))

    def link(self, target, source):
        # mfusepy's order: ``target`` is the new name, ``source`` the existing file. Without
        # it a hard link fails EROFS, and a drive marker (created by os.link, so two
        # processes agree on one id) could never be written on the mount.
        self._gate(source)
        self._gate(target)
        with open(self.control) as f:
            if "nolink" in (line.strip() for line in f):
                raise fuse.FuseOSError(errno.EPERM)
        os.link(self._p(source), self._p(target))

    def chmod(self, path, mode):
        self._gate(path)
        os.chmod(self._p(path), mode)

    def utimens(self, path, times=None):
        self._gate(path)
        os.utime(self._p(path), ns=times)

    def release(self, path, fh):
        os.close(fh)

    def opendir(self, path):
        self._gate(path)
        return 0

    def releasedir(self, path, fh):
        return 0

    def statfs(self, path):
        self._gate(path)
        st = os.statvfs(self._p(path))
        return {k: getattr(st, k) for k in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
            "f_flag", "f_frsize", "f_namemax")}


if __name__ == "__main__":
    backing, mount, control = sys.argv[1:4]
    fuse.FUSE(Controlled(backing, control), mount, foreground=True, default_permissions=True)
