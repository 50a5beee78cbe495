#!/usr/bin/env bash
# The test command: set up everything, lint, run the whole suite.
# Fails (never skips) when a required part is missing; pytest's "no tests ran" (exit 5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
# The UI's end-to-end tests drive Debian's Chromium (they fail, never skip, without it).
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "==> installing chromium for the browser tests"
    apt-get update && apt-get install -y chromium
  else
    echo "WARNING: /usr/bin/chromium is missing (apt-get install -y chromium as root);" \
      "the browser tests will fail" >&2
  fi
fi
# The Celery deployment test puts the ledger behind Debian's PgBouncer (it fails without it).
if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "==> installing pgbouncer for the deployment tests"
    apt-get update && apt-get install -y pgbouncer
  else
    echo "WARNING: pgbouncer is missing (apt-get install -y pgbouncer as root);" \
      "the Celery deployment test will fail" >&2
  fi
fi
.venv/bin/python -c "import airflow, dp_accounting; print('airflow', airflow.__version__)"
.venv/bin/ruff check .
# One worker per core (DP_BUDGET_TEST_WORKERS overrides; 0 runs in this process); each test
# file stays on one worker, so its module fixtures (an Airflow api-server, a seeded ledger)
# start once. Every worker has its own AIRFLOW_HOME and scratch databases.
.venv/bin/pytest -n "${DP_BUDGET_TEST_WORKERS:-auto}" --dist loadfile "$@"
