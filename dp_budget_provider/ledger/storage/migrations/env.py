"""Alembic environment for the ledger's schema.

The ledger runs migrations on its own connection (``config.attributes["connection"]``);
``dp-budget db upgrade`` passes one too. The version table has a name of its own so a
ledger can share a database with other applications. Every migration locks the revision
row before it changes anything, so it waits for the writes under way and holds off new
ones until it commits (:func:`database.lock_revision`).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from dp_budget_provider.ledger.storage.database import VERSION_TABLE, lock_revision
from dp_budget_provider.ledger.storage.schema import Base


def run_migrations() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        engine = create_engine(context.config.get_main_option("sqlalchemy.url") or "")
        with engine.begin() as own_connection:
            _run(own_connection)
        return
    _run(connection)


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,
    )
    with context.begin_transaction():
        lock_revision(connection)
        context.run_migrations()


run_migrations()
