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
    ("import importlib\nm = importlib.import_module('gpu_server.reports.files')\n", "gpu_server.reports.files"),
    ("import os, gpu_server.spool.store as sp\n", "gpu_server.spool.store"),
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


# Floors inside the server (issue 24, docs/design.md §6): each room of gpu_server/ sits on one floor, top to bottom.
# A module may import its own floor and any floor below it, never one above, so that no import runs back up. The
# judging room has two floors: the metrics sit below the standards that judge them. The package root holds the shared
# vocabulary every room takes from (a decoded record, the keys, the status words, the CSV columns, the small file
# helpers) and imports no room.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("the command line", ("gpu_server.cli", "gpu_server.stop_signal")),
    ("the offline tools", ("gpu_server.tools",)),
    ("the server", ("gpu_server.app",)),
    ("the intake", ("gpu_server.intake",)),
    ("the spool", ("gpu_server.spool",)),
    ("the checking", ("gpu_server.checking",)),
    ("the reports", ("gpu_server.reports",)),
    ("the replay", ("gpu_server.replay",)),
    ("the judging", ("gpu_server.judging.standards", "gpu_server.judging.verdict", "gpu_server.judging.output_kind",
                     "gpu_server.judging.nonfinite")),
    ("the metrics", ("gpu_server.judging.metrics", "gpu_server.judging.metric_kernel", "gpu_server.judging.bits",
                     "gpu_server.judging.extremes",
                     "gpu_server.judging.dtype_limits")),
    ("the shared vocabulary", ("gpu_server.config", "gpu_server.job", "gpu_server.decode", "gpu_server.statuses",
                               "gpu_server.columns", "gpu_server.collective_info", "gpu_server.seqset",
                               "gpu_server.atomic_file", "gpu_server.safe_open", "gpu_server.disk",
                               "gpu_server.memcopy", "gpu_server.malloc_policy", "gpu_server.omp_wait",
                               "gpu_server.compiled")),
]
ROOM_PACKAGES = {"gpu_server", "gpu_server.intake", "gpu_server.spool", "gpu_server.checking", "gpu_server.replay",
                 "gpu_server.judging", "gpu_server.reports", "gpu_server.tools"}   # their __init__ is a docstring


def floor_of(module: str) -> int | None:
    """The floor (0 = top) of a server module, by its longest listed prefix; None for a room package itself."""
    best, level = -1, None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    return level


def server_modules(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted((root / "gpu_server").rglob("*.py"))}


def layering_violations(root: Path) -> list[str]:
    bad = []
    for module, path in server_modules(root).items():
        if module in ROOM_PACKAGES:
            continue
        own = floor_of(module)
        if own is None:
            bad.append(f"{path.relative_to(root)} is on no floor: add it to FLOORS (tests/test_import_graph.py)")
            continue
        for line, name in imports_of(path, root):
            if not name.startswith("gpu_server.") or name in ROOM_PACKAGES:
                continue
            there = floor_of(name)
            if there is not None and there < own:
                bad.append(f"{path.relative_to(root)}:{line} imports {name} ({FLOORS[own][0]} sits below "
                           f"{FLOORS[there][0]})")
    return bad


def test_no_server_import_runs_back_up_the_floors():
    bad = layering_violations(ROOT)
    assert not bad, ("gpu_server's rooms import only their own floor and the floors below (docs/design.md §6); "
                     "move what a lower floor needs below it:\n  " + "\n  ".join(bad))


def test_every_room_is_a_folder_and_the_root_holds_only_the_top_and_the_vocabulary():
    rooms = {p.name for p in (ROOT / "gpu_server").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == {"intake", "spool", "checking", "replay", "judging", "reports", "tools"}, rooms
    root_modules = {p.stem for p in (ROOT / "gpu_server").glob("*.py")} - {"__init__"}
    listed = {m.split(".")[1] for _, prefixes in FLOORS for m in prefixes if m.count(".") == 1}
    assert root_modules <= listed, f"modules at the package root on no floor: {sorted(root_modules - listed)}"


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
    """The check itself can fail: the metrics importing the standards, the shared Job importing the intake, and a
    module on no floor are each reported with their line."""
    for rel in ("gpu_server/__init__.py", "gpu_server/judging/__init__.py", "gpu_server/intake/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "gpu_server" / "judging" / "metrics.py").write_text(
        "from gpu_server.judging import metric_kernel\nfrom gpu_server.judging.standards.thresholds import T\n")
    (tmp_path / "gpu_server" / "job.py").write_text("def f():\n    from gpu_server.intake.admission import Intake\n")
    (tmp_path / "gpu_server" / "intake" / "admission.py").write_text("from gpu_server.job import Job\n")
    (tmp_path / "gpu_server" / "stray.py").write_text("")
    bad = layering_violations(tmp_path)
    metrics, job = str(Path("gpu_server/judging/metrics.py")), str(Path("gpu_server/job.py"))
    assert any(b.startswith(metrics + ":2 imports gpu_server.judging.standards.thresholds") for b in bad), bad
    assert any(b.startswith(job + ":2 imports gpu_server.intake.admission") for b in bad), bad
    assert any(b.startswith(str(Path("gpu_server/stray.py")) + " is on no floor") for b in bad), bad
    assert {b.split(" ")[0] for b in bad} == {metrics + ":2", job + ":2", str(Path("gpu_server/stray.py"))}, bad
