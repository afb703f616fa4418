"""One report vocabulary (issue 24): the report files' names and the detail rows' names are spelled in one home,
gpu_server/reports/files.py, and nowhere else in the source; each precision standard declares the ratio columns and
limits the HTML report shows for it (gpu_server/judging/standards/registry.py), so gpu_server/reports/html.py names no
standard and a new standard needs no edit there.

Read from the source with `ast` (nothing is imported for the scan): every string literal but docstrings, an f-string
as its text with `{}` for each value. Forbidden outside the home:
- a report file's name: a per-rank kind as a word (`"accuracy_checking_result"`), any report stem followed by a
  file name's variable part (`summary_{ts}.json`, `api_bias_*.csv`, `report_{ts}.html`, a regex `..._(\\d{14})`),
  a per-rank file's shape (`_rank*.csv`);
- taking a row name apart: its infix spelled (`.forward.output.`, `\\.output\\.` in a pattern), a comparison with
  the word "output", `rsplit(".", 3)` (the tail `direction.output.index`).
Messages, help texts and docstrings may still name the files in words. Tests and docker/test.sh spell msprobe's
names on purpose (they check the contract users see) and are not scanned. Each check is shown to fail on a planted
file."""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from gpu_server.reports import files as report_files

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("gpu_server", "npu_agent", "protos", "bench", "examples")
HOME = "gpu_server/reports/files.py"
# Spellings still to move, in files whose owners move them (issue 24): (file, literal) -> the replacement. An entry
# that is no longer found fails test_pending_spellings_are_still_there: delete it then.
PENDING: dict[tuple[str, str], str] = {}


def _stem(path_of) -> str:
    """The stem of a report file the home names by session: "summary" of summary_{ts}.json."""
    return os.path.basename(path_of("", "TS")).split("_TS")[0]


STEMS = report_files.RANK_KINDS + tuple(_stem(f) for f in (report_files.summary_path, report_files.api_bias_path,
                                                           report_files.html_path))
_VARIABLE = r"(?:\{\}|\*|\(|\\d|\[|[0-9]|\Z)"   # a value, a glob, a regex group or class, a date, or a prefix
FORBIDDEN_TEXT = [
    (re.compile(r"\A(?:" + "|".join(report_files.RANK_KINDS) + r")\Z"), "a report kind spelled"),
    (re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join(STEMS) + r")_" + _VARIABLE), "a report file name spelled"),
    (re.compile(r"_rank(?:\{\}|\*|\(|\\d|[0-9]).*\.csv"), "a per-rank report file name spelled"),
    (re.compile(r"\.(?:forward|backward|\{\})\.output\."), "a row name's infix spelled"),
    (re.compile(r"output\\\."), "a row name's pattern spelled"),
]


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _texts(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string literal but docstrings; an f-string whole, `{}` for each value."""
    docs, inside = _docstrings(tree), set()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            inside.update(id(v) for v in node.values)
            out.append((node.lineno, text))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs | inside:
            out.append((node.lineno, node.value))
    return out


def _splits_a_row(node: ast.AST) -> str | None:
    if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "output"
                                             for c in [node.left, *node.comparators]):
        return "a comparison with \"output\" (a row name taken apart)"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rsplit" \
            and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == ".":
        limit = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords
                                                              if k.arg in ("n", "maxsplit")), None)
        if isinstance(limit, ast.Constant) and limit.value == 3:
            return "rsplit(\".\", 3) (a row name's tail cut off)"
    return None


def violations(root: Path, home: str = HOME, pending=frozenset()) -> list[str]:
    bad = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == home:
                continue
            tree = ast.parse(path.read_bytes(), filename=rel)
            for line, text in _texts(tree):
                if (rel, text) in pending:
                    continue
                for pattern, what in FORBIDDEN_TEXT:
                    if pattern.search(text):
                        bad.append(f"{rel}:{line}: {what}: {text[:80]!r}")
            for node in ast.walk(tree):
                what = _splits_a_row(node)
                if what:
                    bad.append(f"{rel}:{node.lineno}: {what}")
    return bad


def test_report_names_are_spelled_in_their_home_only():
    bad = violations(ROOT, pending=frozenset(PENDING))
    assert not bad, (f"report file names and row names live in {HOME} (name, path, rank_glob, summary_path, "
                     "api_bias_path, html_path, row_name, split_row_name, ROW_NAME); use them:\n  "
                     + "\n  ".join(bad))


def test_pending_spellings_are_still_there():
    for (rel, literal), replacement in PENDING.items():
        texts = [t for _, t in _texts(ast.parse((ROOT / rel).read_bytes()))]
        assert literal in texts, f"{rel} no longer spells {literal!r} (now {replacement}?): delete its PENDING entry"


def test_the_home_still_spells_them():
    """The scan would pass vacuously if the vocabulary moved: the home itself matches the patterns."""
    tree = ast.parse((ROOT / HOME).read_bytes())
    texts = [t for _, t in _texts(tree)]
    for pattern, what in FORBIDDEN_TEXT:
        assert any(pattern.search(t) for t in texts), f"{HOME} no longer has {what}: update FORBIDDEN_TEXT"


PLANTED = {
    "kind": 'rows = read(out, "accuracy_checking_details", 0)\n',
    "glob": 'import glob, os\npaths = glob.glob(os.path.join(out, "collective_result_*_rank0.csv"))\n',
    "f-string": 'name = f"summary_{ts}.json"\n',
    "html": 'name = f"report_{ts}.html"\n',
    "concatenated": 'name = "api_bias_" + ts + ".csv"\n',
    "rank shape": 'pattern = prefix + "_*_rank*.csv"\n',
    "file regex": 'import re\nFILE = re.compile(r"^api_precision_compare_result_(\\d{14})_rank(\\d+)\\.csv$")\n',
    "row regex": 'import re\nROW = re.compile(r"^(?P<call>.+)\\.(?P<direction>forward|backward)\\.output\\.(\\d+)$")\n',
    "row built": 'row = f"{call}.forward.output.{i}"\n',
    "row split": 'parts = name.split(".")\nvalid = parts[-2] == "output"\n',
    "row tail": 'call = name.rsplit(".", n=3)[0]\n',
    "row tail positional": 'call = name.rsplit(".", 3)[0]\n',
}


@pytest.mark.parametrize("case", PLANTED)
def test_a_planted_literal_is_caught(tmp_path, case):
    """The check itself can fail: each way of spelling a report name outside its home is reported with its file."""
    (tmp_path / "gpu_server").mkdir()
    (tmp_path / "gpu_server" / "planted.py").write_text('"""Docstrings may name accuracy_checking_result_{ts}."""\n'
                                                        + PLANTED[case])
    for top in SCANNED[1:]:
        (tmp_path / top).mkdir()
    bad = violations(tmp_path)
    assert bad and all(b.startswith("gpu_server/planted.py:") for b in bad), bad


def test_words_about_the_files_are_not_caught(tmp_path):
    """Docstrings, messages and help texts that name a report in words, and the home's own use, pass."""
    (tmp_path / "gpu_server").mkdir()
    for top in SCANNED[1:]:
        (tmp_path / top).mkdir()
    (tmp_path / "gpu_server" / "fine.py").write_text(
        '"""Reads accuracy_checking_details_{ts}_rank{r}.csv and summary_{ts}.json."""\n'
        'from gpu_server import report_files\n'
        'def f(out, ts):\n'
        '    """The api_bias_{ts}.csv of a session."""\n'
        '    hint = "give an accuracy_checking_details CSV a server wrote"\n'
        '    help_text = "HTML file to write (default OUT/report_{ts}.html)"\n'
        '    print(f"  forward.output.{0}: pass")\n'
        '    return report_files.path(out, report_files.DETAILS, ts, 0), hint, help_text\n')
    assert violations(tmp_path) == []


# -- the standards' report vocabulary ---------------------------------------------------------------------------
def test_every_standard_declares_what_the_html_report_shows():
    from gpu_server.columns import METRIC_COLUMNS, PRECISION_DETAILS_HEADER, PRECISION_EXTRA_COLUMNS
    from gpu_server.judging.standards import STANDARD_REGISTRY

    for key, standard in STANDARD_REGISTRY.items():
        assert standard.ratios, f"standard {key!r} declares no ratio columns for the HTML report"
        for column, limit in standard.ratios:
            assert column in PRECISION_DETAILS_HEADER or column in PRECISION_EXTRA_COLUMNS, (key, column)
            assert isinstance(limit, float) and limit >= 0, (key, column, limit)
        assert standard.device_error is None or standard.device_error in dict(METRIC_COLUMNS), key


def test_the_html_report_names_no_standard():
    """gpu_server/reports/html.py spells no algorithm name and no ratio column: it reads them from the registry."""
    from gpu_server.judging.standards import STANDARD_REGISTRY

    words = {s.algorithm for s in STANDARD_REGISTRY.values()} | {
        column for s in STANDARD_REGISTRY.values() for column, _ in s.ratios}
    tree = ast.parse((ROOT / "gpu_server" / "reports" / "html.py").read_bytes())
    spelled = sorted({t for _, t in _texts(tree) if t in words})
    assert not spelled, f"gpu_server/reports/html.py spells the standards' vocabulary {spelled}: declare it in the " \
                        "standard's register_standard(ratios=..., device_error=...)"


def test_a_new_standard_reaches_the_html_report_without_an_edit(tmp_path):
    """A standard registered at run time (as an extension file may) gets its label, its histogram with its limit
    and its worst ratio per step in the page."""
    from gpu_server.columns import DETAILS_HEADER, PRECISION_DETAILS_HEADER, PRECISION_RESULT_HEADER, RESULT_HEADER
    from gpu_server.judging.standards import STANDARD_REGISTRY, Ratio, register_standard
    from gpu_server.reports.html import render

    register_standard("test_vocabulary", "测试比对法", "vocabulary test", ratios=(Ratio("双千指标", 0.5),),
                      device_error="cosine")(lambda inp: None)
    try:
        out = tmp_path / "out"
        out.mkdir()
        ts, call = "20250101120000", "Functional.gelu.0"
        row = report_files.row_name(call, "forward", 0)

        def write(kind, header, cells):
            with open(report_files.path(str(out), kind, ts, 0), "w", encoding="utf-8-sig") as fh:
                fh.write(",".join(header) + "\n" + ",".join(cells.get(c, " ") for c in header) + "\n")

        write(report_files.RESULT, RESULT_HEADER, {"API name": call, "Forward Test Success": "error"})
        write(report_files.PRECISION_RESULT, PRECISION_RESULT_HEADER,
              {"API Name": call, "Forward Test Success": "error"})
        write(report_files.DETAILS, DETAILS_HEADER, {"API Name": row, "余弦相似度": "0.25", "Status": "error"})
        write(report_files.PRECISION_DETAILS, PRECISION_DETAILS_HEADER,
              {"API Name": row, "双千指标": "0.125", "比对结果": "error", "比对算法": "测试比对法"})
        text = render(str(out))
    finally:
        STANDARD_REGISTRY.pop("test_vocabulary")
    assert "<td>vocabulary test</td><td>双千指标 0.125</td>" in text
    assert "forward &middot; 测试比对法 &middot; 1 output rows" in text
    assert "threshold 0.5" in text
    assert "余弦相似度 (device vs bench), log scale" in text
