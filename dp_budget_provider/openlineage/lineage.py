"""What a release operator tells OpenLineage when its task ends.

The declared inlets as inputs, the outlet Assets as outputs (on a failed run too: the
event's FAIL state says that nothing was released, as for any task's declared
datasets), and the guarantee facet whenever the attempt was charged: on success, and on
a failure after the data was touched. A release that never reached the data (refused,
invalid) was not charged and has no guarantee to state. Assets become datasets through
the converters their providers register (``dp-release://``, ``postgres://``,
``file://`` ...); an Asset no provider names is left out, as the OpenLineage provider
leaves it out of any task's lineage.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from airflow.providers.openlineage.extractors import OperatorLineage
from airflow.providers.openlineage.utils.utils import translate_airflow_asset
from airflow.sdk import Asset

from dp_budget_provider.ledger import ReleaseGuarantee
from dp_budget_provider.openlineage.facets import FACET_KEY, DpBudgetReleaseGuaranteeRunFacet


def datasets(assets: Iterable[Any]) -> list[Any]:
    """The OpenLineage datasets of the Assets among ``assets``."""
    found = (translate_airflow_asset(a, None) for a in assets if isinstance(a, Asset))
    return [dataset for dataset in found if dataset is not None]


def release_lineage(
    guarantee: ReleaseGuarantee | None, inlets: Iterable[Any], outlets: Iterable[Any]
) -> OperatorLineage:
    """The lineage of one release attempt (see the module docstring)."""
    facets = {}
    if guarantee is not None:
        facets[FACET_KEY] = DpBudgetReleaseGuaranteeRunFacet.of(guarantee)
    return OperatorLineage(inputs=datasets(inlets), outputs=datasets(outlets), run_facets=facets)
