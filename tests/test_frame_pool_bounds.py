"""The frame pool lengthens a reused frame up to its size class (npu_agent/payload.py `frame_class`): never past
the memory allocated for it. CPython's debug allocator (PYTHONMALLOC=debug) puts guard bytes after every block and
aborts when a block is freed with them overwritten; the frame pool's tests, the folder transport's read-back and the
compiled encoding's tests (npu_agent/_fastencode.c writes records into buffers of its own) run under it here, in a
subprocess. (A frame allocated at its exact length and then lengthened aborts it.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from npu_agent import payload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(payload._SIZE_SLOT is None, reason="frames are lengthened on CPython only")
def test_reused_frames_stay_inside_their_memory_under_the_debug_allocator(tmp_path):
    env = dict(os.environ, PYTHONMALLOC="debug", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          os.path.join(ROOT, "tests", "test_frame_pool.py"),
                          os.path.join(ROOT, "tests", "test_folder_zero_copy.py"),
                          os.path.join(ROOT, "tests", "test_fastencode.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout
