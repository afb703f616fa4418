"""A simulated faulty device (docs/design.md §8): single aten kernels replaced, in the TRAINING process only, by subtly
wrong
ones, plus the small training entry point that the faulty-device and no-false-alarm suites run in subprocesses.

`install(case)` registers a Python kernel for the CPU dispatch key of one aten operator through
`torch.library.Library("aten", "IMPL")`. The API the training calls is unchanged (F.gelu, `x + y`, F.linear, ...);
only what the kernel computes differs. Autograd sits above the CPU key, so a forward fault leaves the backward
formula alone and a backward-kernel fault leaves the forward alone. A replacement never calls the operator it
replaces: it computes from other operators (below the autograd key, as the autograd kernel redispatches, and
with torch functions disabled so that no capture mode sees it). The gpu-server, a different process, keeps the
true kernels.

Cases (what each changes, and the API it surfaces under):
- `gelu_forward`:   aten::gelu output scaled by (1 + 2^-6) everywhere           -> Functional.gelu, forward
- `add_ulp`:        aten::add.Tensor output 3 ULP too large in magnitude on 3% of the elements of every floating
                    output (chosen by a fixed hash of the element index)         -> Tensor.add, forward
- `addmm_bf16_acc`: aten::addmm accumulates its K products in bfloat16 (every partial sum rounded to bfloat16)
                    instead of float32                                           -> Functional.linear with a bias
                    (linear folds to addmm), forward; a bias-free linear (mm) is untouched
- `gelu_backward`:  aten::gelu_backward drops the x * pdf(x) term of d gelu / dx -> Functional.gelu, backward
- `layer_norm_backward`: aten::native_layer_norm_backward's grad_input drops the mean(g * x_hat) * x_hat term
                    (grad_weight and grad_bias stay right)                        -> Functional.layer_norm, backward
Issue 10's faults:
- `gelu_tanh`:      aten::gelu uses the tanh approximation whatever `approximate` says -> Functional.gelu, forward
- `layer_norm_no_eps`: aten::native_layer_norm ignores eps (its saved rstd too)  -> Functional.layer_norm, both
- `softmax_backward_2pct`: aten::_softmax_backward_data misses 2 % of its row-sum term -> Torch.softmax, backward
- `addmm_bf16_block16`: bfloat16 aten::addmm rounds its float32 partial sum to bfloat16 every 16 products
                                                                                 -> Functional.linear, forward
- `embedding_backward_overwrite`: aten::embedding_dense_backward lets the last of repeated indices win instead of
                    summing                                                      -> Functional.embedding, backward
- `mul_ulp_1pct`:   bfloat16 aten::mul.Tensor `--fault-ulps` (2) ULP too large on `--fault-per-mille` (10) of 1000
                    elements                                                     -> Tensor.mul, both (its backward
                    uses mul)

Entry point (a training subprocess): `python -c "from tests.faulty_kernels import main; main()" --config agent.json
--model tinylm|convnet|moe|attn --dtype bfloat16 [--case CASE] [--steps 1] [--dropout 0.1] [--seed 0]
[--second-device]`. `--second-device` (or SECOND_DEVICE=1) installs tests/second_device.py's correct kernels first;
a fault installed after them replaces its own operator only.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CASES = ("gelu_forward", "add_ulp", "addmm_bf16_acc", "gelu_backward", "layer_norm_backward", "gelu_tanh",
         "layer_norm_no_eps", "softmax_backward_2pct", "addmm_bf16_block16", "embedding_backward_overwrite",
         "mul_ulp_1pct")
MUL_SHARE_PER_MILLE = 10   # 1% of the elements (--fault-per-mille; bench/fidelity.py sweeps it)
MUL_ULPS = 2               # (--fault-ulps)
GELU_SCALE = 1 + 2.0 ** -6
ADD_SHARE_PER_MILLE = 30   # 3% of the elements
ADD_ULPS = 3

_LIBS: list = []           # keep the registrations alive for the life of the process


@contextlib.contextmanager
def _below():
    """What the replacement computes must reach the real kernels of other ops: no autograd, no torch functions."""
    with torch._C._AutoDispatchBelowAutograd(), torch._C.DisableTorchFunction():
        yield


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The precision a correct kernel computes in: float32 for 16-bit floats, float64 for float32."""
    return t.double() if t.dtype in (torch.float32, torch.float64) else t.float()


# -- (a) gelu forward slightly off everywhere ------------------------------------------------------------------
def _gelu_exact(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1 + torch.tanh(inner))
    return 0.5 * x * (1 + torch.erf(x * (1 / math.sqrt(2))))


def _gelu_scaled(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    with _below():
        return (_gelu_exact(_wide(x), approximate) * GELU_SCALE).to(x.dtype)


# -- (b) add: a few ULP off on a small share of elements -------------------------------------------------------
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}


def _add_ulp(self: torch.Tensor, other, *, alpha=1) -> torch.Tensor:
    with _below():
        if self.dtype == torch.bool and isinstance(other, torch.Tensor) and other.dtype == torch.bool:
            return torch.logical_or(self, other)
        out = torch.sub(self, other, alpha=-alpha)   # a + alpha * b, exactly as add rounds it (negation is exact)
        if out.dtype not in _INT_VIEW or out.numel() == 0:
            return out
        out = out.contiguous()
        index = torch.arange(out.numel(), dtype=torch.int64).reshape(out.shape)
        chosen = torch.remainder(index * 2654435761, 1000) < ADD_SHARE_PER_MILLE
        chosen &= torch.isfinite(out) & (out != 0)
        bits = out.view(_INT_VIEW[out.dtype])
        # sign-magnitude: raising the bit pattern by k raises |value| by k ULP for either sign
        return torch.where(chosen, bits.sub(-ADD_ULPS), bits).view(out.dtype)


# -- (c) matmul accumulating in bfloat16 -----------------------------------------------------------------------
def _addmm_bf16_acc(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    with _below():
        a, b = mat1.float(), mat2.float()
        products = a.unsqueeze(2) * b.unsqueeze(0)                # (M, K, N), each product exact in float32
        acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)
        for k in range(a.shape[1]):
            acc = (acc.float() + products[:, k, :]).to(torch.bfloat16)
        out = acc.float() * alpha
        if beta != 0:
            out = out + bias.float() * beta
        return out.to(torch.promote_types(mat1.dtype, bias.dtype))


# -- (d) backward kernels with a wrong term --------------------------------------------------------------------
def _gelu_backward_no_pdf_term(grad: torch.Tensor, x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    with _below():
        xw = _wide(x)
        if approximate == "tanh":
            cdf = 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xw + 0.044715 * xw * xw * xw)))
        else:
            cdf = 0.5 * (1 + torch.erf(xw * (1 / math.sqrt(2))))
        return (_wide(grad) * cdf).to(grad.dtype)        # right: grad * (cdf + x * pdf(x))


def _layer_norm_backward_no_projection(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    with _below():
        dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
        outer = tuple(range(x.dim() - len(normalized_shape)))
        g, xw, mu, rs = _wide(grad_out), _wide(x), _wide(mean), _wide(rstd)
        x_hat = (xw - mu) * rs
        gw = g * _wide(weight) if weight is not None else g
        # right: rstd * (gw - mean(gw) - x_hat * mean(gw * x_hat)); the last term is missing here
        grad_input = (rs * (gw - gw.mean(dim=dims, keepdim=True))).to(x.dtype) if output_mask[0] else None
        grad_weight = (g * x_hat).sum(dim=outer).to(weight.dtype) if output_mask[1] and weight is not None else None
        grad_bias = g.sum(dim=outer).to(bias.dtype) if output_mask[2] and bias is not None else None
        return grad_input, grad_weight, grad_bias


# -- (e) the faults of the second-device suite ----------------------------------------------------------------------
def _gelu_tanh_always(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    """The tanh approximation whatever `approximate` says."""
    with _below():
        return _gelu_exact(_wide(x), "tanh").to(x.dtype)


def _layer_norm_no_eps(x, normalized_shape, weight, bias, eps):
    with _below():
        dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
        xw = _wide(x)
        mean = xw.mean(dim=dims, keepdim=True)
        var = (xw - mean).square().mean(dim=dims, keepdim=True)
        rstd = var.rsqrt()                                   # right: (var + eps).rsqrt()
        out = (xw - mean) * rstd
        if weight is not None:
            out = out * _wide(weight)
        if bias is not None:
            out = out + _wide(bias)
        return out.to(x.dtype), mean.to(x.dtype), rstd.to(x.dtype)


def _softmax_backward_short(grad_output, output, dim, input_dtype):
    with _below():
        g, y = _wide(grad_output), _wide(output)
        # right: y * (g - sum(g * y)); 2 % of the row-sum term is missing here
        return (y * (g - 0.98 * (g * y).sum(dim=dim, keepdim=True))).to(grad_output.dtype)


def _addmm_bf16_block16(bias, mat1, mat2, *, beta=1, alpha=1):
    """bfloat16 matmul whose float32 partial sum is rounded to bfloat16 after every 16 products."""
    with _below():
        if mat1.dtype != torch.bfloat16:
            out = (mat1.double().unsqueeze(2) * mat2.double().unsqueeze(0)).sum(1) * alpha + bias.double() * beta
            return out.to(torch.promote_types(mat1.dtype, bias.dtype))
        a, b = mat1.float(), mat2.float()
        acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
        for s in range(0, a.shape[1], 16):
            block = (a[:, s:s + 16].unsqueeze(2) * b[s:s + 16].unsqueeze(0)).sum(1)
            acc = (acc + block).to(torch.bfloat16).float()
        out = acc * alpha
        if beta != 0:
            out = out + bias.float() * beta
        return out.to(torch.bfloat16)


def _embedding_backward_overwrite(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    """Repeated indices: the last gradient row wins instead of the sum."""
    with _below():
        g = grad_output.reshape(-1, grad_output.shape[-1])
        idx = indices.reshape(-1)
        out = torch.zeros(num_weights, g.shape[-1], dtype=grad_output.dtype)
        out.index_put_((idx,), g, accumulate=False)
        if padding_idx >= 0:
            out[padding_idx] = 0
        return out


def _mul_ulp(self: torch.Tensor, other) -> torch.Tensor:
    """bfloat16 products MUL_ULPS ULP too large in magnitude on 1 % of the elements."""
    with _below():
        out = torch.div(self, torch.reciprocal(other.double()) if isinstance(other, torch.Tensor) else 1.0 / other)
        out = out.to(torch.promote_types(self.dtype, other.dtype) if isinstance(other, torch.Tensor) else self.dtype)
        if out.dtype != torch.bfloat16 or out.numel() == 0:
            return out
        out = out.contiguous()
        index = torch.arange(out.numel(), dtype=torch.int64).reshape(out.shape)
        # the hash through aten::mul.out: `index * k` would call this replaced mul.Tensor itself, whose division
        # by a float64 reciprocal is inexact for these integers (the chosen share was then not the one asked for)
        hashed = torch.mul(index, 2654435761, out=torch.empty_like(index))
        chosen = (torch.remainder(hashed, 1000) < MUL_SHARE_PER_MILLE) & torch.isfinite(out) & (out != 0)
        bits = out.view(torch.int16)
        return torch.where(chosen, bits + MUL_ULPS, bits).view(out.dtype)


_KERNELS = {
    "gelu_forward": ("gelu", _gelu_scaled),
    "add_ulp": ("add.Tensor", _add_ulp),
    "addmm_bf16_acc": ("addmm", _addmm_bf16_acc),
    "gelu_backward": ("gelu_backward", _gelu_backward_no_pdf_term),
    "layer_norm_backward": ("native_layer_norm_backward", _layer_norm_backward_no_projection),
    "gelu_tanh": ("gelu", _gelu_tanh_always),
    "layer_norm_no_eps": ("native_layer_norm", _layer_norm_no_eps),
    "softmax_backward_2pct": ("_softmax_backward_data", _softmax_backward_short),
    "addmm_bf16_block16": ("addmm", _addmm_bf16_block16),
    "embedding_backward_overwrite": ("embedding_dense_backward", _embedding_backward_overwrite),
    "mul_ulp_1pct": ("mul.Tensor", _mul_ulp),
}


def install(case: str) -> None:
    """Replace the CPU kernel of the case's aten operator in this process (for the rest of its life)."""
    import warnings

    op, fn = _KERNELS[case]
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Overriding a previously registered kernel": that is the point
        lib.impl(op, fn, "CPU")
    _LIBS.append(lib)


# -- a second model for the suites: convolutions, layer_norm, softmax, residuals -------------------------------
class ConvNet(nn.Module):
    """Conv stem, two residual conv blocks with layer_norm over channels, attention-style softmax pooling, an MLP
    head with a residual and silu."""

    def __init__(self, channels: int = 8, classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(channels) for _ in range(2))
        self.score = nn.Linear(channels, 1)
        self.fc1 = nn.Linear(channels, 4 * channels)
        self.fc2 = nn.Linear(4 * channels, channels)
        self.head = nn.Linear(channels, classes)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        for conv, norm in zip(self.convs, self.norms):
            y = norm(conv(h).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            h = h + F.dropout(F.gelu(y), self.dropout, self.training)
        tokens = h.flatten(2).transpose(1, 2)                        # (B, HW, C)
        weights = torch.softmax(self.score(tokens).squeeze(-1), dim=-1)
        pooled = (weights.unsqueeze(-1) * tokens).sum(dim=1)        # (B, C)
        pooled = pooled + self.fc2(F.silu(self.fc1(pooled)))
        return F.cross_entropy(self.head(pooled).float(), targets)


def _conv_batches(steps: int, batch: int = 4, size: int = 8, classes: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)


def _train(model: nn.Module, batches, config_path: str, cast: torch.dtype | None = None) -> None:
    """AdamW steps of `model` over `batches` ((input, targets) pairs), each step captured by the agent; with `cast`
    the input is cast to that dtype inside the captured region."""
    from npu_agent import PrecisionDebugger

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    debugger = PrecisionDebugger(config_path=config_path)
    for x, targets in batches:
        debugger.start()
        loss = model(x.to(cast) if cast is not None else x, targets)
        loss.backward()
        debugger.stop()
        opt.step()
        opt.zero_grad(set_to_none=True)
        debugger.step()
    debugger.close()


def train_convnet(config_path: str, steps: int, dtype: torch.dtype, dropout: float, seed: int = 0) -> None:
    torch.manual_seed(seed)
    _train(ConvNet(dropout=dropout).to(dtype), _conv_batches(steps, seed=seed), config_path, cast=dtype)


class MoE(nn.Module):
    """A mixture-of-experts layer over token embeddings: a softmax router picks the top-2 experts per token
    (`topk`), each expert's tokens are gathered, transformed and added back with `index_add`; a load-balancing
    mask is built with `scatter`."""

    def __init__(self, vocab: int = 64, d: int = 16, experts: int = 4, classes: int = 10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(experts))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).flatten(0, 1)                                  # (N, d)
        probs = torch.softmax(self.router(x), dim=-1)
        weights, chosen = torch.topk(probs, 2, dim=-1)                   # (N, 2)
        load = torch.zeros_like(probs).scatter(1, chosen, 1.0)           # (N, E) one-hot of the chosen experts
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel():
                y = expert(x.index_select(0, rows)) * weights[rows, slot].unsqueeze(-1)
                out = out.index_add(0, rows, y)
        h = self.ln(x + out).view(idx.shape[0], idx.shape[1], -1).mean(dim=1)
        aux = (load.mean(0) * probs.mean(0)).sum()
        return F.cross_entropy(self.head(h).float(), targets) + aux.float()


class AttnNet(nn.Module):
    """One attention layer with dropout inside the fused attention (`F.scaled_dot_product_attention(dropout_p=)`)."""

    def __init__(self, vocab: int = 64, d: int = 16, heads: int = 2, classes: int = 10, dropout: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)
        self.heads, self.p = heads, dropout

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        h = self.ln(x + a.transpose(1, 2).reshape(b, t, d)).mean(dim=1)
        return F.cross_entropy(self.head(h).float(), targets)


def train_tokens(model_cls, config_path: str, steps: int, dtype: torch.dtype, dropout: float, seed: int = 0,
                 vocab: int = 64, classes: int = 10) -> None:
    """Train MoE or AttnNet on random token sequences (batch 4, length 8) for `steps` steps with the agent."""
    torch.manual_seed(seed)
    model = (model_cls(dropout=dropout) if model_cls is AttnNet else model_cls()).to(dtype)
    g = torch.Generator().manual_seed(seed)
    batches = ((torch.randint(0, vocab, (4, 8), generator=g), torch.randint(0, classes, (4,), generator=g))
               for _ in range(steps))
    _train(model, batches, config_path)


MODELS = ("tinylm", "convnet", "moe", "attn")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--model", choices=MODELS, default="tinylm")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--case", choices=CASES, default=None)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gelu-scale-log2", type=int, default=None, help="gelu_forward: scale by 1 + 2^-K (K = 6)")
    p.add_argument("--fault-ulps", type=int, default=None, help="mul_ulp_1pct: ULPs off (default 2)")
    p.add_argument("--fault-per-mille", type=int, default=None, help="mul_ulp_1pct: elements off per 1000 (10)")
    p.add_argument("--second-device", action="store_true",
                   help="install tests/second_device.py's kernels first (also: SECOND_DEVICE=1)")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    if ns.second_device or os.environ.get("SECOND_DEVICE") == "1":
        from tests import second_device

        second_device.install()
    global MUL_ULPS, MUL_SHARE_PER_MILLE, GELU_SCALE
    GELU_SCALE = 1 + 2.0 ** -ns.gelu_scale_log2 if ns.gelu_scale_log2 is not None else GELU_SCALE
    MUL_ULPS = ns.fault_ulps if ns.fault_ulps is not None else MUL_ULPS
    MUL_SHARE_PER_MILLE = ns.fault_per_mille if ns.fault_per_mille is not None else MUL_SHARE_PER_MILLE
    if ns.case:
        install(ns.case)
    dtype = getattr(torch, ns.dtype)
    if ns.model == "tinylm":
        from examples.demo import train

        train(ns.config, steps=ns.steps, dtype=dtype, dropout=ns.dropout, seed=ns.seed)
    elif ns.model == "convnet":
        train_convnet(ns.config, ns.steps, dtype, ns.dropout, seed=ns.seed)
    else:
        train_tokens(MoE if ns.model == "moe" else AttnNet, ns.config, ns.steps, dtype, ns.dropout, seed=ns.seed)


if __name__ == "__main__":
    main()


# -- the test side: run trainings against one server, read what the reports flagged ----------------------------
TRAIN_SCRIPT = "from tests.faulty_kernels import main; main()"


def run_trainings(config_path: str, runs: list[list[str]]) -> None:
    """Run one training subprocess per entry of `runs` (extra arguments of `main`) concurrently, the i-th with
    RANK=i, so that each gets its own per-rank report files on the shared server."""
    from tests import support

    support.run_ranks(TRAIN_SCRIPT, [(["--config", config_path, *args], {"WORLD_SIZE": str(len(runs)),
                                                                         "RANK": str(rank)})
                                     for rank, args in enumerate(runs)])


def flagged(out_dir: str, rank: int, kind: str, status: str = "error") -> set[tuple[str, str]]:
    """(API call, "forward" | "backward") pairs whose Forward/Backward Test Success is `status` in the result file
    `kind` (api_precision_compare_result or accuracy_checking_result) of `rank`."""
    from tests import support

    rows = support.read_csv(out_dir, kind, rank)
    key = "API Name" if kind.startswith("api_precision") else "API name"
    found = set()
    for row in rows:
        for direction in ("forward", "backward"):
            if row[f"{direction.capitalize()} Test Success"] == status:
                found.add((row[key], direction))
    return found
