"""What a drive set does differently with one root than with several, decided once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrivePolicy:
    """The rules of a rank's drive set, chosen from its configured size (``for_roots``).

    One root keeps the behaviour its measurements were taken with (read deadlines, floors,
    the FUSE proof): the store is its own failure domain, so nothing is rerouted or
    relocated, and a down store keeps its inventory while lookups skip it.
    """

    identify: bool  # each drive carries a marker and an id; the handshake lists them
    mistakes_refused: bool  # a configuration mistake refuses that drive, not the start
    inventory_follows_health: bool  # a down drive's chunks leave the rank's inventory
    restores_locate: bool  # each chunk is read from the drive the inventory names
    keepers_scan_at_start: bool  # the first scans run on the keepers, waited bounded
    per_drive_bookkeeping: bool  # the inventory keeps per-drive totals and state

    @classmethod
    def for_roots(cls, count: int) -> DrivePolicy:
        return SEVERAL if count > 1 else ONE_ROOT


ONE_ROOT = DrivePolicy(identify=False, mistakes_refused=False, inventory_follows_health=False,
                       restores_locate=False, keepers_scan_at_start=False,
                       per_drive_bookkeeping=False)
SEVERAL = DrivePolicy(identify=True, mistakes_refused=True, inventory_follows_health=True,
                      restores_locate=True, keepers_scan_at_start=True,
                      per_drive_bookkeeping=True)
