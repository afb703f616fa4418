"""The import graph (docs/design.md §1): `npu_agent` and `gpu_server` depend on `protos` and never on each other;
`protos` depends on neither. Read from the source with `ast` (nothing is imported), so an import inside a function,
behind `TYPE_CHECKING` or through `importlib.import_module("...")` counts too. `examples/`, `tests/` and `bench/`
may import both sides."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> top-level packages of this repository it must never import
FORBIDDEN = {
    "npu_agent": {"gpu_server", "examples", "tests", "bench"},
    "gpu_server": {"npu_agent", "examples", "tests", "bench"},
    "protos": {"npu_agent", "gpu_server", "examples", "tests", "bench"},
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in the file: `import a.b`, `from a.b import c` (relative
    imports resolved against the file's package) and `importlib.import_module("a.b")` / `__import__("a.b")` with a
    literal name."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # `from . import x` / `from pkg import sub`: the names may be modules themselves
            found += [(node.lineno, f"{name}.{alias.name}".lstrip(".")) for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def violations(root: Path, forbidden: dict[str, set[str]]) -> list[str]:
    bad = []
    for package, banned in forbidden.items():
        files = sorted((root / package).rglob("*.py"))
        assert files, f"no Python files under {root / package}"
        for path in files:
            for line, name in imports_of(path, root):
                top = name.split(".")[0]
                if top in banned:
                    bad.append(f"{path.relative_to(root)}:{line} imports {name} ({package} must not depend on {top})")
    return bad


def test_agent_and_server_depend_on_protos_and_never_on_each_other():
    bad = violations(ROOT, FORBIDDEN)
    assert not bad, ("the agent and the server must stay independent siblings over protos/ (docs/design.md §1); "
                     "move what both need into protos/:\n  " + "\n  ".join(bad))


def test_both_sides_do_depend_on_protos():
    for package in ("npu_agent", "gpu_server"):
        tops = {name.split(".")[0] for path in (ROOT / package).rglob("*.py") for _, name in imports_of(path, ROOT)}
        assert "protos" in tops, f"{package} no longer imports protos: is this walker still reading the right files?"


def test_the_demo_lives_outside_the_server_package():
    assert not (ROOT / "gpu_server" / "demo.py").exists()
    assert (ROOT / "examples" / "demo.py").is_file()


@pytest.mark.parametrize("source, expected", [
    ("import gpu_server.cli\n", "gpu_server.cli"),
    ("from gpu_server import spool\n", "gpu_server"),
    ("def f():\n    from gpu_server.columns import X\n", "gpu_server.columns"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gpu_server\n", "gpu_server"),
    ("import importlib\nm = importlib.import_module('gpu_server.reports')\n", "gpu_server.reports"),
    ("import os, gpu_server.spool as sp\n", "gpu_server.spool"),
])
def test_the_walker_sees_every_kind_of_import(tmp_path, source, expected):
    """The check itself can fail: a forbidden import written any of these ways is reported with its line."""
    pkg = tmp_path / "npu_agent" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "npu_agent" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import protos\n" + source)
    bad = violations(tmp_path, {"npu_agent": {"gpu_server"}})
    assert len(bad) >= 1 and all(b.startswith(str(Path("npu_agent/sub/mod.py"))) for b in bad), bad
    assert any(f" imports {expected} " in b for b in bad), bad


# Layers inside the server (issue 24): the shared types and the metrics sit below the intake, the checker, the
# judging and the reports, and import none of them, so that no import runs back up the layers.
LOW_MODULES = {
    "gpu_server/job.py": "a decoded record and the record/call keys (gpu_server.job)",
    "gpu_server/statuses.py": "the status words and their aggregation (gpu_server.statuses)",
    "gpu_server/dtype_limits.py": "the per-dtype parameters of the metrics (gpu_server.dtype_limits)",
    "gpu_server/metrics.py": "the per-output metrics (gpu_server.metrics)",
    "gpu_server/metric_kernel.py": "the metrics' compiled kernel (gpu_server.metric_kernel)",
}
# what they may import of the server: each other and the vocabulary below them
LOW_ALLOWED = {"gpu_server.job", "gpu_server.statuses", "gpu_server.dtype_limits", "gpu_server.metrics",
               "gpu_server.metric_kernel", "gpu_server.collective_info", "gpu_server.columns"}
# what they must never import: above them (named so that the message says which layer was crossed)
HIGH = ("gpu_server.intake", "gpu_server.checker", "gpu_server.standards", "gpu_server.reports",
        "gpu_server.report_files", "gpu_server.summary", "gpu_server.verdict", "gpu_server.workers",
        "gpu_server.replay", "gpu_server.pending")


def layering_violations(root: Path) -> list[str]:
    bad = []
    for rel, what in LOW_MODULES.items():
        path = root / rel
        assert path.is_file(), f"{rel} is gone: update LOW_MODULES"
        for line, name in imports_of(path, root):
            if not name.startswith("gpu_server") or name == "gpu_server":
                continue
            crossed = next((h for h in HIGH if name == h or name.startswith(h + ".")), None)
            if crossed or not any(name == a or name.startswith(a + ".") for a in LOW_ALLOWED):
                bad.append(f"{rel}:{line} imports {name} ({what} sits below {crossed or 'the rest of the server'})")
    return bad


def test_shared_types_and_metrics_import_nothing_above_them():
    bad = layering_violations(ROOT)
    assert not bad, ("the shared types (job, statuses), the dtype limits and the metrics must not import the "
                     "intake, the checker, the standards or the reports; move what they need below them:\n  "
                     + "\n  ".join(bad))


def test_every_user_takes_the_shared_types_from_their_home():
    """One spelling: `Job` and the record/call keys only from gpu_server.job, the status words only from
    gpu_server.statuses (nothing re-exports them)."""
    bad = []
    for top in ("gpu_server", "tests", "bench", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_bytes(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or not node.module:
                    continue
                names = {a.name for a in node.names}
                if node.module != "gpu_server.job" and names & {"Job", "RecordKey", "CallKey", "record_key",
                                                                   "call_key"}:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {sorted(names)} from {node.module}")
                if node.module != "gpu_server.statuses" and names & {"PASS", "WARNING", "ERROR", "SKIP", "STATUSES",
                                                                        "status_of", "aggregate"}:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {sorted(names)} from {node.module}")
    assert not bad, "\n  ".join(["take them from gpu_server.job / gpu_server.statuses:"] + bad)


def test_the_layering_check_sees_a_back_up_import(tmp_path):
    """The check itself can fail: metrics importing the standards again is reported with its line."""
    for rel in LOW_MODULES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("import torch\n")
    (tmp_path / "gpu_server" / "metrics.py").write_text(
        "from gpu_server import metric_kernel\nfrom gpu_server.standards.thresholds import THRESHOLDS\n")
    (tmp_path / "gpu_server" / "job.py").write_text("def f():\n    from gpu_server.intake import decode_job\n")
    bad = layering_violations(tmp_path)
    assert any(b.startswith(str(Path("gpu_server/metrics.py")) + ":2 imports gpu_server.standards.thresholds")
               for b in bad), bad
    assert any(b.startswith(str(Path("gpu_server/job.py")) + ":2 imports gpu_server.intake") for b in bad), bad
    assert {b.split(" imports ")[0] for b in bad} == {str(Path("gpu_server/metrics.py")) + ":2",
                                                       str(Path("gpu_server/job.py")) + ":2"}, bad
