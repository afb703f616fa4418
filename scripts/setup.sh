#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test tools and the server's compiled metrics
# (the `fast` extra). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The CPU build of PyTorch, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
# pyproject keeps an open range (torch>=2.13) for users who bring their own CUDA/NPU torch.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,fast]'
# The agent's compiled modules (npu_agent/_fastskip.c: the calls the sampling skips; npu_agent/_fastencode.c: a
# record's values; npu_agent/_fastlocate.c: the modules on a call's stack; npu_agent/_fasttap.c: a captured call's
# arguments; plain C, a few seconds; npu_agent/_fasthook.cpp: the backward taps' hooks put on autograd nodes, and
# npu_agent/_fastmask.cpp: a random call's dropout check and generator state, C++ against the torch just installed,
# about 15 s each). Where they cannot be compiled the agent does that work in Python, with the same records: setup
# goes on.
.venv/bin/python -m npu_agent.compiled --build || true
# The server's (gpu_server/_fastdecode.c: a record's header and values read off its bytes), likewise: without it the
# server decodes records in Python, with the same jobs.
.venv/bin/python -m gpu_server.compiled --build || true
# The project's own bytecode, written once: an editable install leaves it to the first import, and where
# PYTHONDONTWRITEBYTECODE=1 is set (as on this project's CI machines) every server, replay worker and training
# process would compile the sources again (0.15-0.3 s of each start, measured here). Python checks each file's
# timestamp, so an edited source is compiled afresh as before. Only a saving: a read-only checkout goes on without.
.venv/bin/python -m compileall -q gpu_server npu_agent protos >/dev/null || true
