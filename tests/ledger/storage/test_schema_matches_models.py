"""A migrated database has exactly the schema the models declare (schema.py).

The ledger never creates its tables from the models: every database, new or old, gets
its schema from the migrations (``database.create_schema`` upgrades an empty one to
head). The models are what the code reads and writes, so a migration that made a
column, index, constraint, key or counter other than they declare would go unnoticed
until a write failed or a query ran without its index. Alembic's comparison covers
tables, columns (type, nullability, server default), indexes and unique constraints, not
primary keys or counters: those are compared here too.
"""

from __future__ import annotations

import pprint

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from dp_budget_provider.ledger.storage.database import VERSION_TABLE
from dp_budget_provider.ledger.storage.schema import Base
from tests.ledger.storage.test_pending_and_server_paths import migrate

# What older revisions left differing from the models, harmless, kept as they are:
# * 0005 gave the policies it found 3 days of grace through a server default, which
#   stayed; the ledger always writes the column.
# * 0003 let prospective_epsilon be NULL for PostgreSQL's server-side reserve (gone since
#   0005, and never on SQLite, where dropping NOT NULL would copy the whole table).
KNOWN_DRIFT = {
    "sqlite": [
        ("modify_default", "dp_policies", "grace_seconds"),
        ("modify_nullable", "dp_reservations", "prospective_epsilon"),
    ],
    "postgresql": [("modify_default", "dp_policies", "grace_seconds")],
}


def _described(difference: tuple) -> tuple[str, str, str]:
    """(kind, table, column or index or constraint) of one of alembic's differences."""
    kind = difference[0]
    if kind.startswith("modify_"):  # (kind, schema, table, column, existing, old, new)
        return kind, difference[2], difference[3]
    if kind in ("add_column", "remove_column"):  # (kind, schema, table, column)
        return kind, difference[2], difference[3].name
    item = difference[1]  # a table, an index or a constraint
    if isinstance(item, sa.Table):
        return kind, item.name, ""
    return kind, item.table.name, item.name or ""


def _key_drift(connection: sa.Connection) -> list[str]:
    """Primary keys and counters that differ from the models'."""
    inspector = sa.inspect(connection)
    sqlite = connection.dialect.name == "sqlite"
    problems = []
    for table in Base.metadata.sorted_tables:
        stored = inspector.get_pk_constraint(table.name)["constrained_columns"]
        declared = [column.name for column in table.primary_key]
        if stored != declared:
            problems.append(f"{table.name}: primary key {stored}, the models {declared}")
        counter = table.autoincrement_column
        columns = inspector.get_columns(table.name)
        if sqlite:
            # A counter is the row id: the sole primary key column, declared INTEGER.
            types = {column["name"]: str(column["type"]) for column in columns}
            row_id = counter is None or (
                stored == [counter.name] and types[counter.name] == "INTEGER"
            )
            if not row_id:
                problems.append(f"{table.name}.{counter.name} is not the row id")
        else:
            counters = [column["name"] for column in columns if column.get("autoincrement")]
            if counters != ([] if counter is None else [counter.name]):
                problems.append(f"{table.name}: counters {counters}, the models {counter}")
    return problems


def assert_schema_is_the_models(url: str) -> None:
    """The database at ``url`` has the models' tables, columns, indexes, constraints,
    keys and counters, but for the known drift of its dialect."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection,
                opts={
                    "version_table": VERSION_TABLE,
                    "compare_type": True,
                    "compare_server_default": True,
                },
            )
            differences = compare_metadata(context, Base.metadata)
            flat = [
                item
                for difference in differences
                for item in (difference if isinstance(difference, list) else [difference])
            ]
            assert sorted(map(_described, flat)) == sorted(KNOWN_DRIFT[connection.dialect.name]), (
                pprint.pformat(flat)
            )
            assert _key_drift(connection) == []
    finally:
        engine.dispose()


def test_a_new_ledgers_schema_is_the_models(blank_ledger_url):
    migrate(blank_ledger_url, "upgrade", "head")
    assert_schema_is_the_models(blank_ledger_url)
