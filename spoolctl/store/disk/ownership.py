"""Files root leaves in another user's store go back to that user (issue 30.5).

Root may act on a store another user owns (``--allow-foreign-owner``: a scrub or clean run
by hand, a systemd unit without ``User=``). Every file it creates is root's, mode 0600:
``state/scrub.lock``, ``state/scrub.sqlite3``, quarantine items, temp files. The owner's own
jobs then fail on them at every run. So when root closes such a store, the files it made in
the store's small directories (``state/``, ``tmp/``, ``quarantine/``) are given to the
owner of the root (uid and gid); ``doctor`` names any the owner still cannot open
(``store.files``).
"""

from __future__ import annotations

import contextlib
import os
import stat

from .root import StorePaths


def give_back(layout: StorePaths) -> int:
    """As root, on a store owned by another user: chown what root owns in ``state/``,
    ``tmp/`` and ``quarantine/`` (one level below it too) to the store's owner. Returns how
    many files changed hands; 0 (and no work) for anyone but root or on root's own store.
    Never follows a link; best effort (a file gone meanwhile is skipped)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return 0
    try:
        st = os.stat(layout.root)
    except OSError:
        return 0
    if st.st_uid == 0:
        return 0
    changed = 0
    for top, depth in ((layout.state, 1), (layout.tmp, 1), (layout.quarantine, 2)):
        changed += _give(str(top), st.st_uid, st.st_gid, depth)
    return changed


def _give(path: str, uid: int, gid: int, depth: int) -> int:
    changed = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for e in entries:
        with contextlib.suppress(OSError):
            st = e.stat(follow_symlinks=False)
            if st.st_uid == 0:
                os.lchown(e.path, uid, gid)
                changed += 1
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                changed += _give(e.path, uid, gid, depth - 1)
    return changed
