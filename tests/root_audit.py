"""Run one spoolctl command under an audit hook that watches every path operation it makes
inside a store root, and optionally swaps a directory of the store for a symlink at every
step (the store's owner racing root's maintenance).

    python tests/root_audit.py REPORT ROOT [SWAP_DIRS TARGET MODE] -- ARGS...

``REPORT`` receives a JSON document: ``violations`` (each a path operation made as root
under ``ROOT`` by name, not relative to a directory descriptor: see ``violation``), the
command's exit ``code``. With ``SWAP_DIRS`` (``tmp,state,quarantine``: each on its own),
before every audited operation ``ROOT/SWAP_DIR`` is made a symlink to ``TARGET`` if the
operation names a path through it, and otherwise (``MODE`` ``flip``) flipped (real, link,
real...), so both a check and the call after it meet each state, or (``MODE`` ``through``:
the owner lets the store's layout be checked, ``os.mkdir``, and swaps afterwards) made the
real directory again. The audit events (``sys.addaudithook``) carry
every ``open``, ``os.remove``, ``os.rename``, ``os.chown``... with their ``dir_fd``; a
relative one-component name is one made relative to a descriptor (the command runs in
``/``, far from the store).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from urllib.parse import unquote

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# event -> the positions of its path arguments (``os.symlink``'s first one is the link's
# text, not a path the call resolves)
PATH_ARGS: dict[str, tuple[int, ...]] = {
    "open": (0,), "os.remove": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (1,), "os.mkdir": (0,), "os.rmdir": (0,), "os.chown": (0,),
    "os.chmod": (0,), "os.utime": (0,), "os.truncate": (0,), "os.listdir": (0,),
    "os.scandir": (0,), "os.chflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
    "os.chdir": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (0, 1),
    "shutil.move": (0, 1), "sqlite3.connect": (0,),
}


def _text(value: object) -> str | None:
    if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__"):
        return os.fsdecode(os.fspath(value))  # type: ignore[arg-type]
    return None  # a descriptor, None


def violation(event: str, args: tuple, root: str) -> str | None:
    """Why this operation made as root could follow a link the store's owner planted, or
    None. A path under ``root`` (not ``root`` itself: its parent is not the owner's) named
    from ``/`` is resolved by name through directories the owner can swap; so is a
    relative name of several components (relative to some descriptor, it still crosses a
    directory by name); an ``open`` of one name must not follow a link at it either."""
    for pos in PATH_ARGS.get(event, ()):
        if pos >= len(args) or (text := _text(args[pos])) is None:
            continue
        if event == "sqlite3.connect" and text.startswith("file:"):  # a URI: its path
            text = unquote(text[5:].split("?")[0])
        if os.path.isabs(text):
            norm = os.path.normpath(text)
            if norm.startswith(root + os.sep):
                return f"{event} by absolute path {norm}"
        elif text and text not in (".",):
            if os.sep in text.strip(os.sep) or text == "..":
                return f"{event} of a multi-component relative path {text!r}"
            if event == "open" and isinstance(args[2], int) and args[2] != -1 \
                    and not args[2] & _O_NOFOLLOW and args[1] is None:
                return f"open of {text!r} relative to a descriptor without O_NOFOLLOW"
    return None


def _where() -> str:
    """The innermost spoolctl frames of the operation (to find the call to fix)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/spoolctl/" in f.filename]
    return " <- ".join(f"{f.filename.split('/spoolctl/')[-1]}:{f.lineno}"
                       for f in reversed(frames[-4:]))


class Swapper:
    """Makes ``root/name`` a symlink to ``target`` and back (as its owner could)."""

    def __init__(self, root: str, name: str, target: str):
        self.path = os.path.join(root, name)
        self.hidden = os.path.join(root, f".{name}.real")
        self.target = target
        self.linked = False
        self.flips = 0

    def set(self, linked: bool) -> None:
        if linked == self.linked:
            return
        try:
            if linked:
                os.rename(self.path, self.hidden)
                os.symlink(self.target, self.path)
            else:
                os.unlink(self.path)
                os.rename(self.hidden, self.path)
        except OSError:
            return
        self.linked = linked
        self.flips += 1

    def through(self, event: str, args: tuple) -> bool:
        for pos in PATH_ARGS.get(event, ()):
            if pos < len(args) and (text := _text(args[pos])) is not None and \
                    (os.path.normpath(text) + os.sep).startswith(self.path + os.sep):
                return True
        return False


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    head, args = argv[:split], argv[split + 1:]
    report, root = head[0], os.path.normpath(head[1])
    swappers = [Swapper(root, name, head[3]) for name in head[2].split(",")] \
        if len(head) > 3 else []
    flip = len(head) > 4 and head[4] == "flip"
    local = threading.local()
    lock = threading.RLock()
    count = [0]

    def hook(event: str, hook_args: tuple) -> None:
        if event not in PATH_ARGS or getattr(local, "busy", False):
            return
        local.busy = True
        try:
            if os.geteuid() == 0 and (why := violation(event, hook_args, root)) is not None:
                # appended at once: a forked child (status, metrics) ends with os._exit
                line = json.dumps({"why": why, "where": _where(), "pid": os.getpid()})
                fd = os.open(report + ".v", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                try:
                    os.write(fd, (line + "\n").encode())
                finally:
                    os.close(fd)
            with lock:
                count[0] += 1
                for swapper in swappers:
                    swapper.set((swapper.through(event, hook_args)
                                 and (flip or event != "os.mkdir"))
                                or (flip and bool(count[0] % 2)))
        finally:
            local.busy = False

    os.chdir("/")
    from spoolctl.cli.app import main as cli_main

    sys.addaudithook(hook)
    code = 0
    try:
        cli_main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        local.busy = True  # nothing after the command is the command's
        for swapper in swappers:
            swapper.set(False)
        try:
            with open(report + ".v") as fh:
                found = [json.loads(line) for line in fh]
        except FileNotFoundError:
            found = []
        with open(report, "w") as fh:
            json.dump({"violations": found, "code": code,
                       "flips": sum(s.flips for s in swappers)}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
