#!/usr/bin/env bash
# Set up, then lint, run the test suite and the public-contract check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
if [ -f ../shared/acceptance/contract_check.py ]; then
  .venv/bin/python ../shared/acceptance/contract_check.py
fi
