"""The one error hierarchy of spoolctl.

Every error carries the path it concerns (when there is one) and a one-line
fix, so the CLI can print ``error: <what> (<path>): <fix>`` and nothing else.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any


class QuarantineReason(str, enum.Enum):
    """Why an item was moved to quarantine (a closed vocabulary, used in JSON and metrics)."""

    MANIFEST_IO = "manifest_io"
    MANIFEST_VALIDATION = "manifest_validation"
    PAYLOAD_DIGEST = "payload_digest"
    PAYLOAD_SIZE = "payload_size"
    PAYLOAD_MISSING = "payload_missing"
    OBJECT_COLLISION = "object_collision"
    CATALOG = "catalog"
    SCRUB_STATE = "scrub_state"  # state/scrub.sqlite3 unreadable: quarantined and reset
    AUTH_QUEUE = "auth_queue"  # state/auth_requests.sqlite3 unreadable: quarantined and reset
    AUTH_TAG = "auth_tag"  # a tag key is configured and the entry has no valid tag
    UNKNOWN = "unknown"


class SpoolError(Exception):
    """Base class of every error spoolctl raises on purpose.

    ``message`` says what is wrong, ``path`` where, ``fix`` what the operator
    should do about it. ``str()`` renders all three on one line. ``code`` and ``status``
    are the remote service's HTTP code and status where a remote call failed, else None.
    """

    code: int | None = None
    status: object = None

    def __init__(self, message: str, *, path: str | Path | None = None, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = str(path) if path is not None else None
        self.fix = fix

    def __str__(self) -> str:
        text = self.message
        if self.path:
            text += f" ({self.path})"
        if self.fix:
            text += f": {self.fix}"
        return text


class ConfigError(SpoolError):
    """Bad configuration or usage: a wrong root, size, id or option (CLI exit code 2)."""


class RootError(ConfigError):
    """A store root that must not be created or adopted."""


class InvalidIdError(ConfigError):
    """An entry id, object name or other identifier that fails validation."""


class NotFoundError(SpoolError):
    """The entry (or quarantine item) does not exist; for a cache this is a miss."""


class KeyUnavailableError(NotFoundError):
    """An encrypted entry whose data key is gone (revoked, retired) or whose master key is not
    the one configured: a miss, never corruption; nothing is quarantined."""

    def __init__(self, message: str, *, path: str | Path | None = None, fix: str | None = None,
                 erased: bool = False):
        super().__init__(message, path=path, fix=fix)
        # True when the configured master key owns the keyring and the key is simply gone
        # (revoked or retired): the entry can never be read again and may be released.
        self.erased = erased


class BusyError(SpoolError):
    """A lock or lease could not be taken within its timeout."""


class ReadOnlyError(ConfigError):
    """A write was attempted on a store opened with ``read_only=True``."""


class StoreIOError(SpoolError):
    """The disk failed under a write (ENOSPC, EIO...). Nothing partial was published.

    ``errno`` is the OS error number when one is known (ENOSPC for a full disk, also when
    SQLite reported it), so callers can tell a full disk from other failures."""

    def __init__(self, message: str, *, path: str | Path | None = None, fix: str | None = None,
                 errno: int | None = None):
        super().__init__(message, path=path, fix=fix)
        self.errno = errno


class DiskNotAnsweringError(StoreIOError):
    """The store's disk did not answer within a deadline (a hung mount, a stalled drive):
    the store counts as down and nothing of it was read."""


class CapacityError(SpoolError):
    """The entry does not fit the store's configured maximum even after eviction."""


class CorruptionError(SpoolError):
    """Stored bytes failed verification. The entry has been quarantined; treat as a miss."""

    def __init__(
        self,
        message: str,
        *,
        reason: QuarantineReason,
        path: str | Path | None = None,
        fix: str | None = None,
        entry_id: str | None = None,
    ):
        super().__init__(message, path=path, fix=fix)
        self.reason = reason
        self.entry_id = entry_id


class ManifestError(CorruptionError):
    """A manifest that cannot be read or does not validate."""


class ArchiveError(SpoolError):
    """An export archive that is malformed, truncated, hostile or inconsistent (CLI exit 1).

    Raised before anything of the defective part is published; entries completed and
    verified before the defect stay (each was committed on its own). ``report`` is the
    import's report up to the defect, where an import raised it."""

    report: Any = None


class AccessDeniedError(ConfigError):
    """This user may not read a path it was asked to operate on: the wrong user (a cron job
    under another account) or a mount that came back with other permissions (CLI exit 2).
    Never "nothing to do": a root that cannot be read is not an empty one."""


class OutputWriteError(StoreIOError):
    """The command's output could not be written whole: stdout, or a file it was asked to
    write (an archive, a metrics textfile), on a full disk or an I/O error. Nothing cut was
    put in place (CLI exit 3)."""


def _user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def access_denied(path: str | Path, *, action: str = "read") -> AccessDeniedError:
    """The one error for a path this process may not ``action``: it names the path, this
    user, the owner and mode of what is in the way (the path, or a directory above it that
    cannot be searched) and the fix."""
    import os

    user = _user_name(os.geteuid()) if hasattr(os, "geteuid") else "this user"
    what, owner = _what_denies(Path(path))
    if owner is None:
        return AccessDeniedError(f"permission denied: user {user} cannot {action} this path",
                                 path=path, fix=f"give {user} access (chown, chmod or "
                                                "setfacl; check how the disk is mounted)")
    return AccessDeniedError(
        f"permission denied: user {user} cannot {action} {what}", path=path,
        fix=f"run it as {owner}, or give {user} access (chown, chmod or setfacl; check how "
            "the disk is mounted)")


def _what_denies(path: Path) -> tuple[str, str | None]:
    """What keeps this user out of ``path``, in words, and its owner's name (None when
    nothing on the way can be seen)."""
    import os
    import stat

    blocked = None
    for place in (path, *path.parents):
        try:
            st = os.stat(place)
        except PermissionError:
            blocked = place
            continue
        except OSError:
            return "this path", None
        mode = f"owned by {_user_name(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"
        if blocked is None:
            kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
            return f"this {kind} ({mode})", _user_name(st.st_uid)
        return f"this path: {place} cannot be searched ({mode})", _user_name(st.st_uid)
    return "this path", None


def from_os_permission(exc: OSError) -> AccessDeniedError:
    """A PermissionError that reached the top, as ``access_denied`` of the path it names."""
    import os

    name = exc.filename
    return access_denied(os.fsdecode(name) if isinstance(name, (str, bytes)) else "?")
