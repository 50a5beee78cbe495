"""Audit: verify the tables against the history, checkpoints, quarantine, the chain key."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

from sqlalchemy import (
    select,
    update,
)

from dp_budget_provider.ledger.accounts.keys import free_text
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.audit import verification
from dp_budget_provider.ledger.audit.authority import AdminPublicKey, LedgerAuthority
from dp_budget_provider.ledger.audit.checkpoints import Checkpoint
from dp_budget_provider.ledger.audit.replay_state import AuditSettings
from dp_budget_provider.ledger.errors import (
    AdminAuthorityError,
    LedgerConfigMismatch,
    LedgerCorrupt,
    LedgerError,
    LedgerUnavailable,
)
from dp_budget_provider.ledger.records import (
    VerifyReport,
)
from dp_budget_provider.ledger.storage import clock, history
from dp_budget_provider.ledger.storage.entries import (
    AdminKeyEntry,
    AdoptKeyEntry,
    QuarantineEntry,
    UnquarantineEntry,
)
from dp_budget_provider.ledger.storage.journal import Journal
from dp_budget_provider.ledger.storage.schema import (
    ChainHead,
    LedgerConfig,
)
from dp_budget_provider.ledger.storage.transactions import LedgerDatabase
from dp_budget_provider.ledger.windows import maintenance
from dp_budget_provider.ledger.windows.policy_store import PolicyStore, write_policy

_QUARANTINE_LISTED = 20


class Auditor:
    """Audit: verify the tables against the history, checkpoints, quarantine, the chain key."""

    def __init__(
        self, database: LedgerDatabase, journal: Journal, pricing: Pricing, store: PolicyStore
    ) -> None:
        self._database = database
        self._journal = journal
        self._pricing = pricing
        self._store = store

    # ------------------------------------------------------------------ audit

    def verify(
        self, checkpoint: Checkpoint | None = None, *, quarantine: bool = True
    ) -> VerifyReport:
        """Prove the ledger's facts from its history (:mod:`verification`); quarantine on failure.

        Checks every link (HMACs under the chain key when the ledger has one), every entry
        ``checkpoint`` recorded (so checkpointed history cannot have been erased,
        truncated or rewritten), and every stored row against the history's replay,
        including that no granted release ever took a key past its cap. All reads come
        from one snapshot, so writers running meanwhile cannot make a healthy ledger look
        corrupt. With ``quarantine`` (the default), a failed verify quarantines the
        ledger: nothing is released until :meth:`clear_quarantine`.
        """
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            raise ValueError(f"checkpoint must be a Checkpoint, got {checkpoint!r}")
        settings = AuditSettings(
            self._pricing.orders,
            self._pricing.delta,
            self._pricing.conversion,
            self._journal.key,
            checkpoint,
        )
        try:
            with self._database.snapshot() as connection:
                report = verification.verify(connection, settings)
        except LedgerUnavailable:
            raise  # nothing was read: no verdict either way
        except Exception as error:  # noqa: BLE001 - a verify that crashes is a verify that failed
            # Stored values verify could not even handle (a text in an integer column):
            # crashing must not be a way around the quarantine.
            report = VerifyReport(
                entries=0,
                accounts=0,
                problems=[f"verification could not complete: {type(error).__name__}: {error}"],
                keyed=self._journal.key.keyed,
            )
        if report.problems and quarantine:
            try:
                self.quarantine(
                    f"verify found {len(report.problems)} problem(s), the first: "
                    f"{report.problems[0][:1000]}",
                    problems=[p[:1000] for p in report.problems[:_QUARANTINE_LISTED]],
                )
            except LedgerError as error:
                report.problems.append(f"the ledger could not be quarantined: {error}")
        return report

    def _verified(self, act: str) -> VerifyReport:
        """A passing verify, before an act that builds on the history as it stands."""
        report = self.verify()
        if not report.ok:
            raise LedgerCorrupt(
                f"refusing to {act} a history that does not verify ({len(report.problems)} "
                f"problem(s), the first: {report.problems[0]})"
            )
        return report

    def checkpoint(self, report: VerifyReport) -> Checkpoint:
        """A checkpoint of what ``report`` verified: keep it outside the ledger database.

        Only a verify that passed is checkpointed: its heads are the ones it proved.
        """
        if not isinstance(report, VerifyReport) or not report.ok:
            raise ValueError("only a verify report that passed can be checkpointed")
        # A verify checkpointed is the maintenance job done (the UI's verifies are not).
        at = maintenance.ran(self._database, maintenance.VERIFY, self._journal.actor)
        return Checkpoint.of(report.ledger, at, report.entries, report.heads, self._journal.key)

    @property
    def chain_key(self) -> history.ChainKey:
        """The key the history is linked with (unkeyed without one): checkpoints use it."""
        return self._journal.key

    @property
    def admin_public_key(self) -> AdminPublicKey | None:
        """The administrator key this ledger honours (None: it has none yet)."""
        return self._store.authority.trusted

    def maintenance(
        self, intervals: Mapping[str, timedelta] | None = None
    ) -> list[maintenance.MaintenanceState]:
        """When reap, reset and verify last ran, and which are overdue (not run within
        twice their interval, :mod:`maintenance`). ``intervals`` are the jobs' schedules'
        (default: the shipped maintenance DAGs'). Says nothing about any account."""
        checked = maintenance.check_intervals(intervals)
        with self._database.reading() as connection:
            return maintenance.states(connection, checked, clock.now())

    def quarantine_status(self) -> tuple[str, str] | None:
        """(since, reason) while the ledger is quarantined, else None."""
        with self._database.reading() as connection:
            row = connection.execute(
                select(LedgerConfig.quarantined_at, LedgerConfig.quarantine_reason)
            ).one()
        return None if row.quarantined_at is None else (row.quarantined_at, row.quarantine_reason)

    def quarantine(self, reason: str, problems: Sequence[str] = ()) -> bool:
        """Stop every release until an operator clears it (audited); False if already in force.

        The quarantine is recorded in the history too. When the history cannot take an
        entry (its chain head was tampered with), the quarantine is set all the same: a
        broken chain must never keep releases running.
        """
        reason = _reason(reason)
        try:
            return self._set_quarantine(reason, problems, audited=True)
        except (LedgerCorrupt, LedgerConfigMismatch) as error:
            return self._set_quarantine(
                _reason(
                    f"{reason[:1500]} (not in the history, which refused the entry: "
                    f"{str(error)[:300]})"
                ),
                problems,
                audited=False,
            )

    def _set_quarantine(self, reason: str, problems: Sequence[str], *, audited: bool) -> bool:
        with self._database.write() as connection:
            now = clock.stamp(clock.now())
            held = connection.execute(
                select(LedgerConfig.quarantined_at, LedgerConfig.quarantine_epoch)
                .where(LedgerConfig.id == 1)
                .with_for_update()
            ).one()
            if held.quarantined_at is not None:
                return False
            # A new epoch: no clearing signed for an earlier quarantine lifts this one.
            epoch = held.quarantine_epoch + 1
            connection.execute(
                update(LedgerConfig).values(
                    quarantined_at=now,
                    quarantine_reason=reason,
                    quarantine_epoch=epoch,
                    clearance=None,
                )
            )
            if audited:
                self._journal.append(
                    connection,
                    QuarantineEntry(
                        reason=reason, problems=tuple(str(p) for p in problems), epoch=epoch
                    ),
                    at=now,
                )
        return True

    def clear_quarantine(self, reason: str) -> None:
        """Let releases run again after an investigation; ``reason`` says what was found.

        An administrator's act: the ledger must have been opened with its administrator
        key, which signs the clearing of this quarantine (its epoch) only; a quarantine
        lifted any other way stays in force for every release. The clearing is a history
        entry naming its actor and reason. A ledger whose tables still disagree with its
        history is quarantined again by the next verify.
        """
        reason = _reason(reason)
        with self._database.write() as connection:
            now = clock.stamp(clock.now())
            row = connection.execute(
                select(
                    LedgerConfig.quarantined_at,
                    LedgerConfig.quarantine_reason,
                    LedgerConfig.quarantine_epoch,
                )
                .where(LedgerConfig.id == 1)
                .with_for_update()
            ).one()
            if row.quarantined_at is None:
                raise LedgerError("the ledger is not quarantined")
            clearance = self._store.authority.sign(
                "clear-quarantine", {"epoch": row.quarantine_epoch}
            )
            connection.execute(
                update(LedgerConfig)
                .where(LedgerConfig.id == 1)
                .values(quarantined_at=None, quarantine_reason=None, clearance=clearance)
            )
            self._journal.append(
                connection,
                UnquarantineEntry(
                    reason=reason,
                    quarantined_at=row.quarantined_at,
                    quarantine_reason=row.quarantine_reason,
                    epoch=row.quarantine_epoch,
                    signature=clearance,
                ),
                at=now,
            )

    def record_admin_key(self) -> str:
        """Make the key this ledger was opened with (``admin=``) its administrator's, once
        (``dp-budget admin init``); returns the key's public text, for the connections'
        ``admin_public_key`` pin.

        Every stored policy is signed again with it, as policy entries: from here on no
        policy is honoured without the administrator's signature. A ledger that has an
        administrator key keeps it; this is trust on first use, so record the key before
        any worker runs, and pin it in every connection.
        """
        signer = self._store.authority.signer
        if signer is None:
            raise AdminAuthorityError("admin init needs the administrator's key (admin=...)")
        if self._store.authority.trusted is not None:
            raise LedgerError(
                f"this ledger has administrator key {self._store.authority.trusted.key_id} already"
            )
        self._verified("give an administrator to")
        with self._database.write() as connection:
            now = clock.stamp(clock.now())
            config = connection.execute(
                select(LedgerConfig.admin_key).where(LedgerConfig.id == 1).with_for_update()
            ).scalar_one()
            if config is not None:
                raise LedgerError("this ledger was given an administrator key meanwhile")
            stored = self._store.read(connection)
            connection.execute(
                update(LedgerConfig)
                .where(LedgerConfig.id == 1)
                .values(admin_key=signer.public.text)
            )
            self._journal.append(connection, AdminKeyEntry(admin_key=signer.public.text), at=now)
            authority = self._store.authority = LedgerAuthority(
                self._store.authority.ledger, signer.public, signer
            )
            for policy in stored.values():
                write_policy(connection, self._journal, authority, policy, now)
        return signer.public.text

    def adopt_chain_key(self, chain_key: str | bytes) -> None:
        """Key an unkeyed ledger's history from now on (``dp-budget db adopt-key``).

        An administrator's act (the ledger must be opened with its administrator key).

        The history must verify first. The adoption entry is linked with the new key and
        records every chain head, so the unkeyed history before it can no longer be
        rewritten unnoticed either. Every head is locked meanwhile and carries the key's
        id from then on, so a writer still holding no key is refused instead of linking
        an unkeyed entry; open the ledger with the key everywhere afterwards.
        """
        key = history.ChainKey(chain_key)
        if not key.keyed:
            raise ValueError("adopt_chain_key needs a chain key")
        signature = self._store.authority.sign("adopt-key", {"chain_key_id": key.key_id})
        if self._journal.key.keyed:
            raise LedgerError("this ledger's history is keyed already")
        report = self._verified("key")
        with self._database.write() as connection:
            now = clock.stamp(clock.now())
            heads = connection.execute(
                select(ChainHead.id, ChainHead.seq, ChainHead.hash)
                .order_by(ChainHead.id)
                .with_for_update()
            ).all()
            if tuple(tuple(head) for head in heads) != report.heads:
                raise LedgerError("the history grew while it was verified; adopt the key again")
            connection.execute(update(ChainHead).values(key_id=key.key_id))
            seq = Journal(key, self._journal.chains, self._journal.actor).append(
                connection,
                AdoptKeyEntry(chain_key_id=key.key_id, heads=report.heads, signature=signature),
                at=now,
            )
            connection.execute(
                update(LedgerConfig)
                .where(LedgerConfig.id == 1)
                .values(chain_key_id=key.key_id, keyed_from=seq)
            )
        self._journal.adopt(key)


def _reason(reason: object) -> str:
    """An operator's reason: a non-empty, visible text of at most 2000 characters."""
    if not isinstance(reason, str) or not reason.strip() or len(reason) > 2000:
        raise ValueError("a reason must be a non-empty string of at most 2000 characters")
    if any(ord(c) < 32 and c not in "\n\t" for c in reason):
        raise ValueError("a reason must not hold control characters")
    return free_text("reason", reason).strip()
