"""Precision standards (api_precision_compare `比对结果`, docs/standards.md): pure functions of metrics, no I/O.

Each standard is a small module (binary.py, absolute.py, ulp.py, thousandth.py, benchmark.py,
mixed_tolerance.py, quantisation.py), imported below, that registers its judging function in registry.py, with the
ratio columns and limits the HTML report shows for it; selection.py picks one from the output dtype and the API name;
every threshold is in thresholds.py. judging.py applies them to one output (`judge_pair`); it is not imported here,
because it needs gpu_server.judging.metrics, which reads thresholds.py.
"""
from __future__ import annotations

from gpu_server.judging.standards import (  # noqa: F401  (they register)
    absolute,
    benchmark,
    binary,
    mixed_tolerance,
    quantisation,
    thousandth,
    ulp,
)
from gpu_server.judging.standards.registry import (
    STANDARD_REGISTRY,
    Ratio,
    by_algorithm,
    register_standard,
    standard_labels,
)
from gpu_server.judging.standards.selection import (
    ApiJudging,
    api_judging,
    canonical_name,
    configure,
    known_standards,
    select_standard,
    threshold_names,
)
from gpu_server.judging.standards.thresholds import THRESHOLDS

__all__ = ["ApiJudging", "configure", "known_standards", "threshold_names", "api_judging",
           "select_standard", "canonical_name", "register_standard", "Ratio", "by_algorithm", "standard_labels",
           "STANDARD_REGISTRY", "THRESHOLDS"]
