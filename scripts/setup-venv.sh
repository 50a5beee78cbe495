#!/usr/bin/env bash
# Create .venv (if missing) and install the package with its test extra.
# Shared by scripts/test.sh and scripts/demo.sh so both work on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  echo "==> installing dp-budget-provider[test] into .venv (about a minute on a fresh machine)"
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e '.[test]'
  # The editable build leaves a second copy of the package's metadata in the source tree
  # (dp_budget_provider.egg-info). Code run from the tree (the tests, a DAG run) would then
  # find the provider's entry points twice, and Airflow's plugin manager, meeting the
  # duplicate, drops other providers' plugins (OpenLineage's listener among them). The
  # installed metadata in .venv is the one that counts.
  rm -rf ./*.egg-info
  rm -f .venv/.installed-*
  touch "$stamp"
fi
