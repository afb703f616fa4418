"""The server's extension file (issue 23, docs/extensions.md): references for custom torch.library operators,
post-processing of outputs and per-API judging, given to the server by its operator (`--extensions FILE`).

A real training (examples/extensions/train_custom.py, the worked example of docs/extensions.md) calls two custom
operators, `mylib::fused_gelu` (with register_fake and register_autograd) and `mylib::grouped_rows(x, count)`
(writes only the first `count` rows, the others stale), against real servers: without the file both are SKIP naming
it; with it the correct operators pass forward and backward, a planted bug in fused_gelu is an error, and the stale
rows never give a false alarm (they do without [[postprocess]]); a [[judge]] section changes a verdict on
`gpu-server recheck`. Bad files are refused at start, one line per problem."""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import support

GPU_SERVER = os.path.join(os.path.dirname(support.PY), "gpu-server")
TRAINING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "extensions",
                        "train_custom.py")
GELU, ROWS = "Custom.mylib.fused_gelu", "Custom.mylib.grouped_rows"

REFS = '''
import math
import torch


def fused_gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def fused_gelu_backward(grad_outputs, x):
    (grad,) = grad_outputs
    cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    return (grad * (cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)),)


def grouped_rows(x, count):
    return 2.0 * torch.sin(x)


NOT_CALLABLE = 3
'''

REFERENCES = '''
[[reference]]
op = "mylib::fused_gelu"
forward = "ext_refs:fused_gelu"
backward = "ext_refs:fused_gelu_backward"

[[reference]]
op = "mylib::grouped_rows"
forward = "ext_refs:grouped_rows"
'''
POSTPROCESS = '''
[[postprocess]]
op = "mylib::grouped_rows"
output = 0
rows_from_arg = "count"
'''
# a tolerance that a 2^-8 relative error passes: the planted bug's error becomes a pass for api_precision_compare
LENIENT = '''
[[judge]]
api = "Custom.mylib.fused_gelu"
standard = "mixed_tolerance"
[judge.thresholds.float32]
atol = 0.01
rtol = 0.01
floor = 0.05
'''


def _write(folder, name: str, text: str) -> str:
    path = os.path.join(str(folder), name)
    with open(path, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o644)
    return path


@pytest.fixture(scope="module")
def ext_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ext")
    os.chmod(folder, 0o755)
    _write(folder, "ext_refs.py", REFS)
    _write(folder, "full.toml", REFERENCES + POSTPROCESS)
    _write(folder, "judged.toml", REFERENCES + LENIENT)     # no [[postprocess]]: the stale rows are compared
    return folder


def _run(work: str, args: list[str], env: dict | None = None) -> str:
    server = support.Server(work, args=["--keep-records", *args]).start()
    try:
        config = support.agent_config(os.path.join(work, "agent.json"), server.port)
        support.run_training(open(TRAINING).read(), config, "1", env=env, timeout=120)
    finally:
        code = server.stop()
    assert code == 0, server.log()
    return server.out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ext_dir):
    """(plain, good, buggy), made at once: the training against a server without the file; against a server with it
    (replays in worker processes, which load the file too); with the planted bug against a server with it (replays
    in the server's own thread). Every one with --keep-records."""
    full = str(ext_dir / "full.toml")
    jobs = [([], None), (["--extensions", full], None),
            (["--extensions", full, "--replay-in", "thread"], {"OCHECK_GELU_BUG": "1"})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_run, str(tmp_path_factory.mktemp(f"run{i}")), args, env)
                   for i, (args, env) in enumerate(jobs)]
        return tuple(f.result() for f in futures)


def _results(out: str) -> dict[str, dict[str, tuple[str, str]]]:
    """{report: {call: (forward, backward)}} for the custom operators' calls."""
    found = {}
    for kind in ("accuracy_checking_result", "api_precision_compare_result"):
        rows = support.read_csv(out, kind)
        name = "API name" if kind == "accuracy_checking_result" else "API Name"
        found[kind] = {r[name]: (r["Forward Test Success"], r["Backward Test Success"]) for r in rows
                       if r[name].startswith("Custom.")}
    return found


def _details(out: str) -> list[dict]:
    return [r for r in support.read_csv(out, "accuracy_checking_details") if r["API Name"].startswith("Custom.")]


def _recheck(out: str, toml: str, dest: str) -> str:
    """`gpu-server recheck OUT --extensions FILE` (its replays in worker processes)."""
    proc = subprocess.run([GPU_SERVER, "recheck", out, "--device", "cpu", "--extensions", toml, "-o", dest],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dest


def test_without_the_file_custom_operators_are_skip_naming_it(runs):
    plain = runs[0]
    details = _details(plain)
    assert {r["API Name"].rsplit(".", 4)[0] for r in details} == {GELU, ROWS}, details
    for row in details:
        assert row["Status"] == "SKIP", row
        op = row["API Name"].split(".")[2]
        assert f"no reference for the custom operator mylib::{op}; give one in the server's extension file" \
               in row["Message"], row


def test_with_the_file_correct_custom_operators_pass_forward_and_backward(runs):
    good = runs[1]   # its replays ran in worker processes: they loaded the file too
    for kind, calls in _results(good).items():
        assert len(calls) == 2, (kind, calls)   # one step, two operators
        assert all(v == ("pass", "pass") for v in calls.values()), (kind, calls)
    compared = [r for r in _details(good) if r["API Name"].startswith(ROWS) and ".forward." in r["API Name"]]
    assert compared and all(r["Shape"] == "(3, 16)" for r in compared), compared   # the first `count` rows only


def test_with_the_file_a_planted_bug_is_an_error_and_stale_rows_no_false_alarm(runs):
    buggy = runs[2]
    for kind, calls in _results(buggy).items():
        gelu = {k: v for k, v in calls.items() if k.startswith(GELU)}
        rows = {k: v for k, v in calls.items() if k.startswith(ROWS)}
        assert gelu and rows, calls
        assert all(fwd == "error" for fwd, _ in gelu.values()), (kind, gelu)   # the 2^-8 scale
        assert all(bwd == "pass" for _, bwd in gelu.values()), (kind, gelu)    # its backward kernel is right
        assert all(v == ("pass", "pass") for v in rows.values()), (kind, rows)  # stale rows cut by [[postprocess]]


def test_a_judge_section_flips_a_verdict_and_without_postprocess_stale_rows_fail(runs, ext_dir, tmp_path):
    buggy = runs[2]
    out = _recheck(buggy, str(ext_dir / "judged.toml"), str(tmp_path / "judged"))
    precision = _results(out)["api_precision_compare_result"]
    gelu = {k: v for k, v in precision.items() if k.startswith(GELU)}
    assert gelu and all(fwd == "pass" for fwd, _ in gelu.values()), gelu   # error with the built-in standard
    rows = {k: v for k, v in precision.items() if k.startswith(ROWS)}
    assert rows and all(fwd == "error" for fwd, _ in rows.values()), rows  # the stale rows, compared


# -- refusals --------------------------------------------------------------------------------------------------------
BAD = '''
colour = "blue"

[[reference]]
op = "mylib.fused_gelu"
forward = "ext_refs:fused_gelu"
speed = 3

[[reference]]
op = "mylib::two"
forward = "no_such_module_xyz:f"

[[reference]]
op = "mylib::three"
forward = "ext_refs:NOT_CALLABLE"

[[reference]]
op = "mylib::grouped_rows"
forward = "ext_refs:grouped_rows"

[[postprocess]]
op = "mylib::grouped_rows"
rows_from_arg = "group_sizes"

[[judge]]
api = "Functional.gelu"
standard = "no_such_standard"
tier = "L7"
'''
BAD_LINES = [
    "colour: unknown section or key",
    "reference[0].speed: unknown key",
    "reference[0].op: 'mylib.fused_gelu' is not a custom operator name 'namespace::op'",
    "reference[1].forward: cannot import module no_such_module_xyz (ModuleNotFoundError",
    "reference[2].forward: ext_refs:NOT_CALLABLE is not callable",
    "postprocess[0].rows_from_arg: Custom.mylib.grouped_rows has no argument 'group_sizes' (its arguments: x, count)",
    "unknown standard 'no_such_standard'",
    "unknown tier 'L7'",
]


def test_a_bad_file_is_refused_at_start_with_one_line_per_problem(ext_dir, tmp_path):
    from gpu_server.replay import extensions

    bad = _write(ext_dir, "bad.toml", BAD)
    with pytest.raises(extensions.ExtensionError) as info:
        extensions.parse(bad)
    lines = str(info.value).splitlines()
    assert lines[0] == f"invalid extension file {bad}:"
    for expected in BAD_LINES:
        assert sum(expected in line for line in lines[1:]) == 1, (expected, lines)
    assert len(lines) == 1 + len(BAD_LINES), lines
    assert extensions.active() is None

    config = support.server_config(str(tmp_path / "server.json"), support.free_port())
    proc = subprocess.run([GPU_SERVER, "--config", config, "--out", str(tmp_path / "out"), "--extensions", bad],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"gpu-server: invalid extension file {bad}:" in proc.stderr
    for expected in BAD_LINES:
        assert expected in proc.stderr, (expected, proc.stderr)


def test_a_file_or_folder_writable_by_others_is_refused(tmp_path):
    from gpu_server.replay import extensions

    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o755)
    path = _write(folder, "ext.toml", "")
    assert extensions.parse(path).references == {}
    os.chmod(path, 0o664)
    with pytest.raises(extensions.ExtensionError, match=r"ext.toml is writable by its group or by others \(mode 664\)"):
        extensions.parse(path)
    os.chmod(path, 0o644)
    os.chmod(folder, 0o777)
    with pytest.raises(extensions.ExtensionError, match="its folder .* is writable by its group or by others"):
        extensions.parse(path)


def test_arguments_are_still_checked_by_kind_and_strings_only_when_declared(ext_dir, tmp_path):
    import torch

    from gpu_server.replay import extensions, registry

    path = _write(ext_dir, "strings.toml", REFERENCES + '[[reference]]\nop = "mylib::mode"\n'
                  'forward = "ext_refs:grouped_rows"\nstrings = { count = ["all"] }\n')
    extensions.load(path)
    try:
        x = torch.ones(2, 2)
        assert registry.replayable("Custom", "mylib.fused_gelu", (x,)) is None
        assert registry.replayable("Custom", "mylib.grouped_rows", (x, 1)) is None
        assert "string 'all' as parameter 'count'" in registry.replayable("Custom", "mylib.grouped_rows", (x, "all"))
        assert registry.replayable("Custom", "mylib.mode", (x, "all")) is None
        assert "not one of the values" in registry.replayable("Custom", "mylib.mode", (x, "some"))
        assert "an argument of type dict" in registry.replayable("Custom", "mylib.fused_gelu", ({"a": x},))
        assert "no reference for the custom operator mylib::other" in registry.replayable("Custom", "mylib.other",
                                                                                           (x,))
        fn = registry.resolve("Custom", "mylib.fused_gelu")   # the file's backward, through autograd
        t = torch.randn(5, dtype=torch.float64, requires_grad=True)
        fn(t).sum().backward()
        ref = t.detach().clone().requires_grad_()
        torch.nn.functional.gelu(ref).sum().backward()
        assert torch.allclose(t.grad, ref.grad)
    finally:
        extensions.uninstall()
    assert registry.replayable("Custom", "mylib.fused_gelu", (torch.ones(1),)) is not None


def test_the_server_config_names_the_file_relative_to_its_own_folder(tmp_path):
    import json

    from gpu_server.config import ServerConfigError, load_server_config, parse_server_config

    path = support.server_config(str(tmp_path / "server.json"), 50051, extensions="ext/extensions.toml")
    assert load_server_config(path).extensions == str(tmp_path / "ext" / "extensions.toml")
    with open(path) as fh:
        raw = json.load(fh)
    raw["run_ut"]["extensions"] = 3
    with pytest.raises(ServerConfigError, match="run_ut.extensions: 3 is not a string path"):
        parse_server_config(raw)
