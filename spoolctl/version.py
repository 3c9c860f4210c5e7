"""The version ``spoolctl --version`` prints: the release and the commit it was built from,
``0.1.0+g<12 hex>``, so two builds hundreds of commits apart never print the same thing.

Run from a git checkout (an editable install, ``python -m spoolctl`` in a clone), the commit
is the checkout's HEAD, read from its files when asked: an editable install is built once
and its build-time commit would go stale. Otherwise it is the one ``setup.py`` wrote into
``spoolctl/_build.py`` when the wheel or sdist was built; ``+unknown`` when neither is known.
"""

from __future__ import annotations

import os
import re

from spoolctl import __version__

_COMMIT = re.compile(r"[0-9a-f]{7,40}")


def version() -> str:
    commit = checkout_commit() or built_commit()
    return f"{__version__}+g{commit}" if commit else f"{__version__}+unknown"


def checkout_commit() -> str | None:
    """HEAD's short hash when this package runs from a git checkout, else None. Read from
    the repository's files (HEAD, the ref, packed-refs; a linked worktree's ``.git`` file
    too), not by running git: ``--version`` stays as quick as the interpreter's start."""
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        gitdir = _gitdir(os.path.join(top, ".git"))
        if gitdir is None:
            return None
        head = _read(os.path.join(gitdir, "HEAD"))
        if head.startswith("ref: "):
            head = _resolve(gitdir, head[5:].strip()) or ""
    except (OSError, UnicodeDecodeError):
        return None
    return head[:12] if _COMMIT.fullmatch(head) else None


def _gitdir(dotgit: str) -> str | None:
    if os.path.isdir(dotgit):
        return dotgit
    if not os.path.isfile(dotgit):
        return None
    text = _read(dotgit)  # a linked worktree: "gitdir: <path>"
    if not text.startswith("gitdir: "):
        return None
    return os.path.join(os.path.dirname(dotgit), text[8:].strip())


def _resolve(gitdir: str, ref: str) -> str | None:
    """The hash ``ref`` names: a loose ref, else packed-refs, in the worktree's own git dir
    or the repository's common one."""
    common = gitdir
    if os.path.isfile(os.path.join(gitdir, "commondir")):
        common = os.path.join(gitdir, _read(os.path.join(gitdir, "commondir")).strip())
    for base in dict.fromkeys((gitdir, common)):
        loose = os.path.join(base, ref)
        if os.path.isfile(loose):
            return _read(loose).strip()
        packed = os.path.join(base, "packed-refs")
        if os.path.isfile(packed):
            for line in _read(packed).splitlines():
                if line.endswith(" " + ref):
                    return line.split(" ", 1)[0]
    return None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read(1 << 20).strip()


def built_commit() -> str | None:
    """The commit ``setup.py`` recorded at build time, if this is a built install."""
    try:
        from spoolctl._build import COMMIT  # type: ignore[import-not-found]
    except ImportError:
        return None
    return COMMIT if isinstance(COMMIT, str) and _COMMIT.fullmatch(COMMIT) else None
