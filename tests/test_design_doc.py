"""The docs name files that exist (issue 24, item 5): every repository path written in backticks in docs/*.md and the
README (`gpu_server/checking/collectives.py`, `tests/test_fused.py`, `examples/extensions/extensions.toml`) is a file or
folder of this repository, so "how to extend" (docs/design.md §7) cannot drift from the tree unnoticed. Paths with
a wildcard (`npu_agent/transport_*.py`) must match at least one file; paths of what a run writes (`--out/spool/`,
`{error_data_path}/...`, `docker/out/`) are not repository paths: left out by their roots or by .gitignore."""
from __future__ import annotations

import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("npu_agent/", "gpu_server/", "protos/", "tests/", "bench/", "docs/", "examples/", "docker/", "scripts/",
         "certs/")
_PATH = re.compile(r"`([A-Za-z0-9_./*-]+)`")


def _docs() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]


def named_paths(text: str) -> set[str]:
    found = set()
    for m in _PATH.finditer(text):
        p = m.group(1).rstrip(".")
        if p.startswith(ROOTS) and "/" in p and not p.endswith("/.") and "{" not in p:
            found.add(p)
    return found


def _written_by_a_run(path: str) -> bool:
    """An output folder the tree ignores (`docker/out/`): named by the docs, made by a run."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


@pytest.mark.parametrize("doc", _docs(), ids=os.path.basename)
def test_every_path_a_doc_names_exists(doc):
    with open(doc, encoding="utf-8") as fh:
        paths = named_paths(fh.read())
    missing = [p for p in sorted(paths) if not glob.glob(os.path.join(ROOT, p)) and not _written_by_a_run(p)]
    assert not missing, f"{os.path.relpath(doc, ROOT)} names paths that do not exist: {missing}"


def test_design_how_to_extend_names_files():
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text[text.index("## 7. How to extend"):text.index("## 8.")]
    items = [block for block in section.split("\n- **")[1:]]
    assert len(items) >= 6, "§7 lost its recipes"
    for item in items:
        assert len(named_paths(item)) >= 3, f"a recipe of §7 names fewer than 3 files: {item[:80]!r}"
