"""The vLLM connector on several drives, in-process (issue 32 item 4, decision 2714):
``spoolctl_roots`` and its refusals, and drive stores opened without ever waiting on a
disk that hangs at start (decision 2720's open, bounded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spoolctl.connector.deployment import settings as settings_mod
from spoolctl.connector.deployment.settings import MAX_ROOTS, parse_settings
from spoolctl.errors import ConfigError
from spoolctl.store import Store


def _dirs(tmp_path: Path, n: int) -> list[str]:
    base = Path(os.path.realpath(tmp_path))
    return [str(base / f"nvme{i}" / "spool") for i in range(n)]


@pytest.fixture
def several(monkeypatch):
    """The connector takes several drive roots (decision 2714)."""
    monkeypatch.setattr(settings_mod, "SEVERAL_DRIVES", True)


def test_spoolctl_roots_and_a_colon_list_in_spoolctl_root_name_the_drives(
        tmp_path: Path, several) -> None:
    roots = _dirs(tmp_path, 3)
    got = parse_settings({"spoolctl_roots": roots}, block_size=32, env={})
    assert got.roots == tuple(roots) and got.root == roots[0]
    # The variable, read as the CLI reads it (decision 2712), only when no key is given.
    got = parse_settings({}, block_size=32, env={"SPOOLCTL_ROOT": ":".join(roots)})
    assert got.roots == tuple(roots)
    assert parse_settings({"spoolctl_root": roots[1]}, block_size=32,
                          env={"SPOOLCTL_ROOT": ":".join(roots)}).roots == (roots[1],)
    # One root: exactly today's settings.
    one = parse_settings({"spoolctl_root": roots[0]}, block_size=32, env={})
    assert one.roots == (roots[0],) and one.root == roots[0]


@pytest.mark.parametrize(("extra", "env", "says", "fix"), [
    ({"spoolctl_root": "/a", "spoolctl_roots": ["/a", "/b"]}, {}, "both set", "keep one"),
    ({"spoolctl_roots": []}, {}, "is empty", "at least one"),
    ({"spoolctl_roots": "/a:/b"}, {}, "must be a list", "spoolctl_roots"),
    ({"spoolctl_roots": ["/a", "/b/../a"]}, {}, "one root twice", "once"),
    ({"spoolctl_roots": ["/a", "b"]}, {}, "absolute paths", "full path"),
    ({"spoolctl_roots": ["/a", "/r{rank}"]}, {}, "rank placeholders", "one base directory"),
    ({}, {"SPOOLCTL_ROOT": "/a::/b"}, "empty root", "single ':'"),
    ({"spoolctl_roots": [f"/d{i}" for i in range(MAX_ROOTS + 1)]}, {}, "at most 64",
     "at most 64"),
])
def test_each_refused_list_of_roots_is_one_config_error_line_naming_the_fix(
        several, extra, env, says, fix) -> None:
    with pytest.raises(ConfigError, match=says) as exc:
        parse_settings(extra, block_size=32, env=env)
    assert fix in (exc.value.fix or "") and "\n" not in str(exc.value)


def test_a_store_given_as_a_drive_root_is_refused(tmp_path: Path, several) -> None:
    roots = _dirs(tmp_path, 2)
    Store.open(roots[1], create=True).close()
    with pytest.raises(ConfigError, match="spoolctl_roots is a single store") as exc:
        parse_settings({"spoolctl_roots": roots}, block_size=32, env={})
    assert exc.value.path == roots[1] and "spoolctl_roots" in (exc.value.fix or "")


def test_several_roots_on_one_filesystem_start_with_one_warning(tmp_path: Path) -> None:
    from spoolctl.connector.deployment.preflight import check_roots

    roots = _dirs(tmp_path, 2)
    warnings = check_roots(roots, bound_s=5)
    assert [w for w in warnings if "one filesystem" in w] == [
        f"spoolctl roots {roots[0]} and {roots[1]} are on one filesystem: one failure "
        "domain, not two drives"]
    assert not [w for w in check_roots(roots[:1], bound_s=5) if "one filesystem" in w]
