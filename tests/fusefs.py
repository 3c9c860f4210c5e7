"""A passthrough FUSE filesystem the tests control (issue 32), run as its own process:
``python tests/fusefs.py BACKING MOUNT CONTROL``. Every operation passes through to BACKING,
except opens and reads of files whose path (inside the mount) contains a line of the file
CONTROL: those fail with EIO, as a failing sector or a broken network mount does.

Needs the kernel's FUSE (``/dev/fuse``), libfuse3 (Debian ``fuse3``) and ``mfusepy``.
SQLite's shared-memory file does not work on it (SIGBUS): mount it over a store's
``manifests/`` or ``objects/`` directory, not over a whole store.
"""

from __future__ import annotations

import errno
import os
import sys

import mfusepy as fuse


class Controlled(fuse.Operations):
    use_ns = True

    def __init__(self, backing: str, control: str):
        self.backing = backing
        self.control = control

    def _p(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _failing(self, path: str) -> bool:
        try:
            with open(self.control) as f:
                patterns = [line.strip() for line in f if line.strip()]
        except FileNotFoundError:
            return False
        return any(p in path for p in patterns)

    def getattr(self, path, fh=None):
        st = os.lstat(self._p(path))
        out = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size")}
        return out | {"st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns,
                      "st_ctime": st.st_ctime_ns}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._p(path))]

    def open(self, path, flags):
        if self._failing(path):
            raise fuse.FuseOSError(errno.EIO)
        return os.open(self._p(path), flags)

    def read(self, path, size, offset, fh):
        if self._failing(path):
            raise fuse.FuseOSError(errno.EIO)
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)

    def opendir(self, path):
        return 0

    def releasedir(self, path, fh):
        return 0

    def statfs(self, path):
        st = os.statvfs(self._p(path))
        return {k: getattr(st, k) for k in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
            "f_flag", "f_frsize", "f_namemax")}


if __name__ == "__main__":
    backing, mount, control = sys.argv[1:4]
    fuse.FUSE(Controlled(backing, control), mount, foreground=True, default_permissions=True)
