"""The run facet that carries a release's guarantee in an OpenLineage event.

Named as the OpenLineage spec asks of custom facets (a project prefix, the entity last:
``DpBudgetReleaseGuaranteeRunFacet``, attached under ``dpBudget_releaseGuarantee``). Its
fields are the guarantee's own, under the same names as in an asset event's extra
(:class:`~dp_budget_provider.ledger.ReleaseGuarantee`), so a reader of either reads the
other. Its JSON schema ships beside this module; ``_schemaURL`` is that schema's ``$id``,
versioned with the package so that one URL names one version of the schema.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

from attrs import define
from openlineage.client.facet_v2 import RunFacet

from dp_budget_provider import __version__
from dp_budget_provider.ledger import ReleaseGuarantee

FACET_KEY = "dpBudget_releaseGuarantee"
SCHEMA_FILE = "DpBudgetReleaseGuaranteeRunFacet.json"
SCHEMA_ID = f"urn:dp-budget-provider:{__version__}:{SCHEMA_FILE}"
SCHEMA_URL = f"{SCHEMA_ID}#/$defs/DpBudgetReleaseGuaranteeRunFacet"
PRODUCER = f"https://pypi.org/project/dp-budget-provider/{__version__}/"


def facet_schema() -> dict[str, Any]:
    """The facet's JSON schema, as shipped with the package."""
    return json.loads(files(__package__).joinpath(SCHEMA_FILE).read_text())


@define
class DpBudgetReleaseGuaranteeRunFacet(RunFacet):
    """A charged release's guarantee (see ``ReleaseGuarantee`` for each field)."""

    reservation_id: str
    mechanism: dict[str, Any]
    noise: str
    noise_std: float
    epsilon: float
    delta: float
    epsilon_after: float | None
    cap_epsilon: float
    windows: list[str]
    cohort_size: dict[str, int]
    reused: bool = False

    @classmethod
    def of(cls, guarantee: ReleaseGuarantee) -> DpBudgetReleaseGuaranteeRunFacet:
        return cls(producer=PRODUCER, **guarantee.as_dict())

    @staticmethod
    def _get_schema() -> str:
        return SCHEMA_URL
