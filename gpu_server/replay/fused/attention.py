"""Reference implementation of ``torch_npu.npu_fusion_attention`` (FlashAttentionScore) in plain torch.

Semantics follow the torch_npu / op-plugin documentation (see ``docs/fused_ops.md`` for the decisions taken where the
documentation is silent):

* ``attention_out = Dropout(Softmax(Mask(scale * (q @ k^T + pse), atten_mask)), keep_prob) @ v``; ``pse`` is added
  before scaling, as the documented formula says. ``scale`` defaults to 1.0 (torch_npu's default, not 1/sqrt(d)).
* ``atten_mask``: True / 1 means "masked out". With ``atten_mask=None`` the documentation says sparse_mode,
  pre_tockens and next_tockens have no effect (full attention); this reference does the same.
* sparse_mode 0 (defaultMask): the given mask, combined with the pre/next band measured from the top-left corner;
  1 (allMask): the given mask only; 2 (leftUpCausal), 3 (rightDownCausal), 4 (band measured from the bottom-right
  corner): the mask must be the compressed 2048x2048 ``triu(ones, 1)`` mask, which is expanded to the S1 x S2 pattern
  of the mode. Modes 5-8 (prefix, varlen outer split) raise ``ValueError``.
* Query rows that see no key at all (for example sparse_mode 3 with S1 > S2) give a zero output (the kernel's
  "invalid row" handling).
* GQA: query head ``i`` uses key/value head ``i // (N1 // N2)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_server.replay.fused.registry import reference

__all__ = ["npu_fusion_attention"]

MAX_TOKENS = 2147483647
COMPRESSED_MASK_SIZE = 2048
_STAT_LAST_DIM = 8
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    # The NPU returns softmax_max / softmax_sum in float32; keep float64 when the bench runs in float64.
    return torch.promote_types(dtype, torch.float32)


def _to_bnsd(x: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, n, h // n).transpose(1, 2)
    s, b, h = x.shape  # SBH
    return x.reshape(s, b, n, h // n).permute(1, 2, 0, 3)


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        return x.transpose(1, 2).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _heads(query, key, value, layout: str, head_num: int) -> tuple[int, int]:
    """(N1, N2) for a non-TND layout, validated."""
    if layout in ("BSH", "SBH"):
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(f"input_layout {layout} needs 3-D query/key/value")
        h1 = query.shape[2]
        if head_num <= 0 or h1 % head_num:
            raise ValueError(f"query hidden size {h1} is not a multiple of head_num {head_num}")
        d = h1 // head_num
        if key.shape[2] % d:
            raise ValueError(f"key hidden size {key.shape[2]} is not a multiple of the head dim {d}")
        n1, n2 = head_num, key.shape[2] // d
        if value.shape[2] % n2:
            raise ValueError(f"value hidden size {value.shape[2]} is not a multiple of the kv head count {n2}")
    else:
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"input_layout {layout} needs 4-D query/key/value")
        ndim = 1 if layout == "BNSD" else 2
        n1, n2 = query.shape[ndim], key.shape[ndim]
        if n1 != head_num:
            raise ValueError(f"head_num {head_num} does not match the query's {n1} heads")
        if value.shape[ndim] != n2:
            raise ValueError("key and value must have the same number of heads")
    if n2 == 0 or n1 % n2:
        raise ValueError(f"query heads ({n1}) must be a multiple of key/value heads ({n2})")
    return n1, n2


def _band(s1: int, s2: int, pre: int, nxt: int, offset: int, device) -> torch.Tensor:
    """Masked (True) outside the band -pre <= (j - i - offset) <= nxt."""
    i = torch.arange(s1, device=device).unsqueeze(1)
    j = torch.arange(s2, device=device).unsqueeze(0)
    rel = j - i - offset
    return (rel > nxt) | (rel < -pre)


def _check_compressed(atten_mask: torch.Tensor, sparse_mode: int) -> None:
    n = COMPRESSED_MASK_SIZE
    if atten_mask.dim() < 2 or tuple(atten_mask.shape[-2:]) != (n, n) or atten_mask.numel() != n * n:
        raise ValueError(
            f"sparse_mode {sparse_mode} expects the compressed {n}x{n} triu(ones, 1) atten_mask, "
            f"got shape {tuple(atten_mask.shape)}"
        )
    expected = torch.ones(n, n, dtype=torch.bool, device=atten_mask.device).triu(1)
    if not torch.equal(atten_mask.reshape(n, n).bool(), expected):
        raise ValueError(
            f"sparse_mode {sparse_mode}: atten_mask is {n}x{n} but not the standard compressed causal mask "
            "triu(ones(2048, 2048), diagonal=1); other compressed masks are not supported"
        )


def _given_mask(atten_mask: torch.Tensor, s1: int, s2: int, varlen: bool) -> torch.Tensor:
    m = atten_mask.bool()
    if m.dim() < 2 or m.dim() > 4:
        raise ValueError(f"atten_mask must be SS, B1SS, 11SS or BNSS, got shape {tuple(atten_mask.shape)}")
    if varlen:
        if any(d != 1 for d in m.shape[:-2]) or m.shape[-2] < s1 or m.shape[-1] < s2:
            raise ValueError(f"TND atten_mask must be (maxSq, maxSkv), got shape {tuple(atten_mask.shape)}")
        return m.reshape(m.shape[-2], m.shape[-1])[:s1, :s2]
    if tuple(m.shape[-2:]) != (s1, s2):
        raise ValueError(f"atten_mask last dims {tuple(m.shape[-2:])} do not match (S1, S2) = ({s1}, {s2})")
    return m


def _build_mask(atten_mask, sparse_mode: int, pre: int, nxt: int, s1: int, s2: int, device, varlen: bool):
    """Bool mask (True = masked) broadcastable to (B, N1, S1, S2), or None for full attention."""
    if atten_mask is None:
        return None
    if sparse_mode == 0:
        return _given_mask(atten_mask, s1, s2, varlen) | _band(s1, s2, pre, nxt, 0, device)
    if sparse_mode == 1:
        return _given_mask(atten_mask, s1, s2, varlen)
    if sparse_mode in (2, 3, 4):
        _check_compressed(atten_mask, sparse_mode)
        if sparse_mode == 2:
            return _band(s1, s2, MAX_TOKENS, 0, 0, device)
        if sparse_mode == 3:
            return _band(s1, s2, MAX_TOKENS, 0, s2 - s1, device)
        return _band(s1, s2, pre, nxt, s2 - s1, device)
    raise ValueError(f"sparse_mode {sparse_mode} (prefix / varlen outer split) is not supported by the reference")


def _check_broadcast(t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """``t`` must broadcast to ``shape`` without enlarging it (e.g. a compressed alibi pse does not)."""
    if t.dim() > len(shape) or any(a not in (1, b) for a, b in zip(reversed(t.shape), reversed(shape))):
        raise ValueError(f"{what} of shape {tuple(t.shape)} does not broadcast to {shape}")


def _attend(q, k, v, mask, pse, scale, keep_prob, drop_mask):
    """q (B,N1,S1,D), k (B,N2,S2,D), v (B,N2,S2,Dv) -> (out (B,N1,S1,Dv), row max, row sum) (stats (B,N1,S1))."""
    n1, n2 = q.shape[1], k.shape[1]
    if n1 != n2:
        k = k.repeat_interleave(n1 // n2, dim=1)
        v = v.repeat_interleave(n1 // n2, dim=1)
    s = torch.matmul(q, k.transpose(-2, -1))
    if pse is not None:
        _check_broadcast(pse, tuple(s.shape), "pse")
        s = s + pse.to(s.dtype)
    s = s * scale
    if mask is not None:
        _check_broadcast(mask, tuple(s.shape), "atten_mask")
        s = s.masked_fill(mask, torch.finfo(s.dtype).min)
    row_max = s.detach().amax(dim=-1, keepdim=True)
    e = torch.exp(s - row_max)
    if mask is not None:
        e = e.masked_fill(mask, 0.0)
    row_sum = e.sum(dim=-1, keepdim=True)
    p = e / row_sum.clamp_min(torch.finfo(s.dtype).tiny)  # rows with no visible key -> all zero
    if drop_mask is not None:
        _check_broadcast(drop_mask, tuple(p.shape), "_dropout_mask")
        p = p * drop_mask.to(p.dtype) / keep_prob
    out = torch.matmul(p, v)
    stat_dtype = _stat_dtype(q.dtype)
    row_max = row_max.squeeze(-1).to(stat_dtype)
    row_sum = row_sum.detach().squeeze(-1).to(stat_dtype)
    if mask is not None:
        empty = row_sum == 0
        row_max = row_max.masked_fill(empty, torch.finfo(torch.float32).min)
    return out, row_max, row_sum


def _expand_stat(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(-1).expand(*x.shape, _STAT_LAST_DIM).contiguous()


def _cum_ends(lens: Sequence[int], name: str) -> list[int]:
    ends: list[int] = []
    prev = 0
    for raw in lens:
        e = int(raw)
        if e < prev:
            if e != 0:
                raise ValueError(f"{name} must be a non-decreasing cumulative list (trailing zeros allowed)")
            break  # trailing batches that do not take part in the computation
        ends.append(e)
        prev = e
    return ends


def _tnd(query, key, value, head_num, atten_mask, scale, keep_prob, pre, nxt, qlens, kvlens, sparse_mode,
         drop_mask):
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError("input_layout TND needs 3-D (T, N, D) query/key/value")
    if qlens is None or kvlens is None or len(qlens) == 0 or len(qlens) != len(kvlens):
        raise ValueError("input_layout TND needs actual_seq_qlen and actual_seq_kvlen of the same, non-zero length")
    n1, n2 = query.shape[1], key.shape[1]
    if n1 != head_num:
        raise ValueError(f"head_num {head_num} does not match the query's {n1} heads")
    if value.shape[1] != n2 or n2 == 0 or n1 % n2:
        raise ValueError(f"query heads ({n1}) must be a multiple of key/value heads ({n2})")
    q_ends, kv_ends = _cum_ends(qlens, "actual_seq_qlen"), _cum_ends(kvlens, "actual_seq_kvlen")
    nb = min(len(q_ends), len(kv_ends))
    t1, t2 = query.shape[0], key.shape[0]
    if (nb and q_ends[nb - 1] > t1) or (nb and kv_ends[nb - 1] > t2):
        raise ValueError(f"actual_seq_qlen/actual_seq_kvlen exceed T ({t1}, {t2})")
    if drop_mask is not None and tuple(drop_mask.shape) != (n1, t1, t2):
        raise ValueError(f"for TND, _dropout_mask must have shape (N1, T1, T2) = ({n1}, {t1}, {t2})")
    outs, maxes, sums = [], [], []
    q0 = k0 = 0
    for b in range(nb):
        q1, k1 = q_ends[b], kv_ends[b]
        sq, skv = q1 - q0, k1 - k0
        if sq > 0:
            qb = query[q0:q1].permute(1, 0, 2).unsqueeze(0)
            kb = key[k0:k1].permute(1, 0, 2).unsqueeze(0)
            vb = value[k0:k1].permute(1, 0, 2).unsqueeze(0)
            mask = _build_mask(atten_mask, sparse_mode, pre, nxt, sq, skv, query.device, varlen=True)
            dm = None if drop_mask is None else drop_mask[:, q0:q1, k0:k1].unsqueeze(0)
            o, m, s = _attend(qb, kb, vb, mask, None, scale, keep_prob, dm)
            outs.append(o.squeeze(0).permute(1, 0, 2))
            maxes.append(m.squeeze(0).transpose(0, 1))
            sums.append(s.squeeze(0).transpose(0, 1))
        q0, k0 = q1, k1
    stat_dtype = _stat_dtype(query.dtype)
    if q0 < t1:  # rows not covered by actual_seq_qlen
        outs.append(query.new_zeros(t1 - q0, n1, value.shape[2]))
        maxes.append(torch.zeros(t1 - q0, n1, dtype=stat_dtype, device=query.device))
        sums.append(torch.zeros(t1 - q0, n1, dtype=stat_dtype, device=query.device))
    out = torch.cat(outs, dim=0)
    numels = n1 * (int(qlens[0]) * int(kvlens[0]) + sum(
        (int(qlens[i]) - int(qlens[i - 1])) * (int(kvlens[i]) - int(kvlens[i - 1])) for i in range(1, len(qlens))))
    return out, _expand_stat(torch.cat(maxes, 0)), _expand_stat(torch.cat(sums, 0)), numels


@reference("npu_fusion_attention")
def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, *, _dropout_mask=None):
    """Reference for ``torch_npu.npu_fusion_attention``.

    Returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)`` like torch_npu:

    * ``attention_out``: in ``input_layout``, dtype of ``query``;
    * ``softmax_max`` / ``softmax_sum``: per query row, the max of the masked, scaled scores and the sum of
      ``exp(score - max)`` over the visible keys, repeated 8 times on the last axis: shape (B, N1, S1, 8), or
      (T1, N1, 8) for TND; float32 (float64 if the inputs are float64); not differentiable;
    * ``softmax_out``: reserved by torch_npu, an empty tensor;
    * ``seed``, ``offset``: 0 (the NPU's Philox state cannot be reproduced here);
    * ``numels``: the dropout-mask length torch_npu reports (B*N1*S1*S2, or N1 * sum(Sq_i * Skv_i) for TND).

    With ``keep_prob < 1`` the operator is random: pass the keep mask (True = kept) as ``_dropout_mask``, shaped
    (B, N1, S1, S2) (or broadcastable to it), or (N1, T1, T2) for TND; kept probabilities are scaled by 1/keep_prob.
    Without it a ``ValueError`` is raised. ``padding_mask``, ``inner_precise``, ``prefix``, ``gen_mask_parallel``
    and ``sync`` do not change the result.
    """
    layout = str(input_layout).upper()
    if layout not in _LAYOUTS:
        raise ValueError(f"input_layout must be one of {_LAYOUTS}, got {input_layout!r}")
    head_num = int(head_num)
    keep_prob = float(keep_prob)
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {keep_prob}")
    if keep_prob < 1.0 and _dropout_mask is None:
        raise ValueError(
            f"npu_fusion_attention with keep_prob={keep_prob} applies a random dropout mask; it can only be "
            "replayed when the recorded keep mask is passed as _dropout_mask"
        )
    drop_mask = _dropout_mask if keep_prob < 1.0 else None
    if sink is not None:
        raise ValueError("npu_fusion_attention: the sink input is not supported by the reference")
    sparse_mode = int(sparse_mode)
    pre, nxt = int(pre_tockens), int(next_tockens)
    scale = float(scale)

    if layout == "TND":
        if pse is not None:
            raise ValueError("npu_fusion_attention: pse with input_layout TND is not supported by the reference")
        out, smax, ssum, numels = _tnd(query, key, value, head_num, atten_mask, scale, keep_prob, pre, nxt,
                                       actual_seq_qlen, actual_seq_kvlen, sparse_mode, drop_mask)
    else:
        n1, n2 = _heads(query, key, value, layout, head_num)
        q = _to_bnsd(query, layout, n1)
        k = _to_bnsd(key, layout, n2)
        v = _to_bnsd(value, layout, n2)
        b, _, s1, _ = q.shape
        s2 = k.shape[2]
        if k.shape[0] != b or v.shape[0] != b or v.shape[2] != s2:
            raise ValueError("query/key/value batch or key/value sequence sizes differ")
        mask = _build_mask(atten_mask, sparse_mode, pre, nxt, s1, s2, query.device, varlen=False)
        o, m, s = _attend(q, k, v, mask, pse, scale, keep_prob, drop_mask)
        out = _from_bnsd(o, layout)
        smax, ssum = _expand_stat(m), _expand_stat(s)
        numels = b * n1 * s1 * s2
    softmax_out = query.new_empty((0,))
    return out, smax, ssum, softmax_out, 0, 0, numels
