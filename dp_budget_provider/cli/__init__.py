"""``dp-budget``: create, inspect, audit and maintain a privacy budget ledger from a shell.

The ledger database comes from ``--url`` or the ``DP_BUDGET_URL`` environment variable
(``sqlite:////path/ledger.db`` or ``postgresql://user@host/db``), its chain key
(the secret its history is linked with) from ``DP_BUDGET_CHAIN_KEY``. Or ``--conn-id ID``
names the Airflow connection the tasks use: its URL and chain key are read through
Airflow's secrets backends by :class:`~dp_budget_provider.hooks.dp_budget.DPBudgetHook`,
so the CLI opens exactly the ledger the tasks open. Every command goes through the same
:mod:`dp_budget_provider.ledger` API the Airflow operators use; Airflow is imported only
for ``--conn-id``.

Exit codes: 0 success; 1 the ledger refused or failed (one ``dp-budget: error:`` line on
stderr), or ``verify`` found problems; 2 a usage error (bad arguments or values, no ledger
URL).

Commands (each takes ``--url URL`` or ``--conn-id ID``)::

    dp-budget admin keygen --out FILE
    dp-budget admin init                 (administrator: needs --admin-key FILE)
    dp-budget refusal REFERENCE          (administrator)
    dp-budget db upgrade
    dp-budget db adopt-key               (administrator)
    dp-budget init --epsilon E --delta D [--warn-fraction F] [--conversion improved|classic]
    dp-budget status [--window W] [--tenant T] [--limit N] [--offset N] [--json]
    dp-budget classes [--tenant T] [--query-type Q] [--window W] [--subject S] [--state S]
                      [--members CLASS] [--limit N] [--offset N] [--json]
    dp-budget show SUBJECT QUERY_TYPE WINDOW [--tenant T] [--json]
    dp-budget history [--limit N] [--after SEQ] [--before SEQ] [--newest-first] [--json]
    dp-budget verify [--checkpoint FILE]
    dp-budget quarantine show | clear --reason TEXT    (clear: administrator)
    dp-budget reset --window W | --closed
    dp-budget reap [--older-than DURATION]
    dp-budget policy list [--json]
    dp-budget policy set --epsilon E [--tenant T] [--query-type Q] [--warn-fraction F]
                         [--calendar iso_week|month|day|fixed] [--length-seconds N]
                         [--min-window-seconds N] [--grace DURATION] [--clause TEXT]
                                         (administrator)
    dp-budget report [--format md|json] [--window W] [--tenant T]

Modules: ``program`` (the entry point), ``parser``, the commands (``inspection``, ``upkeep``),
``target`` (which ledger), ``arguments``, ``output``, ``errors``.
"""

from dp_budget_provider.cli.program import main

__all__ = ["main"]
