"""Every file in examples/ is executed or checked, the way a user would use it.

* Python examples run end to end against locally generated tiny models (PyTorch, MLX,
  vLLM twice = a restart) or the local GenAI fake, and their printed results are checked.
* Prometheus rules/config: ``promtool check`` when installed; always a structural check
  that every ``spoolctl_*`` name is a metric defined in ``spoolctl/metrics.py``.
* Grafana: valid dashboard structure; every panel query uses defined metrics; every
  metric is on some panel.
* systemd units: ``systemd-analyze verify`` when available; cron: field syntax. The
  ``spoolctl`` command lines of units, cron and shell examples are parsed by the real CLI.
"""

from __future__ import annotations

import json
import os
import py_compile
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from testpaths import REPO_DIR

REPO = REPO_DIR
EXAMPLES = REPO / "examples"
METRIC_TOKEN = re.compile(r"\bspoolctl_[a-z0-9_]+\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _defined_metrics() -> dict[str, str]:
    from spoolctl.metrics import ALL_METRICS

    return {spec.name: spec.type for spec in ALL_METRICS}


def _undefined_names(expr: str) -> list[str]:
    """``spoolctl_*`` series in a PromQL expression that metrics.py does not define."""
    defined = _defined_metrics()
    bad = []
    for name in METRIC_TOKEN.findall(expr):
        if name in defined:
            continue
        base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if base is None or defined.get(base) != "histogram":
            bad.append(name)
    return bad


def _referenced(expr: str) -> set[str]:
    out = set()
    for name in METRIC_TOKEN.findall(expr):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in _defined_metrics():
                name = name[: -len(suffix)]
        out.add(name)
    return out


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")}
    env.update({"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING",
                "HF_HUB_OFFLINE": "1", **extra})
    return env


def _parse_spoolctl(argv: list[str]) -> None:
    """Parse a spoolctl command line with the real CLI (no execution); raises on bad usage."""
    import typer.main

    from spoolctl.cli.app import app

    assert argv and argv[0].endswith("spoolctl"), argv
    cmd, name, args, parent = typer.main.get_command(app), "spoolctl", list(argv[1:]), None
    while True:
        ctx = cmd.make_context(name, args, parent=parent)
        if not hasattr(cmd, "commands"):
            return
        # click keeps the subcommand's name apart from its arguments (protected args)
        rest = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        if not rest:
            return
        name, cmd, args = cmd.resolve_command(ctx, rest)
        parent = ctx


def _spoolctl_argv(command: str) -> list[str]:
    """The spoolctl part of a shell command line (drops flock wrappers and redirections)."""
    words = shlex.split(command, comments=True)
    start = next(i for i, w in enumerate(words) if w.endswith("spoolctl"))
    argv = []
    for word in words[start:]:
        if word.startswith((">", "<", "2>", "|")) or word in ("&&", ";", "|"):
            break
        argv.append(word)
    return argv


# -- Python examples ------------------------------------------------------------------------


def test_python_examples_compile() -> None:
    files = sorted(EXAMPLES.glob("*.py"))
    assert len(files) >= 4
    for path in files:
        py_compile.compile(str(path), doraise=True)


def _run_example(name: str, *args: str, timeout: int = 600) -> dict:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, env=_env(), timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_local_controller_report(report: dict) -> None:
    assert report["cold"]["source"] == "cold" and report["cold"]["written_tokens"] > 0
    cold_usage = report["cold"]["usage"]  # the first generate reports the cold prepare
    assert cold_usage["cache_read_tokens"] == 0
    assert cold_usage["cache_write_tokens"] == report["cold"]["cached_tokens"]
    restart = report["restart"]
    assert restart["source"] == "disk"
    assert restart["cached_tokens"] == report["cold"]["cached_tokens"]
    assert restart["usage"]["cache_read_tokens"] == restart["cached_tokens"]
    assert restart["same_tokens"] and restart["tokens"] == report["cold"]["tokens"]
    inc = report["incremental"]
    assert inc["source"] == "incremental" and inc["supersedes"]
    assert inc["reused_tokens"] == report["cold"]["cached_tokens"]
    assert 0 < inc["written_tokens"] < inc["reused_tokens"]
    assert inc["usage"]["cache_read_tokens"] == inc["reused_tokens"]
    assert inc["usage"]["cache_write_tokens"] == inc["written_tokens"]
    assert report["entries_before_close"] == 2 and report["entries_after_close"] == 0


def test_pytorch_controller_example_runs_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _check_local_controller_report(
        _run_example("pytorch_controller.py", "--root", str(tmp_path / "store")))


def test_mlx_controller_example_runs_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed on this platform")
    pytest.importorskip("transformers")
    _check_local_controller_report(
        _run_example("mlx_controller.py", "--root", str(tmp_path / "store")))


def test_genai_controller_example_runs_against_the_local_fake(tmp_path: Path) -> None:
    pytest.importorskip("google.genai")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "genai_controller.py"), "--fake",
         "--root", str(tmp_path / "store")],
        capture_output=True, text=True, env=_env(), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"^cache \S+ \(", proc.stdout, flags=re.M), proc.stdout
    assert proc.stdout.count("usage:") == 2
    assert "closed: the cache was deleted on the server" in proc.stdout


@pytest.mark.slow
@pytest.mark.extended  # test_vllm_exit runs the same generate-exit-restart in the default run
def test_vllm_offline_example_restores_after_a_restart(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    root = str(tmp_path / "store")
    args = ("--root", root, "--tiny-dir", str(tmp_path / "model"), "--single-process")
    first = _run_example("vllm_offline.py", *args)
    assert first["store_at_start"]["entries"] == 0
    assert first["results"][0]["num_cached_tokens"] == 0  # empty store: cold
    # A new process (an engine restart). The first one generated and exited at once: what
    # it computed was committed on the way out.
    second = _run_example("vllm_offline.py", *args)
    assert second["store_at_start"]["entries"] > 0
    for before, after in zip(first["results"], second["results"], strict=True):
        assert after["num_cached_tokens"] >= 256  # the shared document came from disk
        assert after["tokens"] == before["tokens"]


def test_vllm_serve_example_is_valid_shell_with_a_valid_spoolctl_call() -> None:
    path = EXAMPLES / "vllm_serve.sh"
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    # spoolctl of vLLM's environment, never whatever `spoolctl` is on PATH (issue 36.9)
    assert not re.findall(r"\$\(spoolctl ", text)
    calls = re.findall(r'\$\("\$PYTHON" -m (spoolctl [^|)]*)', text)
    assert calls
    for call in calls:
        argv = shlex.split(call.replace('"$SPOOL_ROOT"', "/srv/spool").replace(
            '"$MAX_SIZE"', "200GiB").replace('"$MODEL"', "/models/llama").replace('"$TP"', "2"))
        _parse_spoolctl(argv)
    assert "kv_load_failure_policy" in text and "spoolctl_bypass" in text


def test_python_m_spoolctl_works_without_spoolctl_on_path(tmp_path: Path) -> None:
    """What the serve example and docs/connector.md run: ``python -m spoolctl config vllm``,
    with a PATH that has no spoolctl script."""
    root = Path(os.path.realpath(tmp_path)) / "spool"
    proc = subprocess.run([sys.executable, "-m", "spoolctl", "config", "vllm", "--root",
                           str(root), "--max-size", "1GiB"], capture_output=True, text=True,
                          env={**os.environ, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kv_connector_extra_config"]["spoolctl_root"] == str(root)


def test_spoolctl_config_vllm_output_is_what_the_serve_example_edits(tmp_path: Path) -> None:
    from spoolctl.cli.vllm_config import kv_transfer_config

    doc = kv_transfer_config("/srv/spool", "200GiB")
    assert doc["kv_connector"] == "SpoolConnector"
    assert doc["kv_connector_extra_config"]["spoolctl_root"] == "/srv/spool"


# -- Prometheus ---------------------------------------------------------------------------


def _alerts() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((EXAMPLES / "prometheus" / "spoolctl-alerts.yml").read_text())


def test_alert_rules_are_well_formed_and_use_defined_metrics() -> None:
    doc = _alerts()
    names = []
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations",
                                 "keep_firing_for"}, rule
            names.append(rule["alert"])
            assert re.fullmatch(r"Spoolctl[A-Z][A-Za-z]+", rule["alert"])
            assert METRIC_TOKEN.search(rule["expr"]), rule["alert"]
            assert not _undefined_names(rule["expr"]), (rule["alert"],
                                                        _undefined_names(rule["expr"]))
            assert rule["labels"]["severity"] in {"info", "warning", "critical"}
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            if "for" in rule:
                assert re.fullmatch(r"\d+[smhdw]", rule["for"])
            # balanced brackets: a cheap guard against a truncated expression
            for open_, close in ("()", "[]", "{}"):
                assert rule["expr"].count(open_) == rule["expr"].count(close), rule["alert"]
    assert len(names) == len(set(names))
    # the four situations the issue asks for
    required = {"SpoolctlStoreNearMax", "SpoolctlQuarantineGrowing", "SpoolctlScrubStalled",
                "SpoolctlLoadErrors"}
    assert required <= set(names)


def test_the_checker_rejects_an_undefined_metric() -> None:
    assert _undefined_names("rate(spoolctl_lookups_total[5m]) > 0") == []
    assert _undefined_names("histogram_quantile(0.9, spoolctl_restore_seconds_bucket)") == []
    assert _undefined_names("spoolctl_store_entries_bucket") == ["spoolctl_store_entries_bucket"]
    assert _undefined_names("spoolctl_no_such_metric > 1") == ["spoolctl_no_such_metric"]


def test_prometheus_config_points_at_the_rules() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((EXAMPLES / "prometheus" / "prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        assert (EXAMPLES / "prometheus" / rule_file).is_file()
    assert {job["job_name"] for job in config["scrape_configs"]} >= {"vllm", "node"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_rules_and_config() -> None:
    subprocess.run(["promtool", "check", "rules",
                    str(EXAMPLES / "prometheus" / "spoolctl-alerts.yml")], check=True)
    subprocess.run(["promtool", "check", "config",
                    str(EXAMPLES / "prometheus" / "prometheus.yml")], check=True)


# -- Grafana --------------------------------------------------------------------------------


def test_grafana_dashboard_is_valid_and_covers_every_metric() -> None:
    dash = json.loads((EXAMPLES / "grafana" / "spoolctl-dashboard.json").read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    ids, referenced = set(), set()
    for panel in dash["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["targets"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            expr = target["expr"]
            assert not _undefined_names(expr), (panel["title"], _undefined_names(expr))
            assert "$instance" in expr, panel["title"]
            referenced |= _referenced(expr)
    assert not set(_defined_metrics()) - referenced, set(_defined_metrics()) - referenced


# -- systemd and cron -----------------------------------------------------------------------


def _units() -> list[Path]:
    return sorted((EXAMPLES / "systemd").glob("spoolctl-*.*"))


def _unit_sections(path: Path) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None and key and _, f"{path.name}: bad line {raw!r}"
        current[key.strip()] = value.strip()
    return sections


def test_systemd_units_pair_up_and_run_valid_spoolctl_commands() -> None:
    units = _units()
    services = {p.stem for p in units if p.suffix == ".service"}
    timers = {p.stem for p in units if p.suffix == ".timer"}
    assert services == timers == {"spoolctl-clean", "spoolctl-scrub"}
    for path in units:
        sections = _unit_sections(path)
        if path.suffix == ".service":
            assert sections["Service"]["Type"] == "oneshot"
            argv = shlex.split(sections["Service"]["ExecStart"])
            assert os.path.isabs(argv[0])
            _parse_spoolctl(argv)
            assert argv[1] in ("clean", "scrub")
            assert "--yes" in argv or argv[1] != "clean"  # non-interactive
        else:
            assert sections["Install"]["WantedBy"] == "timers.target"
            assert "OnUnitActiveSec" in sections["Timer"] or "OnCalendar" in sections["Timer"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not available")
def test_systemd_analyze_verify_accepts_the_units(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("spoolctl")
    if not exe.exists():
        pytest.skip("the spoolctl console script is not installed next to this interpreter")
    import grp
    import pwd

    user = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    for path in _units():  # point ExecStart/User at what exists on this machine
        text = path.read_text().replace("/usr/local/bin/spoolctl", str(exe))
        text = re.sub(r"^User=.*$", f"User={user}", text, flags=re.M)
        text = re.sub(r"^Group=.*$", f"Group={group}", text, flags=re.M)
        (tmp_path / path.name).write_text(text)
    files = [str(tmp_path / p.name) for p in _units()]
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *files],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"})
    # verify exits 0 on unknown keys/bad values (it only logs them): any line naming one of
    # our files is a finding.
    findings = [line for line in (proc.stdout + proc.stderr).splitlines()
                if any(Path(f).name in line for f in files)]
    assert proc.returncode == 0 and not findings, proc.stdout + proc.stderr


_CRON_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))


def _cron_field_ok(field: str, low: int, high: int) -> bool:
    for part in field.split(","):
        base, _, step = part.partition("/")
        if step and not (step.isdigit() and int(step) > 0):
            return False
        if base == "*":
            continue
        lo, _, hi = base.partition("-")
        values = [lo, hi] if hi else [lo]
        if not all(v.isdigit() and low <= int(v) <= high for v in values):
            return False
    return True


def test_cron_file_lines_are_valid() -> None:
    jobs = 0
    for raw in (EXAMPLES / "cron" / "spoolctl").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if re.match(r"^[A-Z_]+=", line):
            continue  # environment assignment
        fields = line.split(None, 6)
        assert len(fields) == 7, f"cron.d lines need 5 time fields, a user and a command: {raw}"
        for field, (low, high) in zip(fields[:5], _CRON_RANGES, strict=True):
            assert _cron_field_ok(field, low, high), f"bad cron field {field!r} in {raw!r}"
        assert "%" not in fields[6], "an unescaped % ends a cron command"
        _parse_spoolctl(_spoolctl_argv(fields[6]))
        jobs += 1
    assert jobs == 4  # clean, scrub, metrics, the daily lifecycle clean


def test_spoolctl_command_line_parser_rejects_bad_usage() -> None:
    _parse_spoolctl(["spoolctl", "clean", "--yes"])
    _parse_spoolctl(["spoolctl", "quarantine", "purge", "--older-than", "7d", "--yes"])
    for bad in (["spoolctl", "clean", "--no-such-option"], ["spoolctl", "no-such-command"],
                ["spoolctl", "quarantine", "purge", "--bogus"]):
        # typer vendors click, so match the exception by name rather than by class
        with pytest.raises(Exception) as info:
            _parse_spoolctl(bad)
        assert "UsageError" in {c.__name__ for c in type(info.value).__mro__}, bad
