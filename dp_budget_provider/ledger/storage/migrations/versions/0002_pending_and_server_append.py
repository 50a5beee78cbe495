"""Pending spend on accounts; on PostgreSQL, history links and commits made by the server.

* ``dp_accounts`` gains ``pending_rho``, ``pending_residual``, ``pending_mu2`` and
  ``pending_others``: the summed cost of the account's open reservations (mu^2 summed
  over the Gaussian-only ones, the others counted), kept under the same row lock as
  ``open_reservations``. The prospective check reads it from the locked row instead of
  looking reservations up, and it is reset to exactly zero when the last open
  reservation closes, so rounding never outlives a burst of overlapping reservations.
* ``dp_ledger_config.policy_version`` changes whenever a policy does (on PostgreSQL a
  trigger bumps it on any change to ``dp_policies``, however it is made), so writers can
  keep validated policies and learn from the row they lock whether they are still current.
* PostgreSQL only: ``dp_append`` links a history entry to the chain head inside the
  server, so the chain-head lock (which every writer takes) is never held across a
  client round trip; ``dp_commit`` charges a reservation whose cost has no residual
  curve in one call, locking its accounts in key order. The hash is the one
  ``history.entry_hash`` computes: sha256(prev + "\\n" + link prefix + seq + "}").

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import json
from collections import defaultdict

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_KEY_MATCH = (
    "k.tenant = a.tenant AND k.subject = a.subject AND k.query_type = a.query_type "
    'AND k."window" = a."window"'
)

DP_APPEND = """
CREATE FUNCTION dp_append(
    p_at text, p_action text, p_actor text, p_reservation_id text,
    p_tenant text, p_subject text, p_query_type text, p_window text,
    p_payload text, p_link_prefix text
) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_seq integer;
    v_prev text;
    v_hash text;
BEGIN
    SELECT seq, hash INTO v_seq, v_prev FROM dp_chain_head WHERE id = 1 FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dp_chain_head has no row: the ledger is not initialised'
            USING ERRCODE = 'data_corrupted';
    END IF;
    v_seq := v_seq + 1;
    v_hash := encode(
        sha256(convert_to(v_prev || E'\\n' || p_link_prefix || v_seq::text || '}', 'UTF8')),
        'hex'
    );
    INSERT INTO dp_history (seq, at, action, actor, reservation_id, tenant, subject,
                            query_type, "window", payload, prev_hash, hash)
    VALUES (v_seq, p_at, p_action, p_actor, p_reservation_id, p_tenant, p_subject,
            p_query_type, p_window, p_payload, v_prev, v_hash);
    UPDATE dp_chain_head SET seq = v_seq, hash = v_hash WHERE id = 1;
    RETURN v_seq;
END
$$
"""

DP_COMMIT = f"""
CREATE FUNCTION dp_commit(
    p_reservation_id text, p_state text, p_action text, p_at text, p_actor text,
    p_attempt_id text, p_count integer, p_keys_digest text,
    p_cost_rho double precision, p_cost_mu2 double precision,
    p_tenant text, p_subject text, p_query_type text, p_window text,
    p_payload text, p_link_prefix text
) RETURNS TABLE (
    r_outcome text, r_tenant text, r_subject text, r_query_type text, r_window text,
    r_rho double precision, r_residual text, r_gaussian_mu2 double precision,
    r_policy_version integer
) LANGUAGE plpgsql AS $$
DECLARE
    v_res dp_reservations%ROWTYPE;
    v_locked integer;
BEGIN
    SELECT * INTO v_res FROM dp_reservations WHERE id = p_reservation_id FOR UPDATE;
    IF NOT FOUND THEN
        r_outcome := 'missing';
        RETURN NEXT;
        RETURN;
    END IF;
    -- Anything but an open reservation with a residual-free cost, exactly as the caller
    -- described it, is left to the client's general path.
    IF v_res.state <> 'open' OR v_res.cost_residual IS NOT NULL
       OR v_res.attempt_id <> p_attempt_id OR v_res.count <> p_count
       OR v_res.keys_digest <> p_keys_digest OR v_res.cost_rho <> p_cost_rho
       OR v_res.cost_gaussian_mu2 IS DISTINCT FROM p_cost_mu2 THEN
        r_outcome := 'general';
        RETURN NEXT;
        RETURN;
    END IF;
    -- One pass: lock the accounts in key order, charge them, return them.
    RETURN QUERY
        WITH locked AS (
            SELECT a.id FROM dp_accounts a JOIN dp_reservation_keys k ON {_KEY_MATCH}
            WHERE k.reservation_id = p_reservation_id
            ORDER BY k.position
            FOR UPDATE OF a
        ), charged AS (
            UPDATE dp_accounts a SET
                rho = a.rho + v_res.cost_rho,
                gaussian_mu2 = a.gaussian_mu2 + v_res.cost_gaussian_mu2,
                releases = a.releases + v_res.count,
                open_reservations = a.open_reservations - 1,
                pending_rho = CASE WHEN a.open_reservations <= 1 THEN 0
                    WHEN a.pending_rho - v_res.cost_rho < 0 THEN 0
                    ELSE a.pending_rho - v_res.cost_rho END,
                pending_mu2 = CASE WHEN a.open_reservations <= 1 THEN 0
                    WHEN v_res.cost_gaussian_mu2 IS NULL THEN a.pending_mu2
                    WHEN a.pending_mu2 - v_res.cost_gaussian_mu2 < 0 THEN 0
                    ELSE a.pending_mu2 - v_res.cost_gaussian_mu2 END,
                pending_others = CASE WHEN a.open_reservations <= 1 THEN 0
                    WHEN v_res.cost_gaussian_mu2 IS NOT NULL THEN a.pending_others
                    WHEN a.pending_others < 1 THEN 0
                    ELSE a.pending_others - 1 END,
                pending_residual = CASE WHEN a.open_reservations <= 1 THEN NULL
                    ELSE a.pending_residual END,
                updated_at = p_at
            FROM locked l WHERE a.id = l.id
            RETURNING a.tenant, a.subject, a.query_type, a."window", a.rho, a.residual,
                      a.gaussian_mu2
        )
        SELECT 'charged'::text, c.tenant::text, c.subject::text, c.query_type::text,
               c."window"::text, c.rho, c.residual, c.gaussian_mu2,
               (SELECT cf.policy_version FROM dp_ledger_config cf WHERE cf.id = 1)
        FROM charged c;
    GET DIAGNOSTICS v_locked = ROW_COUNT;
    IF v_locked <> v_res.key_count THEN
        RAISE EXCEPTION 'reservation % holds % keys but only % accounts exist',
            p_reservation_id, v_res.key_count, v_locked USING ERRCODE = 'data_corrupted';
    END IF;
    -- Only now a new version of the reservation row: a twin reserving the same attempt
    -- (holding the accounts) would wait on it in its unique check while we wait on them.
    UPDATE dp_reservations SET state = p_state, resolved_at = p_at WHERE id = p_reservation_id;
    -- Last, like every writer: the chain head is never held while waiting for accounts.
    PERFORM dp_append(p_at, p_action, p_actor, p_reservation_id, p_tenant, p_subject,
                      p_query_type, p_window, p_payload, p_link_prefix);
END
$$
"""


DP_POLICY_VERSION = """
CREATE FUNCTION dp_bump_policy_version() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE dp_ledger_config SET policy_version = policy_version + 1 WHERE id = 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER dp_policies_version AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
ON dp_policies FOR EACH STATEMENT EXECUTE FUNCTION dp_bump_policy_version()
"""


def _backfill_pending(connection: sa.Connection) -> None:
    """Sum the costs of reservations open at upgrade time onto their accounts."""
    rows = connection.execute(
        sa.text(
            'SELECT k.tenant, k.subject, k.query_type, k."window", r.cost_rho, '
            "r.cost_residual, r.cost_gaussian_mu2 FROM dp_reservations r "
            "JOIN dp_reservation_keys k ON k.reservation_id = r.id WHERE r.state = 'open'"
        )
    ).all()
    pending: dict[tuple, list] = defaultdict(lambda: [0.0, None, 0.0, 0])
    for tenant, subject, query_type, window, rho, residual, mu2 in rows:
        total = pending[(tenant, subject, query_type, window)]
        total[0] += rho
        if residual is not None:
            values = json.loads(residual)
            total[1] = (
                values
                if total[1] is None
                else [a + b for a, b in zip(total[1], values, strict=True)]
            )
        if mu2 is None:
            total[3] += 1
        else:
            total[2] += mu2
    for (tenant, subject, query_type, window), (rho, residual, mu2, others) in pending.items():
        connection.execute(
            sa.text(
                "UPDATE dp_accounts SET pending_rho = :rho, pending_residual = :residual, "
                "pending_mu2 = :mu2, pending_others = :others WHERE tenant = :tenant "
                'AND subject = :subject AND query_type = :query_type AND "window" = :window'
            ),
            {
                "rho": rho,
                "residual": None if residual is None else json.dumps(residual),
                "mu2": mu2,
                "others": others,
                "tenant": tenant,
                "subject": subject,
                "query_type": query_type,
                "window": window,
            },
        )


def upgrade() -> None:
    with op.batch_alter_table("dp_accounts") as batch:
        batch.add_column(sa.Column("pending_rho", sa.Float(53), nullable=False, server_default="0"))
        batch.add_column(sa.Column("pending_residual", sa.Text, nullable=True))
        batch.add_column(sa.Column("pending_mu2", sa.Float(53), nullable=False, server_default="0"))
        batch.add_column(
            sa.Column("pending_others", sa.Integer, nullable=False, server_default="0")
        )
    with op.batch_alter_table("dp_ledger_config") as batch:
        batch.add_column(
            sa.Column("policy_version", sa.Integer, nullable=False, server_default="0")
        )
    connection = op.get_bind()
    _backfill_pending(connection)
    if connection.dialect.name == "postgresql":
        op.execute(DP_APPEND)
        op.execute(DP_COMMIT)
        op.execute(DP_POLICY_VERSION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER dp_policies_version ON dp_policies")
        op.execute("DROP FUNCTION dp_bump_policy_version()")
        op.execute(
            "DROP FUNCTION dp_commit(text, text, text, text, text, text, integer, text, "
            "double precision, double precision, text, text, text, text, text, text)"
        )
        op.execute(
            "DROP FUNCTION dp_append(text, text, text, text, text, text, text, text, text, text)"
        )
    with op.batch_alter_table("dp_ledger_config") as batch:
        batch.drop_column("policy_version")
    with op.batch_alter_table("dp_accounts") as batch:
        batch.drop_column("pending_others")
        batch.drop_column("pending_mu2")
        batch.drop_column("pending_residual")
        batch.drop_column("pending_rho")
