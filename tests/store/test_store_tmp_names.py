"""Issue 28 item 8: temp-file names are made and read back in one place (``fsio.tmp_name`` /
``fsio.tmp_writer``); cleanup (gc) and the unfinished-init check (root) used their own
patterns. gc's accepted any number of digits, so a name whose pid field no process can
have crashed ``clean --tmp`` (``os.kill`` raised OverflowError)."""

from __future__ import annotations

import os
import time

import pytest

from spoolctl.store import Store
from spoolctl.store.disk.fsio import tmp_name, tmp_writer

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

HEX = "0123456789abcdef"


def test_the_parser_reads_back_what_tmp_name_makes_and_nothing_else() -> None:
    assert tmp_writer(tmp_name()) == os.getpid()
    assert tmp_writer(f"4194304-{HEX}.part") == 4194304
    for odd in (f"99999999999-{HEX}.part", f"2147483648-{HEX}.part", f"0-{HEX}.part",
                f"١٢-{HEX}.part", f"12-{HEX}.part\n", f"12-{HEX.upper()}.part", "stray.part",
                f".odirect-probe-12-{HEX}.part"):
        assert tmp_writer(odd) is None, odd


def test_clean_tmp_survives_a_name_with_an_impossible_pid(store: Store) -> None:
    """Such a file is not known to be abandoned: kept like any file of a live writer, and
    removed once it is older than the live-writer grace (an hour)."""
    old = store.layout.tmp / f"99999999999-{HEX}.part"
    young = store.layout.tmp / f"99999999999-{HEX[::-1]}.part"
    for path in (old, young):
        path.write_bytes(b"x")
    then = time.time() - 7200
    os.utime(old, (then, then))
    report = store.clean_tmp(min_age=0)
    assert report.files == 1 and not old.exists() and young.exists()
