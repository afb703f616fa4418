#!/usr/bin/env bash
# The main job: set up, start gpu-server, train a small transformer LM in bfloat16 with the agent, print the reports.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m examples.demo "$@"   # --fault: one simulated device bug (examples/demo_fault.py)
