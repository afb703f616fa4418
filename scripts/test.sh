#!/usr/bin/env bash
# Set up, then lint, run the test suite and the public-contract check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy   # --strict over npu_agent/ and protos/ ([tool.mypy] in pyproject.toml)
# two test processes (TEST_WORKERS=1: one), each taking whole modules (their shared fixtures train once): most
# tests wait on the servers and trainings they start
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadscope --durations=15 "$@"   # the slowest 15 listed
CONTRACT=../shared/acceptance/contract_check.py
if [ -f "$CONTRACT" ]; then
  .venv/bin/python "$CONTRACT"
else
  echo "note: $CONTRACT not found next to this checkout; the public-contract check was not run"
fi
