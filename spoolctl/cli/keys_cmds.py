"""``spoolctl keys ls|rotate|revoke|retire``: the keys of an encrypted store (decision 2800),
on one store or on every rank store under a vLLM root. Tenants are named on the command line
(``--tenant``) and shown only by their opaque id; no key material is ever printed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

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
    "--tenant", help="The tenant's name (vLLM: its cache_salt; `default` for unsalted "
    "requests). Shown only as its opaque id.")]
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


def _run(action: str, root: Any, rank: Any, deployment: Any, json_output: bool,
         call: Any) -> None:
    targets = resolve_targets(root, rank=rank, deployment=deployment)

    def job(store: Store, _t: StoreTarget) -> tuple[dict[str, Any], int]:
        return call(store).to_json(), EXIT_OK
    finish(run_on_targets(targets, job, json_output=json_output, view=_change_view))


@keys_app.command("rotate")
def keys_rotate(tenant: TenantOption = None, dry_run: DryRunOption = False,
                root: RootOption = None, rank: RankOption = None,
                deployment: DeploymentOption = None, json_output: JsonOption = False) -> None:
    """Start a new key version (of --tenant, or of every tenant): new entries use it, older
    versions stay readable until `spoolctl keys retire`.

    Example: [bold]spoolctl keys rotate --tenant acme[/bold]
    """
    from spoolctl.store import rotate_keys
    _run("rotate", root, rank, deployment, json_output,
         lambda s: rotate_keys(s, tenant, dry_run=dry_run))


@keys_app.command("revoke")
def keys_revoke(tenant: Annotated[str, typer.Option(
                    "--tenant", help="The tenant whose every key is erased.")],
                dry_run: DryRunOption = False, yes: YesOption = False,
                root: RootOption = None, rank: RankOption = None,
                deployment: DeploymentOption = None, json_output: JsonOption = False) -> None:
    """Crypto-erase a tenant: its keys are deleted, so none of its entries can be read again
    (each is a miss at once); `spoolctl clean` reclaims their bytes.

    Example: [bold]spoolctl keys revoke --tenant acme --yes[/bold]
    """
    from spoolctl.store import revoke_tenant
    _confirm(yes, dry_run, "keys revoke")
    _run("revoke", root, rank, deployment, json_output,
         lambda s: revoke_tenant(s, tenant, dry_run=dry_run))


@keys_app.command("retire")
def keys_retire(tenant: TenantOption = None, dry_run: DryRunOption = False,
                yes: YesOption = False, root: RootOption = None, rank: RankOption = None,
                deployment: DeploymentOption = None, json_output: JsonOption = False) -> None:
    """Erase every key version older than the current one (of --tenant, or of every tenant);
    the entries written under them become misses and `spoolctl clean` reclaims them.

    Example: [bold]spoolctl keys retire --tenant acme --yes[/bold]
    """
    from spoolctl.store import retire_keys
    _confirm(yes, dry_run, "keys retire")
    _run("retire", root, rank, deployment, json_output,
         lambda s: retire_keys(s, tenant, dry_run=dry_run))


def _confirm(yes: bool, dry_run: bool, what: str) -> None:
    if render.require_yes(yes, dry_run, what) and not typer.confirm(
            f"{what}: the keys are erased for good. Go on?", default=False):
        raise typer.Exit(EXIT_OK)
