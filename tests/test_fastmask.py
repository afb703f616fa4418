"""A random call's record in C++ (npu_agent/_fastmask.cpp, issue 25 goal 2): `finite_nonzero(x)` answers exactly
as the Python path (capture._finite_nonzero_py: aminmax of |x|, low > 0 and high < inf) on every kind of tensor:
floating dtypes with zeros, -0, NaN, infinities and subnormals, views and strided tensors (read in place), subclasses,
other dtypes and a meta tensor (through torch's ops); `state_bytes(state)` gives the bytes capture._state_bytes_py
gives; a capture picks them where built and Python otherwise (tests/test_dropout_mask.py runs its masks both
ways)."""
from __future__ import annotations

import pytest
import torch

from npu_agent import capture as C
from npu_agent.compiled import MASK, PURE_PYTHON_ENV
from tests.support import built


@pytest.fixture(scope="module")
def check():
    """The compiled check, built here if the set-up did not build it."""
    return built(MASK).finite_nonzero


def _cases() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        name = str(dtype).removeprefix("torch.")
        x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1)).to(dtype)
        out[f"{name} dense"] = x
        for what, value, at in (("zero", 0.0, (1, 2, 3)), ("-0", -0.0, (0, 0, 0)), ("nan", float("nan"), (2, 4, 6)),
                                ("inf", float("inf"), (2, 4, 6)), ("-inf", float("-inf"), (1, 0, 0)),
                                ("subnormal", torch.finfo(dtype).tiny / 4, (0, 3, 1))):
            y = x.clone()
            y[at] = value
            out[f"{name} {what}"] = y
        out[f"{name} transposed"] = x.transpose(0, 2)
        out[f"{name} strided"] = x[:, ::2]
        y = x.clone()
        y[0, 0, 0] = 0.0
        out[f"{name} a view past its zero"] = y.view(-1)[1:]   # storage offset: the zero is outside the view
        out[f"{name} a huge value"] = x * torch.finfo(dtype).max
        # longer than the compiled check's chunks of 256 values (its tail 232): a bad value at either end of a chunk
        long = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(dtype)
        edges = long.clone()
        edges[[0, 255, 256, 999]] = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).smallest_normal,
                                                  torch.finfo(dtype).tiny / 2, -torch.finfo(dtype).max]).to(dtype)
        out[f"{name} long, the extremes of finite"] = edges
        for what, value in (("zero", 0.0), ("-0", -0.0), ("nan", float("nan")), ("inf", float("inf"))):
            for at in (0, 255, 256, 767, 768, 999):
                y = long.clone()
                y[at] = value
                out[f"{name} long, {what} at {at}"] = y
    big = torch.randn(300_000, generator=torch.Generator().manual_seed(3))   # over 64 KiB: read without the lock
    out["float32 of 1.2 MB"] = big
    big_nan = big.clone()
    big_nan[-1] = float("nan")
    out["float32 of 1.2 MB, nan last"] = big_nan
    out["one element"] = torch.tensor([2.5])
    out["a scalar"] = torch.tensor(-1.0)
    out["requires grad"] = torch.randn(4, requires_grad=True)
    out["a Parameter"] = torch.nn.Parameter(torch.randn(4))
    out["integers"] = torch.tensor([1, -3, 5])
    out["integers with a zero"] = torch.tensor([1, 0, 5])
    out["bool"] = torch.tensor([True, False])
    out["complex"] = torch.tensor([1 + 1j, 2 - 1j])
    out["meta"] = torch.empty(3, device="meta")
    return out


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_the_same_answer_as_the_python_path(check, name):
    x = CASES[name]
    assert check(x) is C._finite_nonzero_py(x)


def test_what_the_answers_are(check):
    """Spelled out for a few (the Python path is checked against these too, above)."""
    for name, answer in (("float32 dense", True), ("float32 zero", False), ("float32 -0", False),
                         ("bfloat16 nan", False), ("float16 inf", False), ("float64 -inf", False),
                         ("float32 subnormal", True), ("float32 a view past its zero", True),
                         ("bfloat16 a huge value", False), ("meta", False), ("float16 long, nan at 767", False),
                         ("bfloat16 long, the extremes of finite", True), ("float32 of 1.2 MB", True),
                         ("float32 of 1.2 MB, nan last", False)):
        assert check(CASES[name]) is answer, name


def test_not_a_tensor(check):
    with pytest.raises(TypeError, match="finite_nonzero"):
        check([1.0, 2.0])
    with pytest.raises(TypeError, match="state_bytes"):
        MASK.load().state_bytes(b"\x00")


def test_a_generator_states_bytes_as_the_python_path_gives_them(check):
    state_bytes = MASK.load().state_bytes
    torch.manual_seed(5)
    torch.rand(3)
    states = {"the CPU generator": torch.get_rng_state(), "a Generator's": torch.Generator().manual_seed(9).get_state(),
              "strided": torch.arange(40, dtype=torch.uint8)[::3], "empty": torch.empty(0, dtype=torch.uint8),
              "int64": torch.tensor([1, -2, 3 << 40])}
    for name, state in states.items():
        got = state_bytes(state)
        assert type(got) is bytes and got == C._state_bytes_py(state), name
    assert len(state_bytes(states["the CPU generator"])) == 5056


def test_a_capture_picks_it_where_built(monkeypatch, tmp_path, check):
    monkeypatch.setattr(C, "_finite_nonzero", None)   # (restored after the test)
    monkeypatch.setattr(C, "_state_bytes", None)
    monkeypatch.setattr(MASK, "loaded", [])
    C.use_compiled_mask()
    assert C._finite_nonzero is check and C._state_bytes is MASK.load().state_bytes
    monkeypatch.setattr(MASK, "loaded", [])
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    C.use_compiled_mask()
    assert (C._finite_nonzero, C._state_bytes) == (C._finite_nonzero_py, C._state_bytes_py)
    monkeypatch.setattr(MASK, "loaded", [])
    monkeypatch.delenv(PURE_PYTHON_ENV)
    monkeypatch.setattr(MASK, "source", tmp_path / "_fastmask.cpp")   # a changed source: its binary is not built
    (tmp_path / "_fastmask.cpp").write_text("// another source\n")
    C.use_compiled_mask()
    assert (C._finite_nonzero, C._state_bytes) == (C._finite_nonzero_py, C._state_bytes_py)
