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
* PostgreSQL: ``dp_append`` and ``dp_commit`` take the chain number, and ``dp_commit``
  commits without waiting for the disk (a commit lost in a crash leaves its reservation
  open, counted and reapable: never an undercount); ``dp_accounts``
  gets fillfactor 70 so an account's updates usually stay on its page (HOT updates,
  no index writes).
* PostgreSQL: ``dp_reserve`` reserves a single-key release in one call when the server
  can decide it: the account is Gaussian-only or zCDP-only (no residual curve), and its
  prospective rho or mu^2 is within a limit the client derived from the key's cap (see
  ``ledger/server_check.py``). Otherwise it raises SQLSTATE DPB01 having written nothing,
  and the client decides as before. Such a reservation records its prospective spend
  (``prospective_rho``, ``prospective_mu2``; a ``"prospective"`` spend in its history
  payload) instead of its epsilon, which the server cannot compute; readers convert it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

from dp_budget_provider.ledger.storage.history import CHAINS, GENESIS

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_previous = importlib.import_module(
    "dp_budget_provider.ledger.storage.migrations.versions.0002_pending_and_server_append"
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

# 0002's dp_commit with the chain passed through to dp_append, committing asynchronously:
# a commit lost in a crash leaves its reservation open, still counted and later reaped
# as charged, so only the reservation needs to wait for the disk.
DP_COMMIT = (
    _previous.DP_COMMIT.replace(
        "CREATE FUNCTION dp_commit(\n", "CREATE FUNCTION dp_commit(\n    p_chain integer,\n", 1
    )
    .replace("PERFORM dp_append(p_at,", "PERFORM dp_append(p_chain, p_at,", 1)
    .replace(
        "    v_locked integer;\nBEGIN\n",
        "    v_locked integer;\nBEGIN\n"
        "    PERFORM set_config('synchronous_commit', 'off', true);\n",
        1,
    )
)

# The server-built part of the reserve entry's payload: the prospective spend, in the
# form of Spend.as_payload, closing the payload. Only '"' in it needs escaping when the
# payload is embedded (as a JSON string) in the entry's link prefix.
DP_RESERVE = r"""
CREATE FUNCTION dp_reserve(
    p_chain integer, p_tenant text, p_subject text, p_query_type text, p_window text,
    p_policy_version integer, p_rho_limit double precision, p_mu2_limit double precision,
    p_cost_rho double precision, p_cost_mu2 double precision,
    p_id text, p_attempt_id text, p_mechanism text, p_count integer, p_keys_digest text,
    p_actor text, p_at text, p_payload_head text, p_prefix_head text, p_prefix_tail text
) RETURNS TABLE (r_rho double precision, r_mu2 double precision)
LANGUAGE plpgsql SET extra_float_digits = 1 AS $$
DECLARE
    v_add_mu2 double precision := COALESCE(p_cost_mu2, 0);
    v_add_others integer := CASE WHEN p_cost_mu2 IS NULL THEN 1 ELSE 0 END;
    v_version integer;
    v_acc record;
    v_rho double precision;
    v_mu2 double precision;
    v_tail text;
BEGIN
    -- The lock-and-add of the client's path (statements.PG_UPSERT), for one key.
    INSERT INTO dp_accounts AS a (tenant, subject, query_type, "window", rho, residual,
        gaussian_mu2, releases, open_reservations, pending_rho, pending_residual,
        pending_mu2, pending_others, updated_at)
    VALUES (p_tenant, p_subject, p_query_type, p_window, 0, NULL, 0, 0, 1, p_cost_rho, NULL,
        v_add_mu2, v_add_others, p_at)
    ON CONFLICT (tenant, subject, query_type, "window") DO UPDATE
    SET open_reservations = a.open_reservations + 1,
        pending_rho = a.pending_rho + p_cost_rho, pending_mu2 = a.pending_mu2 + v_add_mu2,
        pending_others = a.pending_others + v_add_others, updated_at = excluded.updated_at
    RETURNING a.rho, a.residual, a.gaussian_mu2, a.pending_rho, a.pending_residual,
        a.pending_mu2, a.pending_others INTO v_acc;
    SELECT c.policy_version INTO v_version FROM dp_ledger_config c WHERE c.id = 1;
    -- Committed plus pending spend (the pending now includes this cost), as the client
    -- adds them: Spend.plus(Pending.as_spend()).
    v_rho := v_acc.rho + v_acc.pending_rho;
    v_mu2 := CASE WHEN v_acc.gaussian_mu2 IS NOT NULL AND v_acc.pending_others = 0
                  THEN v_acc.gaussian_mu2 + v_acc.pending_mu2 END;
    -- Stored values the client would refuse as corrupt are the client's to refuse (fail
    -- closed; NaN sorts above infinity in PostgreSQL, so the upper bound excludes both).
    IF NOT (v_acc.rho >= 0 AND v_acc.rho < 'Infinity'::float8
            AND v_acc.pending_rho >= 0 AND v_acc.pending_rho < 'Infinity'::float8
            AND v_acc.pending_mu2 >= 0 AND v_acc.pending_mu2 < 'Infinity'::float8
            AND v_acc.pending_others >= 0
            AND COALESCE(v_acc.gaussian_mu2 >= 0 AND v_acc.gaussian_mu2 < 'Infinity'::float8,
                         true))
       OR v_version IS DISTINCT FROM p_policy_version
       OR v_acc.residual IS NOT NULL OR v_acc.pending_residual IS NOT NULL
       OR NOT (v_rho <= p_rho_limit
               OR COALESCE(v_mu2 > 0 AND v_mu2 <= p_mu2_limit, false)) THEN
        RAISE EXCEPTION 'dp_reserve: the client decides this release'
            USING ERRCODE = 'DPB01';
    END IF;
    INSERT INTO dp_reservations (id, attempt_id, state, mechanism, count, cost_rho,
        cost_residual, cost_gaussian_mu2, key_count, keys_digest, prospective_epsilon,
        prospective_rho, prospective_mu2, actor, created_at)
    VALUES (p_id, p_attempt_id, 'open', p_mechanism, p_count, p_cost_rho, NULL, p_cost_mu2,
        1, p_keys_digest, NULL, v_rho, v_mu2, p_actor, p_at);
    INSERT INTO dp_reservation_keys (reservation_id, position, tenant, subject, query_type,
        "window")
    VALUES (p_id, 0, p_tenant, p_subject, p_query_type, p_window);
    v_tail := '{"gaussian_mu2":' || COALESCE(v_mu2::text, 'null') || ',"residual":null'
        || ',"rho":' || v_rho::text || '}}';
    PERFORM dp_append(p_chain, p_at, 'reserve', p_actor, p_id, p_tenant, p_subject,
        p_query_type, p_window, p_payload_head || v_tail,
        p_prefix_head || replace(v_tail, '"', '\"') || p_prefix_tail);
    r_rho := v_rho;
    r_mu2 := v_mu2;
    RETURN NEXT;
END
$$
"""
_RESERVE_SIGNATURE = (
    "dp_reserve(integer, text, text, text, text, integer, double precision, double precision, "
    "double precision, double precision, text, text, text, integer, text, text, text, text, "
    "text, text)"
)

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
    with op.batch_alter_table("dp_reservations") as batch:
        batch.add_column(sa.Column("prospective_rho", sa.Float(53), nullable=True))
        batch.add_column(sa.Column("prospective_mu2", sa.Float(53), nullable=True))
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
        connection.exec_driver_sql(DP_RESERVE)  # as written: no bind parameters in it
        op.execute("ALTER TABLE dp_reservations ALTER COLUMN prospective_epsilon DROP NOT NULL")
        op.execute("ALTER TABLE dp_accounts SET (fillfactor = 70)")


def downgrade() -> None:
    connection = op.get_bind()
    for count, why in (
        (
            "SELECT count(*) FROM dp_history WHERE chain <> 1",
            "history entries are linked on chains other than chain 1, which revision 0002 "
            "cannot verify",
        ),
        (
            "SELECT count(*) FROM dp_reservations WHERE prospective_epsilon IS NULL",
            "reservations record their prospective spend instead of an epsilon, which "
            "revision 0002 cannot read",
        ),
    ):
        found = connection.execute(sa.text(count)).scalar_one()
        if found:
            raise RuntimeError(f"cannot downgrade below revision 0003: {found} {why}")
    if connection.dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {_RESERVE_SIGNATURE}")
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
        op.execute("ALTER TABLE dp_reservations ALTER COLUMN prospective_epsilon SET NOT NULL")
    op.execute("DELETE FROM dp_chain_head WHERE id <> 1")
    # Plain DROP COLUMN (SQLite >= 3.35): a batch copy would drop a table that
    # dp_reservation_keys refers to.
    op.execute("ALTER TABLE dp_reservations DROP COLUMN prospective_mu2")
    op.execute("ALTER TABLE dp_reservations DROP COLUMN prospective_rho")
    with op.batch_alter_table("dp_history") as batch:
        batch.drop_column("chain")
    with op.batch_alter_table("dp_ledger_config") as batch:
        batch.drop_column("chains")
