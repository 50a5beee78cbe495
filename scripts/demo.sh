#!/usr/bin/env bash
# The main job on the embedded default. Until the Airflow provider lands this runs the
# accounting walk-through: debits, the warning, the refusal.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
.venv/bin/python -m dp_budget_provider.demo "$@"
