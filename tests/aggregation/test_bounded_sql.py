"""Contribution bounds in SQL, on SQLite and PostgreSQL: the bounded aggregate is exactly a
brute-force implementation of the bounds in Python, and adding or removing all of one
unit's rows never moves it by more than the sensitivity the bounds derive."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dp_budget_provider.aggregation import BoundedQuery, BoundedRows, ContributionBounds
from tests.scratch_postgres import source_engine

DOMAIN = ((0, "a"), (0, "b"), (1, "a"), (2, "c"))  # (row, column) cells of a small map
UNITS = ("u1", "u2", "u3", "u4")
ROWS = st.lists(
    st.tuples(
        st.sampled_from((*UNITS, None)),
        st.sampled_from((0, 1, 2, 3)),  # 3 is outside the domain
        st.sampled_from(("a", "b", "c")),
        st.one_of(st.none(), st.integers(-20, 20).map(float)),
    ),
    max_size=40,
)
BOUNDS = st.builds(
    ContributionBounds,
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from([(0.0, 5.0), (-3.0, 2.0), (1.0, 4.0)]),
)
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
SQL = "SELECT * FROM visits WHERE day >= :start"


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def engine(request, tmp_path_factory) -> Iterator[sa.Engine]:
    with source_engine(request.param, tmp_path_factory.mktemp("bounded"), "dpb_bounded") as made:
        yield made


def load(engine: sa.Engine, rows) -> None:
    with engine.begin() as connection:
        connection.execute(sa.text("DROP TABLE IF EXISTS visits"))
        connection.execute(
            sa.text(
                'CREATE TABLE visits (person TEXT, "row" INTEGER, col TEXT, '
                "amount DOUBLE PRECISION, day INTEGER)"
            )
        )
        if rows:
            connection.execute(
                sa.text("INSERT INTO visits VALUES (:p, :r, :c, :a, 1)"),
                [{"p": p, "r": r, "c": c, "a": a} for p, r, c, a in rows],
            )


def brute_force(rows, bounds: ContributionBounds, aggregate: str):
    """The bounds applied in Python: per unit, the m smallest values (a missing one is 0)
    of each cell, then its k first cells in the domain's order; a sum clamps each."""
    cells: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for person, row, col, amount in rows:
        if person is None or (row, col) not in DOMAIN:
            continue
        cells[person][DOMAIN.index((row, col))].append(0.0 if amount is None else amount)
    counts, sums, units = [0] * len(DOMAIN), [0.0] * len(DOMAIN), set()
    low, high = bounds.value_bounds or (0.0, 0.0)
    for person, by_cell in cells.items():
        for cell in sorted(by_cell)[: bounds.max_groups_per_unit]:
            kept = sorted(by_cell[cell])[: bounds.max_rows_per_group]
            counts[cell] += len(kept)
            sums[cell] += sum(min(max(value, low), high) for value in kept)
            units.add(person)
    return counts, sums if aggregate != "count" else [None] * len(DOMAIN), units


def query(bounds: ContributionBounds, aggregate: str) -> BoundedQuery:
    return BoundedQuery(
        SQL,
        "person",
        ("row", "col"),
        DOMAIN,
        bounds,
        aggregate,
        "amount" if aggregate != "count" else None,
    )


def measured(engine: sa.Engine, bounded: BoundedQuery):
    with engine.connect() as connection:
        rows = BoundedRows(connection, bounded, {"start": 0}, batch=2)
        units = list(rows)
        totals = rows.totals
    assert len(units) == len(set(units)) == rows.units  # each unit once
    return [t.rows for t in totals], [t.total for t in totals], set(units)


AGGREGATES = st.sampled_from(["count", "sum", "mean"])


def released(counts, sums, aggregate: str) -> list[float]:
    """The vector a release noises: counts, sums, or a mean's sums then counts."""
    return {"count": counts, "sum": sums, "mean": [*sums, *counts]}[aggregate]


@SETTINGS
@given(rows=ROWS, bounds=BOUNDS, aggregate=AGGREGATES)
def test_the_bounded_aggregate_is_the_bounds_applied_by_brute_force(
    engine, rows, bounds, aggregate
):
    load(engine, rows)
    counts, sums, units = measured(engine, query(bounds, aggregate))
    expected_counts, expected_sums, expected_units = brute_force(rows, bounds, aggregate)
    assert counts == expected_counts
    assert units == expected_units
    if aggregate != "count":
        assert sums == pytest.approx(expected_sums, abs=1e-9)
    else:
        assert sums == expected_sums


@SETTINGS
@given(
    rows=ROWS,
    bounds=BOUNDS,
    aggregate=AGGREGATES,
    # The neighbour's rows: many, in every cell (and outside), with extreme values.
    extra=st.lists(
        st.tuples(
            st.sampled_from((0, 1, 2, 3)),
            st.sampled_from(("a", "b", "c")),
            st.one_of(st.none(), st.sampled_from([-1e6, 1e6, 0.0, 3.0])),
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_one_units_rows_move_the_aggregate_by_at_most_the_sensitivity(
    engine, rows, bounds, aggregate, extra
):
    bounded = query(bounds, aggregate)
    load(engine, rows)
    counts, sums, _ = measured(engine, bounded)
    load(engine, [*rows, *(("neighbour", r, c, a) for r, c, a in extra)])
    with_counts, with_sums, units = measured(engine, bounded)
    before = released(counts, sums, aggregate)
    after = released(with_counts, with_sums, aggregate)
    moves = [abs(a - b) for a, b in zip(after, before, strict=True)]
    assert max(moves) <= bounds.per_cell(aggregate) + 1e-9
    assert sum(moves) <= bounds.l1_sensitivity(aggregate) + 1e-9
    assert math.sqrt(sum(m * m for m in moves)) <= bounds.l2_sensitivity(aggregate) + 1e-9
    if any(r is not None and (r, c) in DOMAIN for r, c, _ in extra):
        assert "neighbour" in units


def test_what_the_query_and_its_arguments_may_be(engine):
    bounds = ContributionBounds(2, 1, (0.0, 1.0))
    with pytest.raises(ValueError, match="plain SQL name"):
        BoundedQuery(SQL, 'person"; DROP TABLE visits; --', "row", (0, 1), bounds)
    with pytest.raises(ValueError, match="privacy unit"):
        BoundedQuery(SQL, "person", ("person",), (0,), bounds)
    with pytest.raises(ValueError, match="twice"):
        BoundedQuery(SQL, "person", "row", (0, 0), bounds)
    with pytest.raises(ValueError, match="2 group_by columns"):
        BoundedQuery(SQL, "person", ("row", "col"), (0,), bounds)
    with pytest.raises(ValueError, match="value column"):
        BoundedQuery(SQL, "person", "row", (0,), bounds, "sum")
    with pytest.raises(ValueError, match="value_bounds"):
        BoundedQuery(SQL, "person", "row", (0,), ContributionBounds(1, 1), "sum", "amount")
    with pytest.raises(ValueError, match="no value"):
        BoundedQuery(SQL, "person", "row", (float("nan"),), bounds)
    bounded = BoundedQuery(SQL, "person", "row", (0,), bounds)
    with pytest.raises(ValueError, match="may not start with 'dpb_'"):
        bounded.parameters({"start": 0, "dpb_rows": 10})
    # A column named like an SQL keyword is quoted by the connection's dialect.
    load(engine, [("u1", 0, "a", 1.0)])
    with engine.connect() as connection:
        rows = BoundedRows(connection, bounded, {"start": 0})
        with pytest.raises(RuntimeError, match="not been read"):
            _ = rows.totals
        assert list(rows) == ["u1"] and rows.totals[0].rows == 1


def test_bounds_are_checked_and_derive_the_sensitivity():
    bounds = ContributionBounds(4, 3, (-2.0, 5.0))
    assert bounds.per_cell("count") == 3.0 and bounds.l1_sensitivity("count") == 12.0
    assert bounds.per_cell("sum") == 15.0 and bounds.l1_sensitivity("sum") == 60.0
    assert bounds.l2_sensitivity("sum") >= 30.0 == math.sqrt(4) * 15.0
    for wrong in ((0, 1), (1, 0), (True, 1), (1.5, 1)):
        with pytest.raises(ValueError, match="whole number"):
            ContributionBounds(*wrong)
    for value_bounds in ((1.0, 0.0), (0.0, math.inf), ("a", 1), (1,)):
        with pytest.raises(ValueError, match="value_bounds"):
            ContributionBounds(1, 1, value_bounds)
    with pytest.raises(ValueError, match="aggregate"):
        ContributionBounds(1, 1).per_cell("median")  # type: ignore[arg-type]
    # A mean is a sum and a count per cell, moved together: (m B, m) in each of k cells.
    assert bounds.cell_moves("mean") == (15, 3)
    assert bounds.per_cell("mean") == 15.0 and bounds.l1_sensitivity("mean") == 72.0
    assert (
        bounds.l2_sensitivity("mean") ** 2
        >= 4 * (15**2 + 3**2)
        > (math.nextafter(bounds.l2_sensitivity("mean"), 0) ** 2)
    )
    with pytest.raises(ValueError, match="a mean needs value_bounds"):
        ContributionBounds(1, 1).l2_sensitivity("mean")


def test_the_units_are_those_of_the_rows_counted_when_the_query_is_not_repeatable(engine):
    """A query that reads other rows each time it runs (a sample, ``random()``): one read
    gives both, so every row counted is a row of a unit yielded (one cell, one row a unit:
    the count is the number of units)."""
    load(engine, [(f"p{i:03d}", 0, "a", 1.0) for i in range(300)])
    # SQLite may draw random() once for the statement: with the rowid it still picks
    # another half of the rows on each run.
    coin = "(random() + rowid) % 2 = 0" if engine.dialect.name == "sqlite" else "random() < 0.5"
    sampled = BoundedQuery(
        f"SELECT * FROM visits WHERE day >= :start AND {coin}",
        "person",
        ("row", "col"),
        DOMAIN,
        ContributionBounds(1, 1),
    )
    with engine.connect() as connection:
        rows = BoundedRows(connection, sampled, {"start": 0}, batch=7)
        units = list(rows)
        assert 0 < len(units) < 300
        assert rows.totals[0].rows == len(units) == rows.units


def test_a_unit_that_is_not_text_or_an_integer_is_refused(engine):
    """42 and 42.0 are one SQL value and two ledger ids: a float unit is refused."""
    load(engine, [("p", 0, "a", 42.0)])
    by_amount = BoundedQuery(SQL, "amount", ("row", "col"), DOMAIN, ContributionBounds(1, 1))
    with engine.connect() as connection, pytest.raises(ValueError, match="text or integers"):
        list(BoundedRows(connection, by_amount, {"start": 0}))


@pytest.mark.parametrize("aggregate", ["count", "sum", "mean"])
def test_a_unit_at_every_bound_moves_the_aggregate_by_exactly_the_sensitivity(engine, aggregate):
    """The worst neighbour (a row of the largest magnitude past the bounds, many times, in
    every cell): the sensitivity is reached, not only respected, so it is not loose, and a
    mean's charge covers its sum and its count moving together."""
    bounds = ContributionBounds(3, 2, (-1.0, 4.0))
    bounded = query(bounds, aggregate)
    load(engine, [("u1", 0, "a", 2.0)])
    counts, sums, _ = measured(engine, bounded)
    worst = [("neighbour", r, c, 1e6) for r, c in DOMAIN for _ in range(5)]
    load(engine, [("u1", 0, "a", 2.0), *worst])
    with_counts, with_sums, _ = measured(engine, bounded)
    moves = [
        abs(a - b)
        for a, b in zip(
            released(with_counts, with_sums, aggregate),
            released(counts, sums, aggregate),
            strict=True,
        )
    ]
    assert sum(moves) == bounds.l1_sensitivity(aggregate)
    assert math.sqrt(sum(m * m for m in moves)) == pytest.approx(
        bounds.l2_sensitivity(aggregate), rel=1e-15
    )
    assert math.sqrt(sum(m * m for m in moves)) <= bounds.l2_sensitivity(aggregate)
