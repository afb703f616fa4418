"""What the server writes: the per-rank CSVs, their names and columns read back, the summary, the HTML report, error
data and the progress line (docs/design.md §6.6)."""


def load(out_dir: str, kind: str = "details"):
    """The reports of `out_dir` as one pandas DataFrame over every rank and step (gpu_server/reports/frame.py; pandas
    is imported only here, when asked)."""
    from gpu_server.reports.frame import load as _load

    return _load(out_dir, kind)
