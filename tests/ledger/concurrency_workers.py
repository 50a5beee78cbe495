"""Entry points for the worker processes of ``test_concurrency.py`` (spawned, never threads).

Each worker opens its own :class:`PrivacyBudgetLedger` (its own engine and connections),
as an Airflow worker on another machine would, and reports one plain dict through a
multiprocessing queue. Workers never raise: an unexpected exception is reported by
class name and message, so the parent test can fail with the reason.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from dp_budget_provider.accounting import GaussianMechanism
from dp_budget_provider.ledger import (
    BudgetExhausted,
    LedgerKey,
    LedgerUnavailable,
    PrivacyBudgetLedger,
    Reservation,
    key_for,
)
from tests.ledger_time import ledger_time_at, this_week

BARRIER_TIMEOUT = 120.0


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def race(url: str, key: LedgerKey, z: float, mode: str, barrier: Any, results: Any) -> None:
    """Spend on one key until refused: ``spend`` or ``reserve`` then ``commit``."""
    report: dict[str, Any] = {"receipts": [], "refused": None, "error": None}
    try:
        ledger = PrivacyBudgetLedger(url=url)
        mechanism = GaussianMechanism(z)
        barrier.wait(BARRIER_TIMEOUT)
        while True:
            try:
                if mode == "spend":
                    receipt = ledger.spend(key, mechanism)
                else:
                    receipt = ledger.commit(ledger.reserve(key, mechanism))[0]
            except BudgetExhausted as refusal:
                report["refused"] = refusal.would_be_epsilon
                break
            report["receipts"].append(receipt.epsilon)
        ledger.close()
    except BaseException as error:
        report["error"] = _describe(error)
    results.put(report)


def multi_key(
    url: str,
    subjects: list[str],
    seed: int,
    rounds: int,
    barrier: Any,
    results: Any,
    *,
    window: str | None = None,
) -> None:
    """Reserve random overlapping key sets, in random argument order, holding up to two.

    Reports every reservation made (id, the subjects it covers, how many accounts it
    holds, how it was resolved) and every refusal. The subjects are the ones asked for:
    a reservation's keys are the accounts of their spend classes, which the ledger
    refines as the overlapping sets split them. The keys are in ``window`` (default: the
    week of this worker's clock, the real one, which a new release may charge).
    """
    rng = random.Random(seed)
    keys = [key_for(subject, "count", window or this_week()) for subject in subjects]
    report: dict[str, Any] = {"reserved": {}, "refused": [], "error": None}
    held: list[Any] = []

    def resolve(reservation: Any) -> None:
        if rng.random() < 0.25:
            ledger.release(reservation, reason="test: data never touched")
            report["reserved"][reservation.id]["outcome"] = "release"
        else:
            ledger.commit(reservation)
            report["reserved"][reservation.id]["outcome"] = "commit"

    try:
        ledger = PrivacyBudgetLedger(url=url)
        mechanism = GaussianMechanism(4.0)
        barrier.wait(BARRIER_TIMEOUT)
        for _ in range(rounds):
            chosen = rng.sample(keys, rng.randint(1, 12))
            order = rng.choice(["as drawn", "sorted", "reversed"])
            if order == "sorted":
                chosen.sort()
            elif order == "reversed":
                chosen.sort(reverse=True)
            try:
                reservation = ledger.reserve(chosen, mechanism)
            except BudgetExhausted as refusal:
                report["refused"].append(
                    {"keys": sorted(k.subject for k in chosen), "key": refusal.key.subject}
                )
            else:
                report["reserved"][reservation.id] = {
                    "keys": sorted(k.subject for k in chosen),
                    "accounts": len(reservation.keys),
                    "outcome": "open",
                }
                held.append(reservation)
            if len(held) > rng.randint(0, 2):
                resolve(held.pop(0))
        while held:
            resolve(held.pop(0))
        ledger.close()
    except BaseException as error:
        report["error"] = _describe(error)
    results.put(report)


def across_types(
    url: str,
    subjects: list[str],
    query_types: list[str],
    window: str,
    seed: int,
    rounds: int,
    dag: str | None,
    filtering: bool,
    barrier: Any,
    results: Any,
) -> None:
    """Release over random overlapping subject sets, each under a random query type (a
    cap across query types binds them all), committing or releasing each reservation;
    with ``dag``, as that DAG's attempts (its principal's share pays where a cap is
    divided); with ``filtering``, every other release (at random) over the subjects'
    registered cohort, leaving out who cannot afford it (never refused).

    Reports every reservation (the subjects it covers, its query type, how it was
    resolved), how many were refused and how many subjects filtered ones left out.
    """
    rng = random.Random(seed)
    report: dict[str, Any] = {
        "reserved": {},
        "refused": 0,
        "left_out": 0,
        "error": None,
        "dag": dag,
    }
    try:
        ledger = PrivacyBudgetLedger(url=url)
        mechanism = GaussianMechanism(4.0)
        barrier.wait(BARRIER_TIMEOUT)
        for _ in range(rounds):
            chosen = rng.sample(subjects, rng.randint(1, 8))
            query_type = rng.choice(query_types)
            attempt = None if dag is None else f"{dag}/release/race/-1/1/{uuid.uuid4()}"
            if filtering and rng.random() < 0.5:
                cohort = ledger.cohort(chosen).in_window(query_type, window)
                reservation, left_out = ledger.reserve_admitting(
                    [cohort], mechanism, attempt=attempt
                )
                report["left_out"] += len(left_out)
                chosen = [subject for subject in chosen if subject not in left_out]
            else:
                try:
                    reservation = ledger.reserve(
                        [key_for(subject, query_type, window) for subject in chosen],
                        mechanism,
                        attempt=attempt,
                    )
                except BudgetExhausted:
                    report["refused"] += 1
                    continue
            outcome = "release" if rng.random() < 0.2 else "commit"
            if outcome == "commit":
                ledger.commit(reservation)
            else:
                ledger.release(reservation, reason="test: data never touched")
            report["reserved"][reservation.id] = {
                "keys": sorted(chosen),
                "query_type": query_type,
                "outcome": outcome,
            }
        ledger.close()
    except BaseException as error:
        report["error"] = _describe(error)
    results.put(report)


def slow_first_charge(url: str, key: LedgerKey, delay: float, inside: Any, results: Any) -> None:
    """Spend on ``key`` with the charge held ``delay`` seconds inside its transaction (its
    window locked, its scope not yet visible to others); ``inside`` is set meanwhile."""
    from dp_budget_provider.ledger.accounts import classes

    report: dict[str, Any] = {"error": None}
    try:
        ledger = PrivacyBudgetLedger(url=url)
        real = classes.accounts_for

        def held(*arguments: Any, **keywords: Any) -> Any:
            inside.set()
            time.sleep(delay)
            return real(*arguments, **keywords)

        classes.accounts_for = held
        ledger.spend(key, GaussianMechanism(3.0))
        ledger.close()
    except BaseException as error:
        report["error"] = _describe(error)
    results.put(report)


def reserve_then_hang(
    url: str, keys: list[LedgerKey], z: float, attempt: str, results: Any
) -> None:
    """Reserve, report the reservation id, then wait to be killed (a worker dying mid-task)."""
    try:
        ledger = PrivacyBudgetLedger(url=url)
        reservation = ledger.reserve(keys, GaussianMechanism(z), attempt=attempt)
        results.put({"reservation_id": reservation.id, "error": None})
    except BaseException as error:
        results.put({"reservation_id": None, "error": _describe(error)})
        return
    time.sleep(600)


def reserve_and_keep_alive(
    url: str, keys: list[LedgerKey], z: float, lease_seconds: float, results: Any
) -> None:
    """Reserve with a short lease, renew it from a daemon thread (as the release operator
    does while its query runs), report, then work until killed."""
    try:
        ledger = PrivacyBudgetLedger(url=url, lease=timedelta(seconds=lease_seconds))
        reservation = ledger.reserve(keys, GaussianMechanism(z))
    except BaseException as error:
        results.put({"reservation_id": None, "error": _describe(error)})
        return
    with ledger.keep_alive(reservation):
        results.put({"reservation_id": reservation.id, "error": None})
        time.sleep(600)


def operation(url: str, op: str, argument: Any, z: float, go: Any, results: Any) -> None:
    """Open the ledger, report readiness, run one ledger call and report how it ended.

    With an event ``go`` the call waits for it after reporting readiness.

    ``op`` is ``reserve`` (argument: keys), ``spend`` (argument: a key, or a key and an
    attempt id), ``reserve-commit`` (argument: keys and an attempt id: reserve, then
    commit the reservation it got, both here) or ``commit`` (argument: the
    :class:`Reservation` that ``reserve`` returned in another process, token included,
    pickled to this one: the commit itself runs here, on this worker's own ledger and
    connections) or ``reset`` (argument: a window). After a :class:`LedgerUnavailable`
    the worker checks that the same ledger object still answers once the database is
    back.
    """
    report: dict[str, Any] = {
        "outcome": None,
        "message": "",
        "epsilon": None,
        "recovered": None,
        "error": None,
    }
    try:
        ledger = PrivacyBudgetLedger(url=url)
        mechanism = GaussianMechanism(z)
        results.put({"ready": True})
        if go is not None:
            go.wait(BARRIER_TIMEOUT)
        started = time.perf_counter()
        try:
            if op == "reserve":
                ledger.reserve(argument, mechanism)
            elif op == "spend":
                key, attempt = argument if isinstance(argument, tuple) else (argument, None)
                report["epsilon"] = ledger.spend(key, mechanism, attempt=attempt).epsilon
            elif op == "reserve-commit":
                keys, attempt = argument
                reservation = ledger.reserve(keys, mechanism, attempt=attempt)
                report["epsilon"] = ledger.commit(reservation)[0].epsilon
            elif op == "reset":
                ledger.reset(argument)
            elif op == "commit":
                if not isinstance(argument, Reservation) or not argument.token:
                    raise ValueError(f"commit needs a Reservation with its token, got {argument!r}")
                report["epsilon"] = ledger.commit(argument)[0].epsilon
            else:
                raise ValueError(f"unknown operation {op!r}")
            report["outcome"] = "completed"
        except LedgerUnavailable as error:
            report["outcome"] = "LedgerUnavailable"
            report["message"] = str(error)
        except BaseException as error:
            report["outcome"] = type(error).__name__
            report["message"] = str(error)
        report["seconds"] = time.perf_counter() - started
        if report["outcome"] == "LedgerUnavailable":
            try:
                ledger.open_reservations()
                report["recovered"] = True
            except BaseException as error:
                report["recovered"] = _describe(error)
        ledger.close()
    except BaseException as error:
        report["error"] = _describe(error)
    results.put(report)


def spend_on_request(url: str, key: LedgerKey, z: float, requests: Any, results: Any) -> None:
    """Spend once on ``key`` for every request, reporting each; stop on ``None``."""
    try:
        ledger = PrivacyBudgetLedger(url=url)
        results.put({"ready": True})
        while requests.get(timeout=BARRIER_TIMEOUT) is not None:
            results.put({"epsilon": ledger.spend(key, GaussianMechanism(z)).epsilon})
        ledger.close()
    except BaseException as error:
        results.put({"error": _describe(error)})


def at(moment: datetime, target: Callable[..., None], *arguments: Any) -> None:
    """Run the worker ``target`` with this process's ledger clock at ``moment`` (running,
    as ``tests/ledger_time.py`` moves it in the test's own process): a worker whose
    transactions began at another moment than the others'."""
    ledger_time_at(pytest.MonkeyPatch(), moment)
    target(*arguments)
