"""Which precision standard judges an output (docs/standards.md): by output dtype, then by API name.

Integer and bool outputs (and Python scalars) -> binary consistency. Otherwise the API name is reduced to one
canonical spelling, so that the bare name, the method, the in-place method, the dunder and its in-place/reflected
forms, the Python-3 operator spellings and an aten overload all select alike:
    mul, mul_, __mul__, __imul__, __rmul__, mul.Tensor        -> mul
    div, div_, __div__, __idiv__, __rdiv__, __truediv__, __itruediv__, __rtruediv__ -> div
    sub, sub_, __sub__, __isub__, __rsub__                    -> sub      (rsub, the torch function, stays rsub)
The name lists are docs/standards.md's, verbatim; every name not listed (all npu_* fused ops included) -> benchmark.
float8 outputs (float8_e4m3fn, float8_e5m2) -> mixed tolerance, except the binary-consistency names (exact ops).

A server operator overrides the choice per API (`configure`, called at start-up from the extension file,
docs/extensions.md): another standard, the benchmark standard's tier (L0/L1/L2), thresholds per dtype.
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Mapping

import torch

ABSOLUTE, BINARY, ULP, THOUSANDTH, BENCHMARK = "absolute", "binary", "ulp", "thousandth", "benchmark"
MIXED_TOLERANCE, QUANTISATION = "mixed_tolerance", "quantisation"
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

_NAME_LISTS: dict[str, tuple[str, ...]] = {
    ABSOLUTE: (
        "mul", "mul_", "__mul__", "__imul__", "__rmul__", "add", "add_", "__add__", "__iadd__", "__radd__", "div",
        "div_", "__div__", "__idiv__", "divide", "divide_", "leaky_relu", "leaky_relu_", "prelu", "reciprocal",
        "reciprocal_", "rsqrt", "rsqrt_", "square", "square_", "sub", "sub_", "rsub", "__isub__", "__sub__",
        "__truediv__", "__rtruediv__", "__rsub__",
    ),
    BINARY: (
        "abs", "abs_", "absolute", "absolute_", "argmin", "bitwise_and", "bitwise_and_", "broadcast_to", "ceil",
        "ceil_", "equal", "fill_", "flatten", "floor", "floor_", "gather", "greater", "greater_", "greater_equal",
        "greater_equal_", "histc", "isfinite", "isnan", "less", "less_", "less_equal", "less_equal_", "logical_and",
        "logical_and_", "logical_not", "logical_not_", "logical_or", "logical_or_", "masked_fill", "masked_fill_",
        "max_pool3d", "maximum", "minimum", "neg", "neg_", "nonzero", "not_equal", "not_equal_", "one_hot", "pad",
        "relu", "reshape", "round", "round_", "select", "sign", "sign_", "sort", "tile", "topk", "transpose",
        "transpose_", "tril", "tril_", "triu", "triu_", "type_as",
    ),
    ULP: (
        "__matmul__", "addbmm", "addbmm_", "addmm", "addmm_", "baddbmm", "baddbmm_", "bilinear", "bmm",
        "chain_matmul", "hspmm", "linear", "matmul", "mm", "mv", "smm", "sspaddmm",
    ),
    THOUSANDTH: ("conv1d", "conv2d"),
}

# Binary operators whose dunders have in-place (__iX__) and reflected (__rX__) forms.
_OPERATOR_DUNDERS = frozenset({"add", "sub", "mul", "div", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
                               "xor", "lshift", "rshift"})
# Dunder spellings whose torch name differs.
_DUNDER_TO_TORCH = {"truediv": "div", "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor"}


def canonical_name(api_name: str) -> str:
    """One spelling per operation: drop an aten overload (`mul.Tensor`), unwrap dunders (with their in-place and
    reflected forms), map Python-3 operator names to torch's, drop the in-place trailing underscore."""
    name = api_name.strip().split(".", 1)[0]
    if len(name) > 4 and name.startswith("__") and name.endswith("__"):
        inner = name[2:-2]
        if inner[:1] in ("i", "r") and inner[1:] in _OPERATOR_DUNDERS:
            inner = inner[1:]
        return _DUNDER_TO_TORCH.get(inner, inner)
    if len(name) > 1 and name.endswith("_") and not name.endswith("__"):
        return name[:-1]
    return name


def _build_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for standard, names in _NAME_LISTS.items():
        for name in names:
            key = canonical_name(name)
            if table.setdefault(key, standard) != standard:
                raise ValueError(f"{name!r} selects both {table[key]} and {standard}")
    return table


SELECTION_TABLE: dict[str, str] = _build_table()


def select_standard(api_name: str, dtype: torch.dtype | None, judging: ApiJudging | None = None) -> str:
    """The standard key for an output of `dtype` (None: a Python scalar) from API `api_name` (bare name), honouring
    a per-API `judging` (see `api_judging`): a configured standard judges float outputs; integer/bool outputs keep
    binary consistency unless the configured standard is quantisation."""
    if dtype is None:
        return BINARY
    is_float = dtype.is_floating_point or dtype.is_complex
    if judging is not None and judging.standard is not None:
        if is_float or judging.standard == QUANTISATION:
            return judging.standard
        return BINARY
    if not is_float:
        return BINARY
    key = SELECTION_TABLE.get(canonical_name(api_name), BENCHMARK)
    if dtype in FP8_DTYPES and key != BINARY:
        return MIXED_TOLERANCE
    return key


# -- per-API judging (docs/standards.md, "Selecting a standard per API") ---------------------------------------------
TIERS = ("L0", "L1", "L2")

# The threshold names each standard accepts in ApiJudging.thresholds (per dtype name). small_value, small_atol, rtol
# and ulp_threshold are the metrics' own parameters: an API that overrides them gets its metrics computed again with
# them (gpu_server/judging/standards/judging.py).
THRESHOLD_NAMES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    ABSOLUTE: ("small_value", "small_atol", "rtol"),
    BENCHMARK: ("small_value", "small_atol", "ratio_floor", "small_value_ratio_limit", "rmse_ratio_limit",
                "max_rel_ratio_limit", "mean_rel_ratio_limit"),
    BINARY: (),
    MIXED_TOLERANCE: ("atol", "rtol", "floor", "pass_rate", "max_ulp"),
    QUANTISATION: ("max_diff",),
    THOUSANDTH: ("pass_share",),
    ULP: ("ulp_threshold", "ratio_floor", "ulp_share_limit", "ulp_mean_limit"),
})
METRIC_PARAMETERS = {ABSOLUTE: ("small_value", "small_atol", "rtol"), BENCHMARK: ("small_value", "small_atol"),
                     ULP: ("ulp_threshold",)}
_SHARES = {"pass_rate", "pass_share", "ulp_share_limit"}   # must lie in [0, 1]
FLOAT_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
INTEGER_DTYPE_NAMES = ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")


@dataclasses.dataclass(frozen=True)
class ApiJudging:
    """How one API is judged (api_precision_compare), when not by the built-in choice."""

    standard: str | None = None          # a key of known_standards(); None: the built-in choice
    tier: str | None = None              # "L0" | "L1" | "L2": the benchmark standard's ratio limits; None: L0
    # per dtype name ("float16"): threshold name (threshold_names(standard)) -> value
    thresholds: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)


_configured: Mapping[str, ApiJudging] = MappingProxyType({})


def known_standards() -> list[str]:
    """The registered standards' keys (what ApiJudging.standard accepts)."""
    import gpu_server.judging.standards  # noqa: F401  (its modules register the standards)
    from gpu_server.judging.standards.registry import STANDARD_REGISTRY

    return sorted(STANDARD_REGISTRY)


def threshold_names(standard: str) -> list[str]:
    """The threshold names `standard` accepts in ApiJudging.thresholds; ValueError for an unknown standard."""
    if standard not in known_standards():
        raise ValueError(f"unknown precision standard {standard!r}: use one of {', '.join(known_standards())}")
    return list(THRESHOLD_NAMES.get(standard, ()))


def configure(per_api: Mapping[str, ApiJudging]) -> None:
    """Set how APIs are judged, by "Category.api" (the report's API name without the call index:
    "Functional.gelu", "Custom.mylib.fused_gelu"); replaces any earlier configuration ({} restores the built-in
    choice everywhere). Validates everything first: ValueError with one line per problem, nothing changed."""
    global _configured
    problems: list[str] = []
    if not isinstance(per_api, Mapping):
        raise ValueError(f"configure: expected a dict of 'Category.api' -> ApiJudging, got {type(per_api).__name__}")
    for key, judging in per_api.items():
        problems += _problems(key, judging)
    if problems:
        raise ValueError("\n".join(problems))
    _configured = MappingProxyType({key: ApiJudging(j.standard, j.tier, MappingProxyType(
        {d: MappingProxyType({n: float(v) for n, v in named.items()}) for d, named in j.thresholds.items()}))
        for key, j in per_api.items()})


def configured() -> Mapping[str, ApiJudging]:
    """The current per-API configuration (read-only)."""
    return _configured


def api_judging(api_name: str, category: str | None = None) -> ApiJudging | None:
    """The configured judging of an API: by f"{category}.{api_name}" when the category is given, else by
    `api_name` as given (already "Category.api"); None when it is not configured."""
    if not _configured:
        return None
    return _configured.get(f"{category}.{api_name}" if category else api_name)


def _problems(key: object, judging: object) -> list[str]:
    where = f"{key!r}"
    if not isinstance(key, str) or "." not in key.strip(".") or not all(key.split(".", 1)):
        return [f"{where}: the key must be 'Category.api' (e.g. 'Functional.gelu', 'Custom.mylib.fused_gelu')"]
    if not isinstance(judging, ApiJudging):
        return [f"{where}: expected an ApiJudging, got {type(judging).__name__}"]
    problems = []
    standards = known_standards()
    standard = judging.standard
    if standard is not None and standard not in standards:
        problems.append(f"{where}: unknown standard {standard!r} (known: {', '.join(standards)})")
        standard = "?"
    if judging.tier is not None and judging.tier not in TIERS:
        problems.append(f"{where}: unknown tier {judging.tier!r} (known: {', '.join(TIERS)})")
    elif judging.tier is not None and standard not in (None, BENCHMARK):
        problems.append(f"{where}: tier {judging.tier!r} applies to the benchmark standard only, not {standard!r}")
    if not isinstance(judging.thresholds, Mapping):
        return problems + [f"{where}: thresholds must be a dict of dtype name -> {{threshold name: value}}"]
    bare = key.split(".", 1)[1]
    for dtype_name, named in judging.thresholds.items():
        dtype_names = FLOAT_DTYPE_NAMES + (INTEGER_DTYPE_NAMES if standard == QUANTISATION else ())
        if dtype_name not in dtype_names:
            problems.append(f"{where}: unknown dtype {dtype_name!r} (known: {', '.join(dtype_names)})")
            continue
        if not isinstance(named, Mapping):
            problems.append(f"{where}: thresholds[{dtype_name!r}] must be a dict of threshold name -> value")
            continue
        applies = standard if standard is not None else select_standard(bare, getattr(torch, dtype_name))
        if applies == "?":
            continue
        accepted = THRESHOLD_NAMES.get(applies, ())
        for name, value in named.items():
            if name not in accepted:
                problems.append(f"{where}: unknown threshold {name!r} for {dtype_name} with the {applies} standard "
                                f"(accepted: {', '.join(accepted) or 'none'})")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (name in _SHARES and value > 1):
                bound = "in [0, 1]" if name in _SHARES else "a finite number >= 0"
                problems.append(f"{where}: threshold {name!r} for {dtype_name} must be {bound}, got {value!r}")
    return problems
