"""The aggregate's read runs in one read-only snapshot of the source: a row another
connection commits between them is in neither, and a write from within fails (SQLite in
WAL mode and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dp_budget_provider.operators.aggregate import _snapshot
from tests.scratch_postgres import source_engine


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request, tmp_path) -> Iterator[sa.Engine]:
    with source_engine(request.param, tmp_path, "dpb_snapshot") as made:
        yield made


def count(connection: sa.Connection) -> int:
    return connection.execute(sa.text("SELECT count(*) FROM visits")).scalar_one()


def test_both_reads_see_one_snapshot_and_cannot_write(engine):
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE visits (person TEXT)"))
        connection.execute(sa.text("INSERT INTO visits VALUES ('ann')"))
    with engine.connect() as reader, _snapshot(reader):
        assert count(reader) == 1
        with engine.begin() as writer:  # another connection commits meanwhile
            writer.execute(sa.text("INSERT INTO visits VALUES ('bob')"))
        assert count(reader) == 1
        with pytest.raises(sa.exc.DBAPIError, match="(?i)read.?only"):
            reader.execute(sa.text("INSERT INTO visits VALUES ('eve')"))
    with engine.connect() as connection:
        assert count(connection) == 2
    with engine.connect() as connection:  # the pool's connections may write again
        connection.execute(sa.text("INSERT INTO visits VALUES ('cyd')"))
        connection.commit()
        assert count(connection) == 3
