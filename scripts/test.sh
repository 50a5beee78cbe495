#!/usr/bin/env bash
# The test command: set up everything, lint, run the whole suite.
# Fails (never skips) when a required part is missing; pytest's "no tests ran" (exit 5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
# require PROGRAM PACKAGE WHAT: install Debian's PACKAGE as root when PROGRAM is missing;
# otherwise warn that WHAT will fail (the tests fail, never skip, without it).
require() {
  if command -v "$1" >/dev/null || [ -x "/usr/bin/$1" ] || [ -x "/usr/sbin/$1" ]; then
    return
  fi
  if [ "$(id -u)" = 0 ]; then
    echo "==> installing $2 for $3"
    apt-get update && apt-get install -y "$2"
  else
    echo "WARNING: $1 is missing (apt-get install -y $2 as root); $3 will fail" >&2
  fi
}
require chromium chromium "the UI's browser tests"           # Debian's Chromium
require pgbouncer pgbouncer "the Celery deployment test"      # the ledger behind PgBouncer
.venv/bin/python -c "import airflow, dp_accounting; print('airflow', airflow.__version__)"
.venv/bin/ruff check .
# One worker per core and one more (DP_BUDGET_TEST_WORKERS overrides; 0 runs in this
# process): many tests wait on PostgreSQL, subprocesses and leases running out, and the
# extra worker fills those waits (2360 tests in 8.4 min on two idle cores). Each test file
# stays on one worker, so its module fixtures (an Airflow api-server, a seeded ledger)
# start once. Every worker has its own AIRFLOW_HOME and scratch databases.
workers="${DP_BUDGET_TEST_WORKERS:-$(( $(nproc) + 1 ))}"
.venv/bin/pytest -n "$workers" --dist loadfile "$@"
