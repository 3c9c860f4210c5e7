"""``spoolctl keys ls|rotate|revoke|retire``: the keys of an encrypted store, on one store or
on every rank store under a vLLM root.

A tenant is named by its opaque id (``--tenant``, as ``keys ls`` shows it) or by its name --
a secret (vLLM: the cache_salt) -- read from a file, stdin or an environment variable, never
from the command line, where every local user's process listing and the shell's history
would show it. Tenants are shown only by their opaque id; no key material is ever printed."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.store import ConfigError

from . import render
from .common import EXIT_OK, DeploymentOption, JsonOption, RankOption, RootOption, text
from .fanout import finish, run_on_targets
from .targets import StoreTarget, resolve_targets

if TYPE_CHECKING:
    from spoolctl.store import Store

commands = typer.Typer()
keys_app = typer.Typer(
    name="keys", help="Encryption keys of a store: list, rotate, revoke (crypto-erase), retire.",
    no_args_is_help=True, rich_markup_mode="rich")
commands.add_typer(keys_app, name="keys")

TenantOption = Annotated[str | None, typer.Option(
    "--tenant", metavar="<tenant id>", help="The tenant's id, as `spoolctl keys ls` shows it "
    "(or `default`, the unsalted requests' tenant). Its name (vLLM: its cache_salt) is a "
    "secret: it is refused here; use --tenant-file or --tenant-env.")]
TenantFileOption = Annotated[str | None, typer.Option(
    "--tenant-file", metavar="<file|->", help="Read the tenant's name (vLLM: its cache_salt) "
    "from this file, or from stdin with -.")]
TenantEnvOption = Annotated[str | None, typer.Option(
    "--tenant-env", metavar="<variable>", help="Read the tenant's name (vLLM: its "
    "cache_salt) from this environment variable.")]
# A tenant's name is at most this long (``TenantNames.tenant_id``); one line ending is allowed.
MAX_TENANT_NAME = 1024
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Only report.")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")]


@keys_app.command("ls")
def keys_ls(root: RootOption = None, rank: RankOption = None,
            deployment: DeploymentOption = None, json_output: JsonOption = False) -> None:
    """Whether the store is encrypted, the master key's id, and per tenant id its key
    versions and entries per version.

    Example: [bold]spoolctl keys ls --json[/bold]
    """
    from spoolctl.store import key_usage
    targets = resolve_targets(root, rank=rank, deployment=deployment)

    def job(store: Store, _t: StoreTarget) -> tuple[dict[str, Any], int]:
        return key_usage(store), EXIT_OK
    finish(run_on_targets(targets, job, json_output=json_output, view=_usage_view,
                          read_only_ok=True))


def _usage_view(doc: dict[str, Any]) -> list[Any]:
    from rich.table import Table
    if not doc["encrypted"]:
        return [text("not encrypted (no master key configured, no encrypted entries)")]
    mk = doc["master_key"]
    head = "master key: not configured (encrypted entries are misses)" if mk is None else \
        f"master key {mk['key_id']}" + ("" if mk["matches_keyring"] else
                                        ": NOT the key of this store's keyring")
    table = Table("tenant id", "current", "version", "key", "origin", "entries", "bytes")
    for t in doc["tenants"]:
        blank = {"version": "revoked" if t.get("revoked") else "-", "key": "-", "entries": 0,
                 "bytes": 0}
        for v in t["versions"] or [blank]:
            table.add_row(t["tenant_id"], str(t["current"] or "-"), str(v["version"]), v["key"],
                          v.get("origin", "-"), str(v["entries"]), render.size(v["bytes"]))
    return [text(head), table]


def _change_view(doc: dict[str, Any]) -> str:
    verb = {"rotate": "new version", "revoke": "erased", "retire": "erased"}[doc["action"]]
    lines = [f"{'would: ' if doc['dry_run'] else ''}{doc['action']}"]
    for t in doc["tenants"]:
        lines.append(f"  tenant {t['tenant_id']}: {verb} {t['versions'] or 'none'}")
    if doc["action"] != "rotate":
        lines.append(f"  released {render.count(doc['released_entries'], 'entry', 'entries')}, "
                     f"{render.size(doc['released_bytes'])} (`spoolctl clean` reclaims them)")
    return "\n".join(lines)


class TenantArg:
    """The tenant a command names: an id from ``--tenant``, checked against each store
    (``tenant_from_argument``), or a name read from a file, stdin or the environment."""

    def __init__(self, given: str | None, file: str | None, env: str | None):
        if sum(x is not None for x in (given, file, env)) > 1:
            raise ConfigError("--tenant, --tenant-file and --tenant-env name the same tenant",
                              fix="give one of them")
        self.given = given
        self.name = _read_name(file) if file is not None else \
            _env_name(env) if env is not None else None

    @property
    def empty(self) -> bool:
        return self.given is None and self.name is None

    def resolve(self, store: Store) -> Any:
        from spoolctl.store import tenant_from_argument
        if self.given is not None:
            return tenant_from_argument(store, self.given)
        return self.name


def _read_name(file: str) -> str:
    where = "stdin" if file == "-" else file
    try:
        if file == "-":
            raw = sys.stdin.buffer.read(MAX_TENANT_NAME + 3)
        else:
            with Path(file).expanduser().open("rb") as f:
                raw = f.read(MAX_TENANT_NAME + 3)
    except OSError as exc:
        raise ConfigError(f"cannot read the tenant's name: {os.strerror(exc.errno or 0)}",
                          path=where, fix="pass a readable file with the name") from None
    return _checked_name(raw.decode("utf-8", "replace"), f"--tenant-file {where}")


def _env_name(variable: str) -> str:
    value = os.environ.get(variable)
    if not value:
        raise ConfigError(f"--tenant-env: the variable {variable[:80]!r} is not set",
                          fix="export the tenant's name in it, or use --tenant-file")
    return _checked_name(value, f"--tenant-env {variable[:80]}")


def _checked_name(raw: str, where: str) -> str:
    name = raw[:-2] if raw.endswith("\r\n") else raw[:-1] if raw.endswith("\n") else raw
    if not name or len(name) > MAX_TENANT_NAME or "\n" in name:
        raise ConfigError(f"{where}: a tenant's name is one line of 1 to {MAX_TENANT_NAME} "
                          "characters", fix="write the name alone (a final newline is fine)")
    return name


def _run(action: str, root: Any, rank: Any, deployment: Any, json_output: bool,
         call: Any) -> None:
    targets = resolve_targets(root, rank=rank, deployment=deployment)

    def job(store: Store, _t: StoreTarget) -> tuple[dict[str, Any], int]:
        return call(store).to_json(), EXIT_OK
    finish(run_on_targets(targets, job, json_output=json_output, view=_change_view))


@keys_app.command("rotate")
def keys_rotate(tenant: TenantOption = None, tenant_file: TenantFileOption = None,
                tenant_env: TenantEnvOption = None, dry_run: DryRunOption = False,
                root: RootOption = None, rank: RankOption = None,
                deployment: DeploymentOption = None, json_output: JsonOption = False) -> None:
    """Start a new key version (of one tenant, or of every tenant): new entries use it, older
    versions stay readable until `spoolctl keys retire`.

    Example: [bold]spoolctl keys rotate --tenant 3f2a9c0d1e4b5a69[/bold]
    """
    from spoolctl.store import rotate_keys
    who = TenantArg(tenant, tenant_file, tenant_env)
    _run("rotate", root, rank, deployment, json_output,
         lambda s: rotate_keys(s, who.resolve(s), dry_run=dry_run))


@keys_app.command("revoke")
def keys_revoke(tenant: TenantOption = None, tenant_file: TenantFileOption = None,
                tenant_env: TenantEnvOption = None,
                dry_run: DryRunOption = False, yes: YesOption = False,
                root: RootOption = None, rank: RankOption = None,
                deployment: DeploymentOption = None, json_output: JsonOption = False) -> None:
    """Crypto-erase a tenant: its keys are deleted, so none of its entries can be read again
    (each is a miss at once); `spoolctl clean` reclaims their bytes.

    Example: [bold]spoolctl keys revoke --tenant-file /run/secrets/acme-salt --yes[/bold]
    """
    from spoolctl.store import revoke_tenant
    who = TenantArg(tenant, tenant_file, tenant_env)
    if who.empty:
        raise ConfigError("keys revoke needs the tenant", fix="give --tenant ID (`spoolctl "
                          "keys ls`), --tenant-file PATH|- or --tenant-env VAR")
    _confirm(yes, dry_run, "keys revoke")
    _run("revoke", root, rank, deployment, json_output,
         lambda s: revoke_tenant(s, who.resolve(s), dry_run=dry_run))


@keys_app.command("retire")
def keys_retire(tenant: TenantOption = None, tenant_file: TenantFileOption = None,
                tenant_env: TenantEnvOption = None, dry_run: DryRunOption = False,
                yes: YesOption = False, root: RootOption = None, rank: RankOption = None,
                deployment: DeploymentOption = None, json_output: JsonOption = False) -> None:
    """Erase every key version older than the current one (of one tenant, or of every
    tenant); the entries written under them become misses and `spoolctl clean` reclaims them.

    Example: [bold]spoolctl keys retire --tenant 3f2a9c0d1e4b5a69 --yes[/bold]
    """
    from spoolctl.store import retire_keys
    who = TenantArg(tenant, tenant_file, tenant_env)
    _confirm(yes, dry_run, "keys retire")
    _run("retire", root, rank, deployment, json_output,
         lambda s: retire_keys(s, who.resolve(s), dry_run=dry_run))


def _confirm(yes: bool, dry_run: bool, what: str) -> None:
    if render.require_yes(yes, dry_run, what) and not typer.confirm(
            f"{what}: the keys are erased for good. Go on?", default=False):
        raise typer.Exit(EXIT_OK)
