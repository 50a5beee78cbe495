#!/usr/bin/env bash
# The test command: set up everything, lint, run the whole suite.
# Fails (never skips) when a required part is missing; pytest's "no tests ran" (exit 5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
.venv/bin/python -c "import airflow, dp_accounting; print('airflow', airflow.__version__)"
.venv/bin/ruff check .
.venv/bin/pytest "$@"
