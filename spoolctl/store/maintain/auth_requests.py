"""Authenticate one entry now, directly or through the store's live owner.

``authenticate`` re-reads and verifies an entry in this process and answers what that
proves:

* ``authenticated``: the tag is valid under the store's tag key and every object matched
  its digest: committed by a key holder, intact (``proves = "origin"``);
* ``verified``: no tag key; every object matched (``proves = "integrity"`` only: anyone who
  can write the store could have written a consistent entry);
* ``absent`` or ``quarantined`` (any failure, a bad tag included, quarantines the entry).

While a live worker holds the owner lease, ``submit`` queues the request durably in
``state/auth_requests.sqlite3``, the worker answers it (``process_pending``) and ``wait``
polls for the receipt. A damaged queue is quarantined and started afresh.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ...errors import CorruptionError, InvalidIdError, NotFoundError, QuarantineReason
from ..disk.sqlite_files import SUFFIXES, connect_private, is_damaged, sqlite_error
from ..format.keys import validate_entry_id

log = logging.getLogger("spoolctl.store")

if TYPE_CHECKING:
    from ..store import Store

AUTH_DB = "auth_requests.sqlite3"
Result = Literal["authenticated", "verified", "absent", "quarantined"]
RESULTS: tuple[str, ...] = ("authenticated", "verified", "absent", "quarantined")
# What a healthy answer proves; absent/quarantined prove nothing.
PROVES = {"authenticated": "origin", "verified": "integrity"}
# Receipts older than this are dropped when new requests are processed.
RECEIPT_TTL = 7 * 86400.0

_DDL = """
CREATE TABLE IF NOT EXISTS requests(
    request_id INTEGER PRIMARY KEY AUTOINCREMENT,
    entry_id TEXT NOT NULL,
    created REAL NOT NULL,
    requester_pid INTEGER NOT NULL,
    result TEXT CHECK (result IS NULL OR result IN ('authenticated', 'verified', 'absent',
                                                    'quarantined')),
    reason TEXT,
    detail TEXT,
    answered REAL,
    answered_by INTEGER
);
CREATE INDEX IF NOT EXISTS requests_pending ON requests(result, request_id);
"""
# The queue as spoolctl created it before ``verified`` existed (verbatim: the schema check
# compares SQLite's stored text); ``_allow_verified`` migrates it, rows kept.
_DDL_BEFORE_VERIFIED = """
CREATE TABLE IF NOT EXISTS requests(
    request_id INTEGER PRIMARY KEY AUTOINCREMENT,
    entry_id TEXT NOT NULL,
    created REAL NOT NULL,
    requester_pid INTEGER NOT NULL,
    result TEXT CHECK (result IS NULL OR result IN ('authenticated', 'absent', 'quarantined')),
    reason TEXT,
    detail TEXT,
    answered REAL,
    answered_by INTEGER
);
CREATE INDEX IF NOT EXISTS requests_pending ON requests(result, request_id);
"""


@dataclass(frozen=True)
class AuthResult:
    """The answer for one entry: result, quarantine reason (if any), a detail line."""

    entry_id: str
    result: Result
    reason: str | None = None
    detail: str = ""
    via: Literal["direct", "owner"] = "direct"
    request_id: int | None = None

    @property
    def proves(self) -> str | None:
        """``origin`` (tag and digests), ``integrity`` (digests only) or None."""
        return PROVES.get(self.result)

    @property
    def healthy(self) -> bool:
        return self.result in PROVES

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "proves": self.proves}


def authenticate(store: Store, entry_id: str) -> AuthResult:
    """Verify ``entry_id`` now in this process (see module docstring)."""
    validate_entry_id(entry_id)
    try:
        manifest = store.verify(entry_id)
    except NotFoundError:
        # Already quarantined earlier (by a read or a scrub) is not the same as never there.
        for item in store.quarantine_items():
            if item.entry_id == entry_id:
                return AuthResult(entry_id, "quarantined", reason=item.reason,
                                  detail=f"in quarantine item {item.item_id}")
        return AuthResult(entry_id, "absent", detail="no such entry in the store")
    except CorruptionError as exc:
        return AuthResult(entry_id, "quarantined", reason=exc.reason.value, detail=exc.message)
    detail = f"{len(manifest.objects)} objects, {manifest.payload_bytes} bytes verified"
    if store.tag_key is None:
        return AuthResult(entry_id, "verified", detail=detail + "; digests only: no tag key "
                          "configured, so the writer is not authenticated")
    return AuthResult(entry_id, "authenticated",
                      detail=detail + f"; tag valid under key {store.tag_key.key_id}")


class AuthQueue:
    """The durable request queue of one store (``state/auth_requests.sqlite3``)."""

    def __init__(self, path: Path):
        self.path = path
        self._db = connect_private(path, ddl=_DDL, synchronous="FULL",
                                   earlier_ddl=(_DDL_BEFORE_VERIFIED,))
        _allow_verified(self._db)

    @classmethod
    def of(cls, store: Store) -> AuthQueue:
        """The store's queue; a damaged one is quarantined and replaced by an empty one."""
        path = store.layout.state / AUTH_DB
        store._writable("queueing an authentication request")
        try:
            return cls(path)
        except sqlite3.DatabaseError as exc:
            if not is_damaged(exc):
                raise sqlite_error(exc, path, "request queue") from None
            why = f"request queue unreadable: {exc}"
        store.quarantine.add(QuarantineReason.AUTH_QUEUE, why,
                             [(path.with_name(AUTH_DB + s), "auth_queue") for s in SUFFIXES])
        log.warning("request queue quarantined and reset: %s", why)
        return cls(path)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> AuthQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, entry_id: str) -> int:
        """Queue a request durably; return its id."""
        validate_entry_id(entry_id)
        cur = self._db.execute(
            "INSERT INTO requests(entry_id, created, requester_pid) VALUES (?, ?, ?)",
            (entry_id, time.time(), os.getpid()))
        request_id = cur.lastrowid
        assert request_id is not None  # an INSERT always sets it
        return request_id

    def receipt(self, request_id: int) -> AuthResult | None:
        row = self._db.execute(
            "SELECT entry_id, result, reason, detail FROM requests WHERE request_id=? "
            "AND result IS NOT NULL", (request_id,)).fetchone()
        if row is None:
            return None
        return AuthResult(row[0], row[1], row[2], row[3] or "", via="owner", request_id=request_id)

    def wait(self, request_id: int, timeout: float, *, poll: float = 0.1) -> AuthResult | None:
        """Poll for the receipt of ``request_id``; None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.receipt(request_id)
            if got is not None or time.monotonic() >= deadline:
                return got
            time.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))

    def pending(self, limit: int = 100) -> list[tuple[int, str]]:
        return [(int(r[0]), str(r[1])) for r in self._db.execute(
            "SELECT request_id, entry_id FROM requests WHERE result IS NULL "
            "ORDER BY request_id LIMIT ?", (limit,))]

    def answer(self, request_id: int, result: AuthResult) -> None:
        self._db.execute(
            "UPDATE requests SET result=?, reason=?, detail=?, answered=?, answered_by=? "
            "WHERE request_id=? AND result IS NULL",
            (result.result, result.reason, result.detail[:500], time.time(), os.getpid(),
             request_id))

    def prune(self, now: float | None = None) -> None:
        cutoff = (now or time.time()) - RECEIPT_TTL
        self._db.execute("DELETE FROM requests WHERE result IS NOT NULL AND answered < ?",
                         (cutoff,))


def _allow_verified(db: sqlite3.Connection) -> None:
    """A queue created before ``verified`` existed refuses that result (its CHECK lists
    three): rebuild the table with today's DDL, rows kept, in one transaction."""
    row = db.execute("SELECT sql FROM sqlite_master WHERE type='table' AND name='requests'"
                     ).fetchone()
    if row is None or "'verified'" in (row[0] or ""):
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("DROP INDEX IF EXISTS requests_pending")
        db.execute("ALTER TABLE requests RENAME TO requests_before_verified")
        for stmt in _DDL.split(";"):
            if stmt.strip():
                db.execute(stmt)
        db.execute("INSERT INTO requests SELECT * FROM requests_before_verified")
        db.execute("DROP TABLE requests_before_verified")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def process_pending(store: Store, *, limit: int = 100) -> int:
    """Answer up to ``limit`` queued requests (the owner's job); return how many. A
    malformed stored id is answered ``absent`` rather than left to block the queue."""
    if not (store.layout.state / AUTH_DB).exists():
        return 0  # nobody ever queued anything: do not create the file
    with AuthQueue.of(store) as queue:
        done = 0
        for request_id, entry_id in queue.pending(limit):
            try:
                result = authenticate(store, entry_id)
            except InvalidIdError:
                result = AuthResult(entry_id, "absent", detail="malformed entry id")
            queue.answer(request_id, result)
            done += 1
        if done:
            queue.prune()
        return done
