"""A release's outlet Assets carry its guarantee: the extra of the asset event it emits.

Airflow 3 records an asset event for each outlet of a task that succeeds, with the extra
the task put in ``context["outlet_events"][asset].extra``; a DAG scheduled on the asset
reads it from ``inlet_events`` (or ``triggering_asset_events``). The release puts its
:class:`~dp_budget_provider.ledger.ReleaseGuarantee` there under one key, after the
callable has run, so nothing the callable wrote under that key survives. A task that
fails or is skipped emits no event, so an event always means a release was made.

Only Assets (and references to them) are release outlets. An ``AssetAlias`` gets its
events from code calling ``add`` at run time, which the release does not control: an
alias outlet could emit an asset event that carries no guarantee, so it is refused
before anything is reserved.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from airflow.sdk import Asset, AssetAlias
from airflow.sdk.definitions.asset import AssetRef

from dp_budget_provider.ledger import ReleaseGuarantee

#: The key of the guarantee in an outlet asset event's extra.
GUARANTEE_EXTRA_KEY = "dp_guarantee"


def release_outlets(outlets: Iterable[Any]) -> list[Any]:
    """The outlets a release emits events for, or ValueError for an ``AssetAlias`` (see
    the module docstring). Other lineage objects (files, tables) emit no asset event and
    are left to lineage."""
    outlets = list(outlets)
    aliases = [outlet.name for outlet in outlets if isinstance(outlet, AssetAlias)]
    if aliases:
        raise ValueError(
            f"a release's outlets must be Assets, not asset aliases {aliases}: an alias's "
            "events are added at run time and would not carry the release's guarantee"
        )
    return [outlet for outlet in outlets if isinstance(outlet, Asset | AssetRef)]


def publish_guarantee(
    outlet_events: Any, outlets: Sequence[Any], guarantee: ReleaseGuarantee
) -> None:
    """Put ``guarantee`` in the extra of each outlet's event (``outlet_events`` is the
    task context's accessor)."""
    for outlet in outlets:
        outlet_events[outlet].extra[GUARANTEE_EXTRA_KEY] = guarantee.as_dict()
