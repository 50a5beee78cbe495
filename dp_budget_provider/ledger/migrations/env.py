"""Alembic environment for the ledger's schema.

The ledger runs migrations on its own connection (``config.attributes["connection"]``);
``dp-budget db upgrade`` passes one too. The version table has a name of its own so a
ledger can share a database with other applications.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from dp_budget_provider.ledger.schema import Base

VERSION_TABLE = "dp_budget_alembic_version"


def run_migrations() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        engine = create_engine(context.config.get_main_option("sqlalchemy.url") or "")
        with engine.begin() as own_connection:
            _run(own_connection)
        return
    _run(connection)


def _run(connection: object) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
