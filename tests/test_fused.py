"""Tests of the torch_npu fused-operator references (gpu_server.replay.fused) against independent plain-torch formulas.

Every reference is compared with a composition of basic torch ops written here (explicit loops, index arithmetic),
npu_fusion_attention also with F.scaled_dot_product_attention where the semantics coincide; backward is checked with
torch.autograd.gradcheck in float64 on small shapes.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from gpu_server.replay.fused import FUSED_REFERENCES, get_reference, reference

DT = torch.float64
BIG = 2147483647
LAYOUTS = ["BSH", "SBH", "BSND", "BNSD"]
OPS = [
    "npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_scaled_masked_softmax",
    "npu_fast_gelu", "npu_linear", "npu_confusion_transpose", "npu_layer_norm_eval", "npu_apply_adam",
    "npu_apply_adam_w", "npu_group_norm_silu", "npu_mish", "npu_moe_gating_top_k_softmax", "npu_sort_v2",
]


def ref(name):
    fn = get_reference(name)
    assert fn is not None, name
    return fn


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, requires_grad=False):
    return torch.randn(*shape, dtype=DT, generator=gen(seed)).requires_grad_(requires_grad)


# --------------------------------------------------------------------------------------------------------- registry
def test_registry_contains_every_operator():
    assert sorted(FUSED_REFERENCES) == sorted(OPS)
    for name in OPS:
        assert callable(FUSED_REFERENCES[name])
        assert get_reference(name) is FUSED_REFERENCES[name]
        assert get_reference("torch_npu." + name) is FUSED_REFERENCES[name]


def test_registry_unknown_and_duplicate():
    assert get_reference("npu_does_not_exist") is None
    assert get_reference("__import__") is None
    assert get_reference(None) is None
    with pytest.raises(ValueError):
        reference("npu_rms_norm")(lambda x: x)
    assert FUSED_REFERENCES["npu_rms_norm"].__name__ == "npu_rms_norm"


DOCUMENTED_DEFAULTS = {
    "npu_fusion_attention": {"pse": None, "padding_mask": None, "atten_mask": None, "scale": 1.0, "keep_prob": 1.0,
                             "pre_tockens": 2147483647, "next_tockens": 2147483647, "inner_precise": 0,
                             "prefix": None, "actual_seq_qlen": None, "actual_seq_kvlen": None, "sparse_mode": 0,
                             "gen_mask_parallel": True, "sync": False},
    "npu_rms_norm": {"epsilon": 1e-6},
    "npu_rotary_mul": {"rotary_mode": "half"},
    "npu_swiglu": {"dim": -1},
    "npu_scaled_masked_softmax": {"scale": 1.0, "fixed_triu_mask": False},
    "npu_linear": {"bias": None},
    "npu_layer_norm_eval": {"weight": None, "bias": None, "eps": 1e-5},
    "npu_group_norm_silu": {"eps": 1e-5},
    "npu_moe_gating_top_k_softmax": {"finished": None, "k": 1},
    "npu_sort_v2": {"dim": -1, "descending": False, "out": None},
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED_DEFAULTS))
def test_documented_defaults(name):
    params = inspect.signature(ref(name)).parameters
    for arg, default in DOCUMENTED_DEFAULTS[name].items():
        assert params[arg].default == default, (name, arg)


# ------------------------------------------------------------------------------------------ npu_fusion_attention
COMPRESSED = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def visible_fn(mode, s1, s2, mask=None, pre=BIG, nxt=BIG):
    """visible(i, j) per the torch_npu sparse_mode definitions (mask: True = masked)."""
    if mode == 0:
        return lambda i, j: (mask is None or not bool(mask[i, j])) and -pre <= j - i <= nxt
    if mode == 1:
        return lambda i, j: not bool(mask[i, j])
    if mode == 2:
        return lambda i, j: j <= i
    if mode == 3:
        return lambda i, j: j <= i + (s2 - s1)
    if mode == 4:
        return lambda i, j: -pre <= j - i - (s2 - s1) <= nxt
    raise AssertionError(mode)


def naive_attention(q, k, v, scale, visible, pse=None, drop=None, keep_prob=1.0):
    """Loop implementation on BNSD tensors; returns (out, row_max, row_sum); rows with no visible key give 0."""
    b_, n1, s1, _ = q.shape
    n2, s2 = k.shape[1], k.shape[2]
    group = n1 // n2
    outs, maxes, sums = [], [], []
    for b in range(b_):
        for h in range(n1):
            kv = h // group
            for i in range(s1):
                cols = [j for j in range(s2) if visible(i, j)]
                if not cols:
                    outs.append(torch.zeros(v.shape[-1], dtype=q.dtype))
                    maxes.append(torch.tensor(torch.finfo(torch.float32).min, dtype=q.dtype))
                    sums.append(torch.tensor(0.0, dtype=q.dtype))
                    continue
                idx = torch.tensor(cols)
                logits = (k[b, kv, idx] * q[b, h, i]).sum(-1)
                if pse is not None:
                    logits = logits + pse[b % pse.shape[0], h % pse.shape[1], i % pse.shape[2], idx]
                logits = logits * scale
                mx = logits.max()
                w = torch.exp(logits - mx)
                sums.append(w.sum())
                maxes.append(mx)
                w = w / w.sum()
                if drop is not None:
                    w = w * drop[b, h, i, idx].to(w.dtype) / keep_prob
                outs.append((w.unsqueeze(-1) * v[b, kv, idx]).sum(0))
    out = torch.stack(outs).reshape(b_, n1, s1, v.shape[-1])
    return out, torch.stack(maxes).reshape(b_, n1, s1).detach(), torch.stack(sums).reshape(b_, n1, s1).detach()


def to_layout(x, layout):
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def from_layout(y, layout, n):
    if layout == "BNSD":
        return y
    if layout == "BSND":
        return y.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = y.shape
        return y.reshape(b, s, n, h // n).permute(0, 2, 1, 3)
    s, b, h = y.shape
    return y.reshape(s, b, n, h // n).permute(1, 2, 0, 3)


def qkv(b=2, n1=4, n2=2, s1=5, s2=7, d=8, dv=None, seed=0, requires_grad=False):
    return (randn(b, n1, s1, d, seed=seed, requires_grad=requires_grad),
            randn(b, n2, s2, d, seed=seed + 1, requires_grad=requires_grad),
            randn(b, n2, s2, dv or d, seed=seed + 2, requires_grad=requires_grad))


def run_fa(q, k, v, layout, n1, **kw):
    """Call the reference with BNSD tensors converted to ``layout``; return (out in BNSD, full result tuple)."""
    res = ref("npu_fusion_attention")(to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), n1, layout,
                                      **kw)
    return from_layout(res[0], layout, n1), res


def mode_kwargs(mode, s1, s2, pre=BIG, nxt=BIG, seed=3):
    """atten_mask / token kwargs for a sparse mode, plus the explicit mask used (mode 0/1)."""
    if mode in (2, 3, 4):
        return {"atten_mask": COMPRESSED, "sparse_mode": mode, "pre_tockens": pre, "next_tockens": nxt}, None
    mask = torch.rand(s1, s2, generator=gen(seed)) < 0.3
    return {"atten_mask": mask, "sparse_mode": mode, "pre_tockens": pre, "next_tockens": nxt}, mask


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode,pre,nxt", [(0, BIG, BIG), (0, 2, 1), (1, BIG, BIG), (2, BIG, 0), (3, BIG, 0),
                                          (4, 2, 1), (4, 3, 0)])
@pytest.mark.parametrize("s1,s2", [(5, 7), (6, 4), (5, 5)])
def test_fa_layouts_and_sparse_modes(layout, mode, pre, nxt, s1, s2):
    b, n1, n2, d = 2, 4, 2, 8
    q, k, v = qkv(b, n1, n2, s1, s2, d)
    kw, mask = mode_kwargs(mode, s1, s2, pre, nxt)
    scale = 0.3
    out, res = run_fa(q, k, v, layout, n1, scale=scale, **kw)
    exp_out, exp_max, exp_sum = naive_attention(q, k, v, scale, visible_fn(mode, s1, s2, mask, pre, nxt))
    torch.testing.assert_close(out, exp_out, rtol=1e-10, atol=1e-10)
    assert len(res) == 7
    smax, ssum, sout, seed, offset, numels = res[1:]
    assert smax.shape == ssum.shape == (b, n1, s1, 8) and smax.dtype == DT
    torch.testing.assert_close(smax, exp_max.unsqueeze(-1).expand(b, n1, s1, 8))
    torch.testing.assert_close(ssum, exp_sum.unsqueeze(-1).expand(b, n1, s1, 8))
    assert sout.numel() == 0 and (seed, offset) == (0, 0) and numels == b * n1 * s1 * s2


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n1,n2", [(4, 4), (4, 2), (4, 1)])
def test_fa_matches_sdpa_no_mask(layout, n1, n2):
    q, k, v = qkv(2, n1, n2, 5, 6, 8, requires_grad=True)
    out, res = run_fa(q, k, v, layout, n1, scale=0.25)
    kr, vr = k.repeat_interleave(n1 // n2, dim=1), v.repeat_interleave(n1 // n2, dim=1)
    exp = F.scaled_dot_product_attention(q, kr, vr, scale=0.25)
    torch.testing.assert_close(out, exp)
    g = randn(*out.shape, seed=9)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(exp, (q, k, v), g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode,s1,s2", [(2, 5, 5), (3, 5, 5), (2, 4, 6), (2, 6, 4)])
def test_fa_causal_matches_sdpa_is_causal(layout, mode, s1, s2):
    # torch's is_causal is top-left aligned: equal to sparse_mode 2 always, to sparse_mode 3 when S1 == S2.
    q, k, v = qkv(1, 2, 1, s1, s2, 8, requires_grad=True)
    out, _ = run_fa(q, k, v, layout, 2, scale=0.5, atten_mask=COMPRESSED, sparse_mode=mode)
    exp = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.5,
                                         is_causal=True)
    torch.testing.assert_close(out, exp)
    g = randn(*out.shape, seed=4)
    for a, e in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(exp, (q, k, v), g)):
        torch.testing.assert_close(a, e)


def test_fa_explicit_mask_matches_sdpa_bool_mask():
    q, k, v = qkv(2, 2, 2, 4, 6, 8)
    mask = torch.rand(2, 1, 4, 6, generator=gen(5)) < 0.4
    mask[..., 0] = False  # every row sees at least one key (SDPA would give NaN otherwise)
    for mode in (0, 1):
        out, _ = run_fa(q, k, v, "BNSD", 2, atten_mask=mask, sparse_mode=mode)
        exp = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=1.0)
        torch.testing.assert_close(out, exp)


def test_fa_default_scale_is_one_and_pse_added_before_scale():
    q, k, v = qkv(1, 2, 2, 3, 4, 8)
    out, _ = run_fa(q, k, v, "BNSD", 2)
    exp = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    torch.testing.assert_close(out, exp)
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v))  # 1/sqrt(d) would differ
    pse = randn(1, 2, 3, 4, seed=7)
    out, _ = run_fa(q, k, v, "BNSD", 2, pse=pse, scale=0.5)
    exp = torch.softmax((q @ k.transpose(-1, -2) + pse) * 0.5, dim=-1) @ v
    torch.testing.assert_close(out, exp)


@pytest.mark.parametrize("pse_shape", [(2, 4, 5, 6), (2, 4, 1, 6), (1, 4, 5, 6)])
def test_fa_pse_shapes_gqa(pse_shape):
    q, k, v = qkv(2, 4, 2, 5, 6, 8)
    pse = randn(*pse_shape, seed=11)
    out, _ = run_fa(q, k, v, "BSH", 4, pse=pse, scale=0.2)
    exp, _, _ = naive_attention(q, k, v, 0.2, lambda i, j: True, pse=pse)
    torch.testing.assert_close(out, exp)


def test_fa_mask_none_ignores_sparse_mode_and_tokens():
    # torch_npu docs: with atten_mask None, sparse_mode / pre_tockens / next_tockens do not apply (full attention).
    q, k, v = qkv(1, 2, 2, 4, 4, 8)
    full, _ = run_fa(q, k, v, "BNSD", 2)
    for mode in (0, 2, 3, 4):
        out, _ = run_fa(q, k, v, "BNSD", 2, sparse_mode=mode, pre_tockens=0, next_tockens=0)
        torch.testing.assert_close(out, full)


def test_fa_dropout_mask():
    q, k, v = qkv(1, 2, 1, 4, 5, 8)
    with pytest.raises(ValueError, match="random"):
        run_fa(q, k, v, "BNSD", 2, keep_prob=0.9)
    drop = torch.rand(1, 2, 4, 5, generator=gen(8)) < 0.8
    out, _ = run_fa(q, k, v, "BSND", 2, keep_prob=0.8, _dropout_mask=drop, scale=0.3)
    exp, _, _ = naive_attention(q, k, v, 0.3, lambda i, j: True, drop=drop, keep_prob=0.8)
    torch.testing.assert_close(out, exp)
    # keep_prob 1: the mask is ignored
    out1, _ = run_fa(q, k, v, "BNSD", 2, keep_prob=1.0, _dropout_mask=drop)
    torch.testing.assert_close(out1, run_fa(q, k, v, "BNSD", 2)[0])


def test_fa_invalid_arguments():
    q, k, v = qkv(1, 2, 2, 4, 4, 8)
    fa = ref("npu_fusion_attention")
    with pytest.raises(ValueError, match="compressed"):
        fa(q, k, v, 2, "BNSD", atten_mask=torch.ones(4, 4, dtype=torch.bool).triu(1), sparse_mode=2)
    with pytest.raises(ValueError, match="compressed"):
        fa(q, k, v, 2, "BNSD", atten_mask=~COMPRESSED, sparse_mode=3)
    with pytest.raises(ValueError, match="sparse_mode 5"):
        fa(q, k, v, 2, "BNSD", atten_mask=torch.zeros(4, 4, dtype=torch.bool), sparse_mode=5)
    with pytest.raises(ValueError, match="input_layout"):
        fa(q, k, v, 2, "NSD")
    with pytest.raises(ValueError, match="multiple"):
        fa(*qkv(1, 3, 2, 4, 4, 8), 3, "BNSD")
    with pytest.raises(ValueError, match="keep_prob"):
        fa(q, k, v, 2, "BNSD", keep_prob=0.0)
    with pytest.raises(ValueError, match="pse"):
        fa(q, k, v, 2, "BNSD", pse=randn(1, 2, 2, 4))  # compressed alibi rows are not expanded
    with pytest.raises(ValueError, match="sink"):
        fa(q, k, v, 2, "BNSD", sink=randn(2))
    with pytest.raises(ValueError, match="atten_mask"):
        fa(q, k, v, 2, "BNSD", atten_mask=torch.zeros(3, 4, dtype=torch.bool), sparse_mode=1)


def test_fa_uint8_mask_and_lowercase_layout():
    q, k, v = qkv(1, 2, 2, 4, 4, 8)
    mask = (torch.rand(4, 4, generator=gen(2)) < 0.3)
    mask[:, 0] = False
    a = ref("npu_fusion_attention")(q, k, v, 2, "bnsd", atten_mask=mask.to(torch.uint8), sparse_mode=1)[0]
    b = ref("npu_fusion_attention")(q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=1)[0]
    torch.testing.assert_close(a, b)


# TND: per-sequence attention on packed tokens.
def tnd_case(qlens, kvlens, n1=4, n2=2, d=8, dv=6, seed=0, requires_grad=False):
    t1, t2 = sum(qlens), sum(kvlens)
    return (randn(t1, n1, d, seed=seed, requires_grad=requires_grad),
            randn(t2, n2, d, seed=seed + 1, requires_grad=requires_grad),
            randn(t2, n2, dv, seed=seed + 2, requires_grad=requires_grad))


def cumsum(xs):
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


@pytest.mark.parametrize("mode,pre,nxt,with_mask", [(0, BIG, BIG, False), (0, 2, 1, True), (1, BIG, BIG, True),
                                                    (2, BIG, 0, True), (3, BIG, 0, True), (4, 2, 0, True)])
def test_fa_tnd_all_sparse_modes(mode, pre, nxt, with_mask):
    qlens, kvlens = [3, 5, 2], [4, 5, 1]
    n1 = 4
    q, k, v = tnd_case(qlens, kvlens, n1=n1)
    big_mask = torch.rand(max(qlens), max(kvlens), generator=gen(6)) < 0.3
    kw = {"sparse_mode": mode, "pre_tockens": pre, "next_tockens": nxt, "scale": 0.4}
    if with_mask:
        kw["atten_mask"] = COMPRESSED if mode in (2, 3, 4) else big_mask
    res = ref("npu_fusion_attention")(q, k, v, n1, "TND", actual_seq_qlen=cumsum(qlens),
                                      actual_seq_kvlen=cumsum(kvlens), **kw)
    out, smax, ssum = res[0], res[1], res[2]
    assert out.shape == (sum(qlens), n1, 6) and smax.shape == (sum(qlens), n1, 8)
    q0 = k0 = 0
    for sq, skv in zip(qlens, kvlens):
        qb = q[q0:q0 + sq].permute(1, 0, 2).unsqueeze(0)
        kb = k[k0:k0 + skv].permute(1, 0, 2).unsqueeze(0)
        vb = v[k0:k0 + skv].permute(1, 0, 2).unsqueeze(0)
        m = big_mask[:sq, :skv] if (with_mask and mode in (0, 1)) else None
        vis = visible_fn(mode, sq, skv, m, pre, nxt) if with_mask else (lambda i, j: True)
        e_out, e_max, e_sum = naive_attention(qb, kb, vb, 0.4, vis)
        torch.testing.assert_close(out[q0:q0 + sq], e_out[0].permute(1, 0, 2))
        torch.testing.assert_close(smax[q0:q0 + sq, :, 3], e_max[0].t())
        torch.testing.assert_close(ssum[q0:q0 + sq, :, 0], e_sum[0].t())
        q0, k0 = q0 + sq, k0 + skv
    assert res[6] == n1 * sum(a * b for a, b in zip(qlens, kvlens))


def test_fa_tnd_matches_sdpa_and_trailing_zero_batches():
    qlens, kvlens = [3, 4], [3, 4]
    q, k, v = tnd_case(qlens, kvlens, n1=2, n2=2, dv=8, requires_grad=True)
    out = ref("npu_fusion_attention")(q, k, v, 2, "TND", atten_mask=COMPRESSED, sparse_mode=3,
                                      actual_seq_qlen=[3, 7, 0], actual_seq_kvlen=[3, 7, 0], scale=0.5)[0]
    pieces = []
    for a, b in ((0, 3), (3, 7)):
        pieces.append(F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True,
            scale=0.5).transpose(0, 1))
    exp = torch.cat(pieces)
    torch.testing.assert_close(out, exp)
    g = randn(*out.shape, seed=3)
    for a, e in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(exp, (q, k, v), g)):
        torch.testing.assert_close(a, e)


def test_fa_tnd_uncovered_rows_are_zero_and_dropout():
    q, k, v = tnd_case([2, 2], [3, 3], n1=2, n2=1)
    fa = ref("npu_fusion_attention")
    out = fa(q, k, v, 2, "TND", actual_seq_qlen=[2, 3], actual_seq_kvlen=[3, 6])[0]
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    drop = torch.rand(2, 4, 6, generator=gen(1)) < 0.7
    out = fa(q, k, v, 2, "TND", actual_seq_qlen=[2, 4], actual_seq_kvlen=[3, 6], keep_prob=0.7, _dropout_mask=drop)[0]
    qb, kb, vb = q[:2].permute(1, 0, 2)[None], k[:3].permute(1, 0, 2)[None], v[:3].permute(1, 0, 2)[None]
    exp, _, _ = naive_attention(qb, kb, vb, 1.0, lambda i, j: True, drop=drop[None, :, :2, :3], keep_prob=0.7)
    torch.testing.assert_close(out[:2], exp[0].permute(1, 0, 2))


GRAD_CASES = [
    ("BSH", dict(scale=0.5), (1, 2, 1, 3, 4)),
    ("SBH", dict(atten_mask=COMPRESSED, sparse_mode=2), (2, 2, 2, 3, 3)),
    ("BSND", dict(atten_mask=COMPRESSED, sparse_mode=3, scale=0.7), (1, 2, 1, 4, 2)),  # S1 > S2: empty rows
    ("BNSD", dict(atten_mask=COMPRESSED, sparse_mode=4, pre_tockens=1, next_tockens=0), (1, 2, 2, 3, 4)),
    ("BNSD", dict(sparse_mode=1), (1, 2, 2, 3, 4)),
    ("BNSD", dict(sparse_mode=0, pre_tockens=1, next_tockens=1), (1, 2, 2, 3, 4)),
]


@pytest.mark.parametrize("layout,kw,dims", GRAD_CASES)
def test_fa_gradcheck(layout, kw, dims):
    b, n1, n2, s1, s2 = dims
    q, k, v = qkv(b, n1, n2, s1, s2, 4, requires_grad=True)
    kw = dict(kw)
    if kw.get("sparse_mode") in (0, 1) and "atten_mask" not in kw:
        m = torch.rand(s1, s2, generator=gen(2)) < 0.3
        m[:, 0] = False
        kw["atten_mask"] = m
    assert gradcheck(lambda a, b_, c: run_fa(a, b_, c, layout, n1, **kw)[0], (q, k, v))


def test_fa_gradcheck_pse_dropout_tnd():
    q, k, v = qkv(1, 2, 1, 3, 3, 4, requires_grad=True)
    pse = randn(1, 2, 3, 3, seed=5, requires_grad=True)
    drop = torch.rand(1, 2, 3, 3, generator=gen(3)) < 0.7
    fa = ref("npu_fusion_attention")
    assert gradcheck(lambda a, b, c, p: fa(a, b, c, 2, "BNSD", pse=p, keep_prob=0.7, _dropout_mask=drop,
                                           scale=0.5)[0], (q, k, v, pse))
    tq, tk, tv = tnd_case([2, 3], [3, 2], n1=2, n2=1, d=4, dv=3, requires_grad=True)
    assert gradcheck(lambda a, b, c: fa(a, b, c, 2, "TND", atten_mask=COMPRESSED, sparse_mode=3,
                                        actual_seq_qlen=[2, 5], actual_seq_kvlen=[3, 5])[0], (tq, tk, tv))


def test_fa_float32_inputs_give_float32():
    q, k, v = (t.float() for t in qkv(1, 2, 2, 3, 3, 4))
    res = run_fa(q, k, v, "BSH", 2)[1]
    assert res[0].dtype == torch.float32 and res[1].dtype == torch.float32 and res[3].dtype == torch.float32


# ----------------------------------------------------------------------------------------------------- rms_norm
def test_rms_norm_default_eps_and_trailing_gamma():
    x = randn(3, 4, 6) * 1e-3  # small values so that the epsilon matters
    gamma = randn(6, seed=1)
    y, rstd = ref("npu_rms_norm")(x, gamma)
    exp_rstd = 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) / 6 + 1e-6)
    torch.testing.assert_close(rstd, exp_rstd)
    torch.testing.assert_close(y, x * exp_rstd * gamma)
    assert rstd.shape == (3, 4, 1)
    y5, _ = ref("npu_rms_norm")(x, gamma, epsilon=1e-5)
    assert not torch.allclose(y, y5)
    gamma2 = randn(4, 6, seed=2)
    y2, rstd2 = ref("npu_rms_norm")(x, gamma2, 1e-6)
    exp_rstd2 = 1.0 / torch.sqrt((x * x).sum((-1, -2), keepdim=True) / 24 + 1e-6)
    assert rstd2.shape == (3, 1, 1)
    torch.testing.assert_close(y2, x * exp_rstd2 * gamma2)
    with pytest.raises(ValueError):
        ref("npu_rms_norm")(x, randn(5))


def test_rms_norm_dtypes_and_gradcheck():
    x = randn(2, 3, 8).float()
    y, rstd = ref("npu_rms_norm")(x, torch.ones(8))
    assert y.dtype == torch.float32 and rstd.dtype == torch.float32
    y16, rstd16 = ref("npu_rms_norm")(x.half(), torch.ones(8, dtype=torch.float16))
    assert rstd16.dtype == torch.float32 and y16.dtype == torch.float16
    x, g = randn(2, 3, 5, requires_grad=True), randn(5, seed=1, requires_grad=True)
    assert gradcheck(lambda a, b: ref("npu_rms_norm")(a, b)[0], (x, g))


# --------------------------------------------------------------------------------------------------- rotary_mul
def rotary_loop(x, r1, r2, mode):
    d = x.shape[-1]
    r1, r2 = r1.expand_as(x), r2.expand_as(x)
    cols = []
    for c in range(d):
        if mode == "half":
            partner, sign = (c + d // 2, -1.0) if c < d // 2 else (c - d // 2, 1.0)
        else:
            partner, sign = (c + 1, -1.0) if c % 2 == 0 else (c - 1, 1.0)
        cols.append(r1[..., c] * x[..., c] + sign * r2[..., c] * x[..., partner])
    return torch.stack(cols, dim=-1)


@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("rshape", [(1, 1, 3, 6), (2, 1, 3, 6), (2, 2, 3, 6)])
def test_rotary_mul(mode, rshape):
    x = randn(2, 2, 3, 6, requires_grad=True)
    r1, r2 = randn(*rshape, seed=1, requires_grad=True), randn(*rshape, seed=2, requires_grad=True)
    kw = {} if mode == "half" else {"rotary_mode": mode}
    torch.testing.assert_close(ref("npu_rotary_mul")(x, r1, r2, **kw), rotary_loop(x, r1, r2, mode))
    assert gradcheck(lambda a, b, c: ref("npu_rotary_mul")(a, b, c, **kw), (x, r1, r2))
    with pytest.raises(ValueError):
        ref("npu_rotary_mul")(x, r1, r2, rotary_mode="quarter")


# ------------------------------------------------------------------------------------------------------ swiglu
def test_swiglu():
    x = randn(3, 4, 6, requires_grad=True)
    a, b = x[..., :3], x[..., 3:]
    torch.testing.assert_close(ref("npu_swiglu")(x), a / (1 + torch.exp(-a)) * b)
    a0, b0 = x[:1], x[1:2]
    torch.testing.assert_close(ref("npu_swiglu")(x[:2], dim=0), a0 / (1 + torch.exp(-a0)) * b0)
    assert gradcheck(ref("npu_swiglu"), (x,))
    assert gradcheck(lambda t: ref("npu_swiglu")(t, 1), (x,))


# ---------------------------------------------------------------------------------------- scaled_masked_softmax
def test_scaled_masked_softmax():
    x = randn(2, 2, 4, 5, requires_grad=True)
    mask = torch.rand(2, 1, 4, 5, generator=gen(1)) < 0.4
    mask[0, 0, 1] = True  # one fully masked row
    z = torch.where(mask, torch.full_like(x, -10000.0), x * 0.7)
    e = torch.exp(z - z.max(-1, keepdim=True).values)
    torch.testing.assert_close(ref("npu_scaled_masked_softmax")(x, mask, 0.7), e / e.sum(-1, keepdim=True))
    z1 = torch.where(mask, torch.full_like(x, -10000.0), x)  # default scale 1.0
    torch.testing.assert_close(ref("npu_scaled_masked_softmax")(x, mask), torch.softmax(z1, -1))
    tri = torch.tensor([[j > i for j in range(5)] for i in range(4)])
    z2 = torch.where(tri, torch.full_like(x, -10000.0), x * 0.5)
    torch.testing.assert_close(ref("npu_scaled_masked_softmax")(x, mask, 0.5, True), torch.softmax(z2, -1))
    assert gradcheck(lambda t: ref("npu_scaled_masked_softmax")(t, mask, 0.7), (x,))


# ----------------------------------------------------------------------------------------------------- fast_gelu
def test_fast_gelu():
    x = randn(4, 5, requires_grad=True) * 4
    exp = x / (1 + torch.exp(-1.702 * x))
    torch.testing.assert_close(ref("npu_fast_gelu")(x), exp)
    one = torch.tensor([1.0, 0.0], dtype=DT, requires_grad=True)
    y = ref("npu_fast_gelu")(one)
    (g,) = torch.autograd.grad(y.sum(), one)
    assert abs(y[0].item() - 0.84579575) < 1e-7
    assert abs(g[0].item() - 1.06777954) < 1e-7 and abs(g[1].item() - 0.5) < 1e-12
    assert torch.isfinite(ref("npu_fast_gelu")(torch.tensor([-1000.0, 1000.0]))).all()
    assert gradcheck(ref("npu_fast_gelu"), (randn(3, 4, requires_grad=True),))


# ----------------------------------------------------------------------------------------------------- linear
def test_linear():
    x, w, b = randn(2, 3, 4, requires_grad=True), randn(5, 4, seed=1, requires_grad=True), randn(5, seed=2,
                                                                                                  requires_grad=True)
    exp = torch.einsum("bsi,oi->bso", x, w) + b
    torch.testing.assert_close(ref("npu_linear")(x, w, b), exp)
    torch.testing.assert_close(ref("npu_linear")(x, w), torch.einsum("bsi,oi->bso", x, w))
    assert gradcheck(ref("npu_linear"), (x, w, b))


# ------------------------------------------------------------------------------------------- confusion_transpose
def test_confusion_transpose():
    x = randn(2, 3, 4, 6, requires_grad=True)
    y = ref("npu_confusion_transpose")(x, (0, 2, 1, 3), (2, 4, 18), True)
    assert y.shape == (2, 4, 18)
    for b in range(2):
        for i in range(4):
            torch.testing.assert_close(y[b, i], torch.cat([x[b, j, i] for j in range(3)]))
    y2 = ref("npu_confusion_transpose")(x, (0, 2, 1), (2, 12, 6), False)
    assert y2.shape == (2, 6, 12)
    flat = x.reshape(2, 12, 6)
    for b in range(2):
        torch.testing.assert_close(y2[b], torch.stack([flat[b, :, c] for c in range(6)]))
    assert gradcheck(lambda t: ref("npu_confusion_transpose")(t, [0, 2, 1, 3], [2, 4, 18], True), (x,))
    assert gradcheck(lambda t: ref("npu_confusion_transpose")(t, [0, 2, 1], [2, 12, 6], False), (x,))


# --------------------------------------------------------------------------------------------- layer_norm_eval
def test_layer_norm_eval_uses_weight_bias_eps():
    x = randn(3, 4, 5, requires_grad=True)
    w, b = randn(4, 5, seed=1, requires_grad=True), randn(4, 5, seed=2, requires_grad=True)
    mean = x.mean((-1, -2), keepdim=True)
    var = ((x - mean) ** 2).mean((-1, -2), keepdim=True)
    exp = (x - mean) / torch.sqrt(var + 0.5) * w + b
    torch.testing.assert_close(ref("npu_layer_norm_eval")(x, [4, 5], w, b, 0.5), exp)
    exp_default = (x - mean) / torch.sqrt(var + 1e-5)
    torch.testing.assert_close(ref("npu_layer_norm_eval")(x, (4, 5)), exp_default)
    assert gradcheck(lambda a, c, d: ref("npu_layer_norm_eval")(a, [5], c[0], d[0], 1e-3), (x, w, b))


# --------------------------------------------------------------------------------------------------- apply_adam
def test_apply_adam_matches_torch_adam_first_step():
    var, grad = randn(4, 3), randn(4, 3, seed=1)
    m0, v0 = torch.zeros_like(var), torch.zeros_like(var)
    lr, b1, b2, eps = 0.01, 0.9, 0.99, 1e-8
    p = var.clone().requires_grad_()
    # TF-style epsilon (on sqrt(v) before bias correction) == torch eps * sqrt(1 - beta2^t)
    opt = torch.optim.Adam([p], lr=lr, betas=(b1, b2), eps=eps / math.sqrt(1 - b2))
    p.grad = grad.clone()
    opt.step()
    st = opt.state[p]
    v_in = (var.clone(), m0.clone(), v0.clone())
    new_var, new_m, new_v = ref("npu_apply_adam")(b1, b2, lr, b1, b2, eps, grad, False, False, out=v_in)
    torch.testing.assert_close(new_var, p.detach())
    torch.testing.assert_close(new_m, st["exp_avg"])
    torch.testing.assert_close(new_v, st["exp_avg_sq"])
    assert torch.equal(v_in[0], var) and torch.equal(v_in[1], m0)  # inputs untouched


def test_apply_adam_nesterov_and_tensor_scalars():
    var, m, v, g = randn(5), randn(5, seed=1), randn(5, seed=2).abs(), randn(5, seed=3)
    b1p, b2p, lr, b1, b2, eps = 0.81, 0.98, 0.1, 0.9, 0.99, 1e-6
    m_t = b1 * m + (1 - b1) * g
    v_t = b2 * v + (1 - b2) * g * g
    lr_t = lr * (1 - b2p) ** 0.5 / (1 - b1p)
    exp = var - lr_t * (b1 * m_t + (1 - b1) * g) / (v_t ** 0.5 + eps)
    out = ref("npu_apply_adam")(torch.tensor(b1p), b2p, lr, b1, b2, eps, g, False, True, out=(var, m, v))
    torch.testing.assert_close(out[0], exp)
    with pytest.raises(ValueError):
        ref("npu_apply_adam")(b1p, b2p, lr, b1, b2, eps, g, False, False)


@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (False, True), (True, True)])
def test_apply_adam_w_matches_torch_adamw_second_step(amsgrad, maximize):
    lr, b1, b2, eps, wd = 0.05, 0.8, 0.95, 1e-6, 0.1
    p = randn(3, 4).requires_grad_()
    g1, g2 = randn(3, 4, seed=1), randn(3, 4, seed=2)
    opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad,
                            maximize=maximize)
    p.grad = g1.clone()
    opt.step()
    st = opt.state[p]
    var1, m1, v1 = p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()
    mx = st["max_exp_avg_sq"].clone() if amsgrad else None
    p.grad = g2.clone()
    opt.step()
    out = ref("npu_apply_adam_w")(b1, b2, lr, wd, b1, b2, eps, g2, mx, amsgrad, maximize, out=(var1, m1, v1))
    torch.testing.assert_close(out[0], p.detach())
    torch.testing.assert_close(out[1], st["exp_avg"])
    torch.testing.assert_close(out[2], st["exp_avg_sq"])
    if amsgrad:
        with pytest.raises(ValueError):
            ref("npu_apply_adam_w")(b1, b2, lr, wd, b1, b2, eps, g2, None, True, False, out=(var1, m1, v1))


# --------------------------------------------------------------------------------------------- group_norm_silu
@pytest.mark.parametrize("shape,group,affine", [((2, 6, 3, 2), 3, True), ((3, 4), 2, True), ((2, 4, 5), 4, False)])
def test_group_norm_silu(shape, group, affine):
    x = randn(*shape, requires_grad=True)
    c = shape[1]
    w = randn(c, seed=1, requires_grad=True) if affine else None
    b = randn(c, seed=2, requires_grad=True) if affine else None
    out, mean, rstd = ref("npu_group_norm_silu")(x, w, b, group, 1e-3)
    xg = x.reshape(shape[0], group, -1)
    exp_mean = xg.sum(-1) / xg.shape[-1]
    exp_rstd = 1.0 / torch.sqrt(((xg - exp_mean[..., None]) ** 2).sum(-1) / xg.shape[-1] + 1e-3)
    torch.testing.assert_close(mean, exp_mean)
    torch.testing.assert_close(rstd, exp_rstd)
    gn = F.group_norm(x, group, w, b, 1e-3)
    torch.testing.assert_close(out, gn * torch.sigmoid(gn))
    assert mean.shape == rstd.shape == (shape[0], group)
    default = ref("npu_group_norm_silu")(x, w, b, group)[0]
    gn5 = F.group_norm(x, group, w, b, 1e-5)
    torch.testing.assert_close(default, gn5 * torch.sigmoid(gn5))
    args = (x, w, b) if affine else (x,)
    fn = (lambda a, c_, d: ref("npu_group_norm_silu")(a, c_, d, group)[0]) if affine else \
        (lambda a: ref("npu_group_norm_silu")(a, None, None, group)[0])
    assert gradcheck(fn, args)


# ------------------------------------------------------------------------------------------------------- mish
def test_mish():
    x = randn(4, 6, requires_grad=True) * 3
    torch.testing.assert_close(ref("npu_mish")(x), x * torch.tanh(torch.log1p(torch.exp(x))))
    assert gradcheck(ref("npu_mish"), (randn(3, 3, requires_grad=True),))


# ---------------------------------------------------------------------------------------- moe_gating_top_k_softmax
def moe_loop(x, finished, k):
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    ys, ids = [], []
    for r in range(rows):
        e = torch.exp(flat[r] - flat[r].max())
        p = e / e.sum()
        order = sorted(range(p.numel()), key=lambda j: (-p[j].item(), j))[:k]
        ys.append(torch.stack([p[j] for j in order]))
        fin = finished is not None and bool(finished.reshape(-1)[r])
        ids.append([x.shape[-1] if fin else j for j in order])
    row_idx = [[j * rows + r for j in range(k)] for r in range(rows)]
    shape = (*x.shape[:-1], k)
    return (torch.stack(ys).reshape(shape), torch.tensor(ids, dtype=torch.int32).reshape(shape),
            torch.tensor(row_idx, dtype=torch.int32).reshape(shape))


@pytest.mark.parametrize("shape,k,with_finished", [((5, 6), 2, False), ((5, 6), 3, True), ((2, 3, 4), 2, True),
                                                   ((4, 3), 1, False)])
def test_moe_gating_top_k_softmax(shape, k, with_finished):
    x = randn(*shape, requires_grad=True)
    finished = (torch.rand(shape[:-1], generator=gen(4)) < 0.5) if with_finished else None
    kw = {} if k == 1 else {"k": k}
    y, idx, row_idx = ref("npu_moe_gating_top_k_softmax")(x, finished, **kw)
    ey, eidx, erow = moe_loop(x, finished, k)
    torch.testing.assert_close(y, ey)
    assert idx.dtype == row_idx.dtype == torch.int32
    assert torch.equal(idx, eidx) and torch.equal(row_idx, erow)
    assert gradcheck(lambda t: ref("npu_moe_gating_top_k_softmax")(t, finished, k)[0], (x,))


def test_moe_gating_ties_prefer_lower_expert():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0]], dtype=DT)
    _, idx, _ = ref("npu_moe_gating_top_k_softmax")(x, None, 2)
    assert idx.tolist() == [[1, 2]]


# ----------------------------------------------------------------------------------------------------- sort_v2
def test_sort_v2():
    x = randn(3, 5, requires_grad=True)
    rows = [sorted(r.tolist()) for r in x.detach()]
    assert ref("npu_sort_v2")(x).tolist() == rows
    assert ref("npu_sort_v2")(x, -1, True).tolist() == [r[::-1] for r in rows]
    assert ref("npu_sort_v2")(x.float()).dtype == torch.float32
    assert gradcheck(ref("npu_sort_v2"), (x,))
