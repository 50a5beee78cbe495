"""Aggregates that own their data: contribution bounds enforced in the query that reads it,
and the sensitivity and the cohort of a release derived from that same query."""

from dp_budget_provider.aggregation.bounded_sql import BoundedQuery, BoundedRows, CellTotal
from dp_budget_provider.aggregation.bounds import AGGREGATES, Aggregate, ContributionBounds

__all__ = [
    "AGGREGATES",
    "Aggregate",
    "BoundedQuery",
    "BoundedRows",
    "CellTotal",
    "ContributionBounds",
]
