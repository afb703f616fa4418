"""The keep-mask a dropout record carries is the true one, whichever way the agent finds it (npu_agent/capture.py
`_dropout_mask`): read off the output where every input value is finite and not zero, rebuilt from the generator
state otherwise (zeros, NaN, inf in the input). Pinned here against the mask rebuilt from the generator state, and
the training's random stream is left where the real call left it; with the input checked in C++
(npu_agent/_fastmask.cpp) and in Python."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npu_agent import capture as C
from npu_agent.compiled import MASK, PURE_PYTHON_ENV
from tests.support import built, capture


@pytest.fixture(params=["C++", "Python"])
def check_in(request, monkeypatch):
    """Where a capture made in the test checks the input: npu_agent/_fastmask.cpp (built here if the set-up did not
    build it) or the Python path."""
    if request.param == "C++":
        built(MASK)
    else:
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    monkeypatch.setattr(MASK, "loaded", [])
    return request.param

CALLS = {
    "F.dropout": lambda x: F.dropout(x, 0.3, training=True),
    "F.dropout inplace": lambda x: F.dropout(x, 0.3, training=True, inplace=True),
    "torch.dropout": lambda x: torch.dropout(x, 0.25, True),
    "F.dropout2d": lambda x: F.dropout2d(x, 0.5, training=True),
    "F.dropout p=0.9": lambda x: F.dropout(x, 0.9, training=True),
}


def _input(kind: str, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(6, 5, 7, 9, generator=torch.Generator().manual_seed(3)).to(dtype)
    if kind == "relu":    # exact zeros: the output alone cannot tell a dropped zero from a kept one
        x = x.relu()
    elif kind == "nan":   # NaN * 0 is NaN: a dropped NaN is not zero
        x[1, 2, 3, 4] = float("nan")
    elif kind == "inf":
        x[0, 0, 0, 0] = float("inf")
    return x


def _true_mask(call, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return call(torch.ones_like(x)) != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["dense", "relu", "nan", "inf"])
@pytest.mark.parametrize("name", list(CALLS))
def test_the_recorded_mask_is_the_true_keep_mask(name, kind, dtype, check_in):
    call = CALLS[name]
    x = _input(kind, dtype)
    expected = _true_mask(call, x, 11)
    torch.manual_seed(11)
    with capture(backward=False) as (mode, sink):
        assert (C._finite_nonzero is C._finite_nonzero_py) == (C._state_bytes is C._state_bytes_py) \
            == (check_in == "Python")
        with mode:
            y = call(x.clone())
    after = torch.rand(4)   # the stream goes on from where the real call left it
    torch.manual_seed(11)
    call(x.clone())
    assert torch.equal(after, torch.rand(4))
    recs = [r for r in sink if r.mask is not None]
    assert len(recs) == 1, [r.name for r in sink]
    assert recs[0].mask.dtype == torch.bool and torch.equal(recs[0].mask, expected), name
    if kind == "dense":
        assert torch.equal(recs[0].mask, y != 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_cast_the_mask_is_read_off_with_is_the_comparison_with_zero(dtype):
    from npu_agent.capture import _nonzero

    info = torch.finfo(dtype)
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), info.tiny, -info.tiny,
                           info.tiny / 4, info.max, info.eps], dtype=torch.float64).to(dtype)
    x = torch.cat([values, torch.randn(1008, dtype=dtype) * torch.randint(0, 2, (1008,)).to(dtype)])
    for t in (x, x.view(20, -1)[:, ::3]):   # dense and strided
        got = _nonzero(t)
        assert got.dtype == torch.bool and torch.equal(got, t != 0)
