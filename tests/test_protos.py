"""The generated protobuf/gRPC modules are reproducible from protos/online_check.proto."""
import subprocess
import sys

from tests.support import ROOT


def test_committed_generated_code_is_not_stale():
    proc = subprocess.run([sys.executable, "-m", "protos.regen", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
