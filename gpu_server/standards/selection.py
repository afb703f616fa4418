"""Which precision standard judges an output (docs/standards.md): by output dtype, then by API name.

Integer and bool outputs (and Python scalars) -> binary consistency. Otherwise the API name is reduced to one
canonical spelling, so that the bare name, the method, the in-place method, the dunder and its in-place/reflected
forms, the Python-3 operator spellings and an aten overload all select alike:
    mul, mul_, __mul__, __imul__, __rmul__, mul.Tensor        -> mul
    div, div_, __div__, __idiv__, __rdiv__, __truediv__, __itruediv__, __rtruediv__ -> div
    sub, sub_, __sub__, __isub__, __rsub__                    -> sub      (rsub, the torch function, stays rsub)
The name lists are docs/standards.md's, verbatim; every name not listed (all npu_* fused ops included) -> benchmark.
"""
from __future__ import annotations

import torch

ABSOLUTE, BINARY, ULP, THOUSANDTH, BENCHMARK = "absolute", "binary", "ulp", "thousandth", "benchmark"

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


def select_standard(api_name: str, dtype: torch.dtype | None) -> str:
    """The standard key for an output of `dtype` (None: a Python scalar) from API `api_name` (bare name)."""
    if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
        return BINARY
    return SELECTION_TABLE.get(canonical_name(api_name), BENCHMARK)
