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
  rm -f .venv/.installed-*
  touch "$stamp"
fi
