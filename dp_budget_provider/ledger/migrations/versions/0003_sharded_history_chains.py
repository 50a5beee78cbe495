"""The history hash chain split into shards; accounts leave room for in-place updates.

* ``dp_ledger_config.chains`` fixes how many hash chains the history has (64 for a
  ledger made or upgraded now). An entry about one key is linked on that key's chain
  (``history.chain_of``); a release over many keys on its first key's chain; entries
  about no key on chain 1. Writers on different keys lock different chain heads, so the
  one row every writer used to queue on is gone. Entries already written stay on chain 1
  and keep their hashes.
* ``dp_history.chain`` records each entry's chain; ``dp_chain_head`` holds one row per
  chain (id = chain number, ``seq`` = the chain's last entry, 0 while it has none).
* ``seq`` stays the one global order of the history (replay, pages, reports). On
  PostgreSQL it comes from the sequence ``dp_history_seq``, taken while the chain head
  is locked (so it rises along each chain) and while the entry's accounts are locked (so
  it follows their commit order); a transaction that rolls back after taking a number
  leaves a gap. SQLite has one writer at a time and numbers without gaps.
* PostgreSQL: ``dp_append`` and ``dp_commit`` take the chain number; ``dp_accounts``
  gets fillfactor 70 so an account's updates usually stay on its page (HOT updates,
  no index writes).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

from dp_budget_provider.ledger.history import CHAINS, GENESIS

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_previous = importlib.import_module(
    "dp_budget_provider.ledger.migrations.versions.0002_pending_and_server_append"
)

DP_APPEND = """
CREATE FUNCTION dp_append(
    p_chain integer, p_at text, p_action text, p_actor text, p_reservation_id text,
    p_tenant text, p_subject text, p_query_type text, p_window text,
    p_payload text, p_link_prefix text
) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_seq integer;
    v_prev text;
    v_hash text;
BEGIN
    SELECT hash INTO v_prev FROM dp_chain_head WHERE id = p_chain FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dp_chain_head has no row for chain %: the ledger is not initialised',
            p_chain USING ERRCODE = 'data_corrupted';
    END IF;
    v_seq := nextval('dp_history_seq');
    v_hash := encode(
        sha256(convert_to(v_prev || E'\\n' || p_link_prefix || v_seq::text || '}', 'UTF8')),
        'hex'
    );
    INSERT INTO dp_history (seq, chain, at, action, actor, reservation_id, tenant, subject,
                            query_type, "window", payload, prev_hash, hash)
    VALUES (v_seq, p_chain, p_at, p_action, p_actor, p_reservation_id, p_tenant, p_subject,
            p_query_type, p_window, p_payload, v_prev, v_hash);
    UPDATE dp_chain_head SET seq = v_seq, hash = v_hash WHERE id = p_chain;
    RETURN v_seq;
END
$$
"""

# 0002's dp_commit with the chain passed through to dp_append.
DP_COMMIT = _previous.DP_COMMIT.replace(
    "CREATE FUNCTION dp_commit(\n", "CREATE FUNCTION dp_commit(\n    p_chain integer,\n", 1
).replace("PERFORM dp_append(p_at,", "PERFORM dp_append(p_chain, p_at,", 1)

_OLD_APPEND = "dp_append(text, text, text, text, text, text, text, text, text, text)"
_OLD_COMMIT = (
    "dp_commit(text, text, text, text, text, text, integer, text, double precision, "
    "double precision, text, text, text, text, text, text)"
)


def upgrade() -> None:
    connection = op.get_bind()
    with op.batch_alter_table("dp_ledger_config") as batch:
        batch.add_column(sa.Column("chains", sa.Integer, nullable=False, server_default="1"))
    with op.batch_alter_table("dp_history") as batch:
        batch.add_column(sa.Column("chain", sa.Integer, nullable=False, server_default="1"))
    # An initialised ledger gets its new chains now; a new one gets them when initialised.
    if connection.execute(sa.text("SELECT count(*) FROM dp_chain_head")).scalar_one():
        op.execute(f"UPDATE dp_ledger_config SET chains = {CHAINS}")
        connection.execute(
            sa.text("INSERT INTO dp_chain_head (id, seq, hash) VALUES (:id, 0, :genesis)"),
            [{"id": chain, "genesis": GENESIS} for chain in range(2, CHAINS + 1)],
        )
    if connection.dialect.name == "postgresql":
        op.execute("CREATE SEQUENCE dp_history_seq AS integer OWNED BY dp_history.seq")
        op.execute(
            "SELECT setval('dp_history_seq', COALESCE(max(seq), 0) + 1, false) FROM dp_history"
        )
        op.execute(f"DROP FUNCTION {_OLD_COMMIT}")
        op.execute(f"DROP FUNCTION {_OLD_APPEND}")
        op.execute(DP_APPEND)
        op.execute(DP_COMMIT)
        op.execute("ALTER TABLE dp_accounts SET (fillfactor = 70)")


def downgrade() -> None:
    connection = op.get_bind()
    sharded = connection.execute(
        sa.text("SELECT count(*) FROM dp_history WHERE chain <> 1")
    ).scalar_one()
    if sharded:
        raise RuntimeError(
            f"cannot downgrade below revision 0003: {sharded} history entries are linked on "
            "chains other than chain 1, which revision 0002 cannot verify"
        )
    if connection.dialect.name == "postgresql":
        op.execute("ALTER TABLE dp_accounts RESET (fillfactor)")
        op.execute(
            "DROP FUNCTION dp_commit(integer, text, text, text, text, text, text, integer, "
            "text, double precision, double precision, text, text, text, text, text, text)"
        )
        op.execute(
            "DROP FUNCTION dp_append(integer, text, text, text, text, text, text, text, text, "
            "text, text)"
        )
        op.execute("DROP SEQUENCE dp_history_seq")
        op.execute(_previous.DP_APPEND)
        op.execute(_previous.DP_COMMIT)
    op.execute("DELETE FROM dp_chain_head WHERE id <> 1")
    with op.batch_alter_table("dp_history") as batch:
        batch.drop_column("chain")
    with op.batch_alter_table("dp_ledger_config") as batch:
        batch.drop_column("chains")
