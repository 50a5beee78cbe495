#!/usr/bin/env bash
# The main job on the embedded default: example DAGs run with dag.test() against the
# embedded SQLite ledger (debits, warning, refusal, sensor deferral), then dp-budget status.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
.venv/bin/python scripts/demo.py "$@"
