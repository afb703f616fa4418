"""The main job in one command: `python -m examples.demo` from the repository root (`bash scripts/demo.sh`).

Starts `gpu-server` in its own process on a free loopback port, trains a small transformer language model on the
CPU in bfloat16 with the agent for a few steps, stops the server (SIGTERM: it drains and flushes) and prints the
summary and where the reports are. The model and the training loop are also used by the tests and bench/.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpu_server.reports import files as report_files


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).contiguous().view(b, t, d)
        x = x + F.dropout(self.proj(a), self.dropout, self.training)
        h = F.gelu(self.fc(self.ln2(x)))
        return x + F.dropout(self.out(h), self.dropout, self.training)


class TinyLM(nn.Module):
    """A nanoGPT-style language model: token + position embeddings, pre-norm blocks, tied output head."""

    def __init__(self, vocab: int = 96, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 16,
                 dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.dropout = dropout
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = F.dropout(x, self.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.tok.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def batches(steps: int, batch: int = 4, seq: int = 16, vocab: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield data[:, :-1], data[:, 1:]


def train(config_path: str | None, steps: int = 3, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          dropout: float = 0.1, debugger=None) -> tuple[TinyLM, list[float], dict | None]:
    """Train TinyLM for `steps` steps, with the agent when a config (or a debugger) is given.
    Returns the model, the losses and the agent's counts (None without the agent)."""
    torch.manual_seed(seed)
    model = TinyLM(dropout=dropout).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    if debugger is None and config_path:
        from npu_agent import PrecisionDebugger

        debugger = PrecisionDebugger(config_path=config_path)
    losses = [train_step(model, opt, idx, targets, debugger) for idx, targets in batches(steps, seed=seed)]
    counts = debugger.close() if debugger else None
    return model, losses, counts


def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor,
               debugger=None) -> float:
    """One step of the usual loop, with the checker's start/stop/step around it when a debugger is given."""
    if debugger:
        debugger.start()
    loss = model(idx, targets)
    loss.backward()
    if debugger:
        debugger.stop()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if debugger:
        debugger.step()
    return float(loss.detach())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for the reports (default: a new temporary folder)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--fault", action="store_true",
                   help="train with one SIMULATED device bug (gelu 1.6 %% too large, examples/demo_fault.py) to see "
                        "what a finding looks like")
    ns = p.parse_args(argv)
    work = os.path.abspath(ns.out) if ns.out else tempfile.mkdtemp(prefix="online-check-demo-")
    os.makedirs(work, exist_ok=True)
    out, port = os.path.join(work, "reports"), _free_port()
    server_cfg, agent_cfg = os.path.join(work, "server.json"), os.path.join(work, "agent.json")
    with open(server_cfg, "w") as fh:
        json.dump({"task": "run_ut", "run_ut": {"white_list": [], "black_list": [], "error_data_path": "./",
                                                "is_online": True, "nfs_path": "", "host": "127.0.0.1",
                                                "port": port, "rank_list": [], "tls_path": ""}}, fh, indent=2)
    with open(agent_cfg, "w") as fh:
        json.dump({"task": "tensor", "dump_path": os.path.join(work, "dump"), "level": "L1", "rank": [], "step": [],
                   "tensor": {"scope": [], "list": [], "online_run_ut": True, "nfs_path": "", "host": "127.0.0.1",
                              "port": port, "tls_path": "", "online_run_ut_recompute": False}}, fh, indent=2)
    log_path = os.path.join(work, "gpu_server.log")
    print(f"[demo] starting gpu-server on 127.0.0.1:{port} (log: {log_path})", flush=True)
    log = open(log_path, "w")
    server = subprocess.Popen([sys.executable, "-m", "gpu_server.cli", "--config", server_cfg, "--out", out,
                               "--quiet"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            if server.poll() is not None:
                print(f"[demo] gpu-server exited early:\n{open(log_path).read()}", file=sys.stderr)
                return 1
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.time() > deadline:
                print("[demo] gpu-server did not start within 120 s", file=sys.stderr)
                return 1
            time.sleep(0.2)
        dtype = getattr(torch, ns.dtype)
        if ns.fault:
            from examples import demo_fault

            demo_fault.install()
            print("[demo] --fault: this training runs with a SIMULATED device bug: aten::gelu returns outputs 1.6 % "
                  "too large (examples/demo_fault.py); the server keeps the true kernel", flush=True)
        print(f"[demo] training TinyLM for {ns.steps} steps in {ns.dtype} with the agent", flush=True)
        t0 = time.time()
        _, losses, _ = train(agent_cfg, steps=ns.steps, dtype=dtype)
        print(f"[demo] training done in {time.time() - t0:.1f} s; losses "
              + ", ".join(f"{x:.4f}" for x in losses if math.isfinite(x)), flush=True)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=600)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    text = open(log_path).read()
    start = text.find("gpu-server summary")
    print(text[start:] if start >= 0 else text[-4000:])
    print(f"[demo] reports are in {out}")
    pages = sorted(glob.glob(report_files.html_path(glob.escape(out), "*")))
    if pages:
        print(f"[demo] HTML report (open it first: first failing call, module, source line, evidence): {pages[-1]}")
    return server.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
