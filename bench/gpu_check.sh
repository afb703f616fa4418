#!/usr/bin/env bash
# The server on CUDA against a CPU training, in one short script (run it on a machine with a GPU):
#   bash bench/gpu_check.sh [extra bench/server.py options]
# Records one CPU training's forward and backward records into a shared folder, then checks them with gpu-server
# --device cuda, and prints records/s and the server's time per training step (bench/server.py).
# PYTHON picks the interpreter (default .venv/bin/python): one with a CUDA build of torch and the packages of
# pyproject.toml, e.g. `PYTHON=python3 bash bench/gpu_check.sh` on a GPU host whose torch is installed system-wide.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu_check.sh: torch.cuda.is_available() is False here: run it on a host with a GPU and a CUDA build of torch")
print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
PY
exec "$PY" bench/server.py --device cuda --ranks 1 --steps "${STEPS:-4}" "$@"
