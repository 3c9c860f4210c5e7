"""What a default (INFO/WARNING) controller log line may say about an exception.

One function for every controller: never an entry id, an
object digest or a store path -- entry ids and digests are derived from the prompt,
and logs travel further than the 0700 store (docs/SECURITY.md). A SpoolError is
rendered by its ``message`` (its ``path`` and ``fix`` are left out), an OSError by
its ``strerror`` (its file names are left out), anything else by its clipped text;
in all of them a run of 16 or more hex digits (an id or a digest some message
carried) is replaced by ``<id>``. Ids belong in DEBUG lines only.
"""

from __future__ import annotations

import re

from spoolctl.errors import SpoolError

MAX_REASON = 200
_HEX_RUN = re.compile(r"[0-9a-fA-F]{16,}")


def reason(exc: BaseException) -> str:
    """The part of ``exc`` a WARNING line may carry."""
    if isinstance(exc, SpoolError):
        text = exc.message
    elif isinstance(exc, OSError) and exc.strerror:
        text = f"{type(exc).__name__}: {exc.strerror}"
    else:
        text = str(exc)
    return _HEX_RUN.sub("<id>", text)[:MAX_REASON]
