"""What a worker equips each of its drives with, from the connector's settings."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from spoolctl.store import Store

from ..deployment.settings import ConnectorSettings
from ..drives.driveset import DriveTools

if TYPE_CHECKING:
    from spoolctl.store import BackgroundMaintainer

    from ..deployment.write_budget import WriteLedger

log = logging.getLogger("spoolctl.connector")


def tools_for(settings: ConnectorSettings) -> DriveTools:
    """Each drive's guard deadlines, write ledger and background maintainer."""
    return DriveTools(settings.lookup_deadline, settings.probe_interval,
                      ledger=lambda store: ledger_for(settings, store),
                      maintainer=lambda store: maintainer_for(settings, store))


def ledger_for(settings: ConnectorSettings, store: Store) -> WriteLedger | None:
    """``store``'s write ledger with ``spoolctl_write_budget``, else None."""
    if settings.write_budget is None:
        return None
    from ..deployment.write_budget import WriteLedger, ledger_path

    return WriteLedger(ledger_path(store.root), settings.write_budget)


def maintainer_for(settings: ConnectorSettings, store: Store) -> BackgroundMaintainer | None:
    """The store's background maintainer, started (None: disabled or not started)."""
    if settings.scrub_rate <= 0:
        return None
    from spoolctl.store import BackgroundMaintainer

    try:
        maintainer = BackgroundMaintainer(
            store, scrub_rate_bytes=settings.scrub_rate,
            interval_s=settings.maintenance_interval, role="vllm-worker",
            enforce_capacity=False)  # RankHoldings evicts (withdraw, then delete)
        maintainer.start()
        return maintainer
    except Exception as exc:  # maintenance is an optimisation; never block serving
        log.warning("spoolctl: background maintenance not started: %s", exc)
        return None
