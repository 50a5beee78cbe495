"""Contribution bounds pushed down into the SQL the warehouse runs.

The DAG author's query returns one row per contribution. It is wrapped, never edited: what
it returns passes through window functions that keep, for each privacy unit, at most
``max_rows_per_group`` rows in each cell of the public domain (the rows with the smallest
values) and at most ``max_groups_per_unit`` cells (the first in the domain's order); rows
outside the domain and rows without a unit are dropped, and a summed value is clamped to
its bounds (a missing value counts as 0, clamped too). Which rows and cells a unit keeps
depends on that unit's rows alone, so adding or removing one unit moves the aggregate by
at most what :class:`~dp_budget_provider.aggregation.bounds.ContributionBounds` derives.

One read of the bounded rows (:class:`BoundedRows`) gives both the cell totals and the
units that contributed: the cohort a release is charged to comes from the rows it counts,
not from a second list or a second run of the query. Only
standard SQL is used (common table expressions, ``ROW_NUMBER`` and ``DENSE_RANK``, ``CASE``,
``UNION ALL``), with identifiers quoted by the connection's own dialect and every domain
value and bound passed as a parameter, so the heavy work runs where the data is.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Dialect

from dp_budget_provider.aggregation.bounds import AGGREGATES, Aggregate, ContributionBounds

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Parameters this module binds; a query's own parameters may not use the prefix.
_OWN = "dpb_"


@dataclass(frozen=True)
class CellTotal:
    """One cell of the domain after the bounds: how many rows it kept and their clamped sum
    (None for a count; a mean has both)."""

    rows: int
    total: float | None


@dataclass(frozen=True)
class BoundedQuery:
    """A contribution query and the bounds its rows are held to.

    ``sql`` returns one row per contribution and may use ``:name`` parameters (the run's
    data interval, say); ``privacy_unit`` and ``group_by`` (and ``value`` for a sum or a
    mean) name
    its columns; ``domain`` lists the public cells in output order, one value per
    ``group_by`` column each.
    """

    sql: str
    privacy_unit: str
    group_by: tuple[str, ...]
    domain: tuple[tuple[Any, ...], ...]
    bounds: ContributionBounds
    aggregate: Aggregate = "count"
    value: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sql, str) or not self.sql.strip().rstrip(";").strip():
            raise ValueError("sql must be a query returning one row per contribution")
        object.__setattr__(self, "sql", self.sql.strip().rstrip(";").rstrip())
        group_by = (self.group_by,) if isinstance(self.group_by, str) else tuple(self.group_by)
        if not group_by:
            raise ValueError("group_by must name at least one column")
        object.__setattr__(self, "group_by", group_by)
        for column in (self.privacy_unit, *group_by, *([self.value] if self.value else [])):
            if not isinstance(column, str) or not _IDENTIFIER.fullmatch(column):
                raise ValueError(
                    f"a column must be a plain SQL name (letters, digits, _), got {column!r}"
                )
        if len(set(group_by)) != len(group_by) or self.privacy_unit in group_by:
            raise ValueError("group_by columns must be distinct and other than the privacy unit")
        cells = tuple(_cell(cell, len(group_by)) for cell in self.domain)
        if not cells:
            raise ValueError("domain must list at least one cell")
        if len(set(cells)) != len(cells):
            raise ValueError("domain lists a cell twice")
        object.__setattr__(self, "domain", cells)
        if not isinstance(self.bounds, ContributionBounds):
            raise ValueError(f"bounds must be ContributionBounds, got {self.bounds!r}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {list(AGGREGATES)}, got {self.aggregate!r}")
        if self.valued != (self.value is not None):
            raise ValueError("a sum or mean names its value column (value=...), a count none")
        self.bounds.per_cell(self.aggregate)  # a sum without value_bounds is refused here

    @property
    def answer_size(self) -> int:
        """How many values the answer has: one per cell, a mean's sums then its counts."""
        return len(self.domain) * (2 if self.aggregate == "mean" else 1)

    @property
    def valued(self) -> bool:
        """Whether the rows carry a clamped value (a sum, or a mean's sum and count)."""
        return self.aggregate != "count"

    def statement(self, dialect: Dialect) -> sa.TextClause:
        """``SELECT unit, cell, kept, clamped`` of the bounded rows, ordered by unit:
        ``cell`` is the domain position, ``kept`` how many rows the row stands for and
        ``clamped`` its clamped value. A count needs no row's value: each (unit, cell) is
        one row of ``kept = min(rows, max_rows_per_group)``, grouped in the server (a hash
        aggregate, no ranking of rows, one row per cell sent instead of one per
        contribution). A sum keeps each of the smallest values as a row of its own
        (``kept`` 1), added up in the order read."""
        quote = dialect.identifier_preparer.quote
        groups = [f"group_{i}" for i in range(len(self.group_by))]
        selected = ", ".join(
            [f"{quote(self.privacy_unit)} AS unit"]
            + [
                f"{quote(column)} AS {name}"
                for column, name in zip(self.group_by, groups, strict=True)
            ]
            + ([f"{quote(self.value)} AS raw_value"] if self.value else ["NULL AS raw_value"])
        )
        domain = " UNION ALL ".join(
            "SELECT "
            + ", ".join(
                [f":{_OWN}d_{row}_{i} AS {name}" for i, name in enumerate(groups)]
                + [f"{row} AS cell"]
            )
            for row in range(len(self.domain))
        )
        matches = " AND ".join(f"c.{name} = d.{name}" for name in groups)
        # A missing value counts as 0; rows are kept smallest value first (ties are equal
        # values, so which of them is kept does not change a sum).
        value = "COALESCE(c.raw_value, 0)" if self.valued else "0"
        head = (
            f"WITH dpb_contributions AS (SELECT {selected} FROM ({self.sql}) dpb_query), "
            f"dpb_cells AS ({domain}), "
            f"dpb_in_domain AS (SELECT c.unit, d.cell, {value} AS value "
            f"FROM dpb_contributions c JOIN dpb_cells d ON {matches} "
            "WHERE c.unit IS NOT NULL), "
        )
        if not self.valued:
            return sa.text(
                head + "dpb_grouped AS (SELECT unit, cell, count(*) AS n FROM dpb_in_domain "
                "GROUP BY unit, cell), "
                f"dpb_kept AS (SELECT unit, cell, CASE WHEN n > :{_OWN}rows THEN :{_OWN}rows "
                "ELSE n END AS kept, DENSE_RANK() OVER (PARTITION BY unit ORDER BY cell) "
                "AS cell_rank FROM dpb_grouped) "
                "SELECT unit, cell, kept, NULL AS clamped FROM dpb_kept "
                f"WHERE cell_rank <= :{_OWN}groups ORDER BY unit"
            )
        clamped = (
            f"CASE WHEN value < :{_OWN}low THEN :{_OWN}low "
            f"WHEN value > :{_OWN}high THEN :{_OWN}high ELSE value END"
        )
        return sa.text(
            head + "dpb_ranked AS (SELECT unit, cell, value, ROW_NUMBER() OVER "
            "(PARTITION BY unit, cell ORDER BY value) AS row_rank FROM dpb_in_domain), "
            "dpb_kept AS (SELECT unit, cell, value, DENSE_RANK() OVER "
            "(PARTITION BY unit ORDER BY cell) AS cell_rank FROM dpb_ranked "
            f"WHERE row_rank <= :{_OWN}rows) "
            f"SELECT unit, cell, 1 AS kept, {clamped} AS clamped FROM dpb_kept "
            f"WHERE cell_rank <= :{_OWN}groups ORDER BY unit"
        )

    def parameters(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The statement's parameters: the query's own (``given``) and the bounds'."""
        given = dict(given or {})
        clash = sorted(name for name in given if name.startswith(_OWN))
        if clash:
            raise ValueError(f"query parameters may not start with {_OWN!r}: {clash}")
        own: dict[str, Any] = {
            f"{_OWN}rows": self.bounds.max_rows_per_group,
            f"{_OWN}groups": self.bounds.max_groups_per_unit,
        }
        for row, cell in enumerate(self.domain):
            for i, part in enumerate(cell):
                own[f"{_OWN}d_{row}_{i}"] = part
        if self.valued:
            assert self.bounds.value_bounds is not None  # checked when made
            own[f"{_OWN}low"], own[f"{_OWN}high"] = self.bounds.value_bounds
        return {**given, **own}


class BoundedRows:
    """One read of the bounded rows, streamed in unit order: iterating it yields each unit
    once (what a cohort registers), and keeps every row's unit (its position among the
    units yielded), cell and clamped value, to total once read.

    One read, not two: a query need not give the same rows twice (``TABLESAMPLE``,
    ``random()``, a counter it keeps), so units read by one statement and totals by
    another could count people the charge never names. Here every row counted is a row
    of a unit yielded. A unit must be text or an integer: another type's text is not one
    id (``42`` and ``42.0`` are one SQL value and two ledger ids).

    The rows are kept (24 bytes each, never the units' ids) as the release's entries
    (:meth:`entries`): a filtered release totals only those of the units its reservation
    kept.
    """

    def __init__(
        self,
        connection: sa.Connection,
        query: BoundedQuery,
        parameters: Mapping[str, Any] | None = None,
        *,
        batch: int = 10_000,
    ) -> None:
        self._rows = connection.execute(
            query.statement(connection.dialect),
            query.parameters(parameters),
            execution_options={"stream_results": True, "yield_per": batch},
        )
        self._sum = query.valued
        self._aggregate = query.aggregate
        self._cells = len(query.domain)
        self._unit_of = array("q")  # each row's unit, as its position among the units
        self._cell_of = array("q")
        self._kept_of = array("q")  # how many bounded rows each row read stands for
        self._value_of = array("d")
        self.units = 0  # how many distinct units were yielded
        self._done = False

    def __iter__(self) -> Iterator[str]:
        last: Any = _NONE
        unit_of, cell_of, value_of = self._unit_of, self._cell_of, self._value_of
        kept_of = self._kept_of
        for unit, cell, kept, clamped in self._rows:
            if unit != last:
                if isinstance(unit, bool) or not isinstance(unit, str | int):
                    raise ValueError(
                        f"privacy unit values must be text or integers, got a "
                        f"{type(unit).__name__}: cast the column in the query"
                    )
                last = unit
                self.units += 1
                yield str(unit)
            unit_of.append(self.units - 1)
            cell_of.append(cell)
            kept_of.append(kept)
            value_of.append(float(clamped) if self._sum else 0.0)
        self._done = True

    @property
    def totals(self) -> list[CellTotal]:
        """Every cell of the domain, in its order (an empty cell: 0 rows), once read. A
        sum past the largest float is infinite: the release's rule clamps it, never an
        error that says so."""
        self._read()
        cells = np.frombuffer(self._cell_of, dtype=np.int64)
        rows = np.zeros(self._cells, dtype=np.int64)
        np.add.at(rows, cells, self._kept())
        with np.errstate(over="ignore"):
            sums = np.bincount(cells, weights=self._values(), minlength=self._cells)
        return [
            CellTotal(int(count), float(total) if self._sum else None)
            for count, total in zip(rows, sums, strict=True)
        ]

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What each unit contributes to each value of the answer, once read: (the
        contributing unit's position, the value's position, the amount) per entry. The
        answer is the domain's counts (a count), sums (a sum), or sums then counts (a
        mean)."""
        self._read()
        unit_of = np.frombuffer(self._unit_of, dtype=np.int64)
        cells = np.frombuffer(self._cell_of, dtype=np.int64)
        if self._aggregate == "count":
            return unit_of, cells, self._kept().astype(np.float64)
        if self._aggregate == "sum":
            return unit_of, cells, self._values()
        return (
            np.concatenate([unit_of, unit_of]),
            np.concatenate([cells, cells + self._cells]),
            np.concatenate([self._values(), self._kept().astype(np.float64)]),
        )

    def _read(self) -> None:
        if not self._done:
            raise RuntimeError("the bounded rows have not been read to their end")

    def _kept(self) -> np.ndarray:
        return np.frombuffer(self._kept_of, dtype=np.int64)

    def _values(self) -> np.ndarray:
        return np.frombuffer(self._value_of, dtype=np.float64)


_NONE = object()


def _cell(cell: Any, width: int) -> tuple[Any, ...]:
    """A domain cell as a tuple of ``width`` plain values (one column: the value itself)."""
    parts: Sequence[Any] = cell if isinstance(cell, (tuple, list)) else (cell,)
    if len(parts) != width:
        raise ValueError(
            f"domain cell {cell!r} has {len(parts)} values for {width} group_by columns"
        )
    for part in parts:
        if part is None or isinstance(part, float) and not math.isfinite(part):
            raise ValueError(f"domain cell {cell!r} holds no value (None or not finite)")
        if not isinstance(part, (str, int, float)):
            raise ValueError(f"domain cell {cell!r}: values must be strings or numbers")
    return tuple(parts)
