"""A captured call's cost split by piece (issue 25, goal 2), side by side in one run:

    python bench/call_split.py [--steps 8] [--rounds 40] [--loop-calls 54] [--touch-kib 0]

TinyLM (tiny, bfloat16, dropout 0.1: bench/overhead.py's `--per-call` model) trains with the capture mode recording
every call (records discarded), and with the same mode with one piece left out at a time. The variants alternate
step by step in this process, so that they share the machine's state, in a new order each step: the step after an off
step finds the agent's code and data out of the caches, which a fixed order would charge to one variant. The fastest
step of the training thread's CPU of each is kept (other work on the machine only adds time). Each line is that step
above off, per captured call; the piece's cost is what leaving it out saves. The pieces:

- the backward taps (the capture without them: `Capturer(backward=None)`): the input taps, the hooks and the
  backward records;
- the hooks the taps put on autograd nodes (the taps kept, no hook put on), and what they run in the backward pass;
- the backward record a complete entry makes (`BackwardTaps._emit`): its gradients' snapshots and the record;
- a random call's generator state and dropout mask (`Capturer._random_state`);
- the module path and the source line of each call (npu_agent.location), each apart;
- the autocast state of each call.

A variant leaving a piece out makes wrong records: this measures, it checks nothing. Wrapping each function in a
timer instead adds each wrapper's own cost and misses what a piece costs the rest of the step.

Then the same capture on a loop of plain calls (`F.linear`, `F.gelu`, `F.layer_norm`, a product, a sum, `tanh` on 16
x 32 float32 tensors, then a backward; no module, no random call, no optimizer), against the same loop with the
checker off: what a captured call costs where the training does little else. `--touch-kib` adds a buffer of that size
written between the calls, in both, as a training's own memory traffic would go through the caches.

The process runs on one core, one torch thread (bench/overhead.py pins it at import).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from collections.abc import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402  (pins this process to one core and torch to one thread on import)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.demo import TinyLM, batches, train_step  # noqa: E402
from npu_agent import backward, capture, location  # noqa: E402


def _nothing(*args, **kwargs) -> None:
    return None


def _no_autocast(args, kwargs) -> tuple[bool, str, str]:
    return (False, "", "cpu")


def _empty(frame=None) -> str:
    return ""


# variant -> the (object, attribute, replacement) it patches for its steps; "no backward taps" is another capturer
LEFT_OUT: dict[str, tuple[tuple[object, str, Callable], ...]] = {
    "no hooks (the taps kept)": ((backward, "_post_hook", _nothing), (backward, "_pre_hook", _nothing)),
    "no backward record": ((backward.BackwardTaps, "_emit", _nothing),),
    "no random state nor mask": ((capture.Capturer, "_random_state", _nothing),),
    "no module path": ((location, "module_path", _empty),),
    "no source line": ((location, "source", _empty),),
    "no autocast state": ((capture, "autocast_state", _no_autocast),),
}
NO_TAPS = "no backward taps"


@contextlib.contextmanager
def left_out(patches: tuple[tuple[object, str, Callable], ...]) -> Iterator[None]:
    """The patches in place for the block, the originals back after it (whatever the block raised)."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def split(steps: int, rounds: int) -> dict:
    """us a captured call above off of each variant (the fastest step of each), TinyLM."""
    kwargs, batch, dtype = overhead.MODELS["tiny"]
    torch.manual_seed(0)
    model = TinyLM(dropout=0.1, **kwargs).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = list(batches(steps, batch=batch, seq=kwargs["seq"], vocab=kwargs["vocab"]))
    every, no_taps = overhead._CaptureOnly(), overhead._CaptureOnly(taps=False)
    variants: dict[str, tuple[object, tuple]] = {"off": (None, ()), "every piece": (every, ()), NO_TAPS: (no_taps, ()),
                                                 **{name: (every, patches) for name, patches in LEFT_OUT.items()}}
    for dbg, patches in variants.values():   # warm-up: every call site met, every known tree learned
        with left_out(patches):
            overhead._round(model, opt, data[:2], dbg)
    best = dict.fromkeys(variants, float("inf"))
    calls = records = 0   # of the steps with every piece
    names = list(variants)
    order = random.Random(0)
    for _ in range(rounds):
        for idx, tgt in data:
            # a new order each time: a step after an off step finds the agent's code and data out of the caches, so a
            # fixed order would charge that to the variant after off
            order.shuffle(names)
            for name in names:
                dbg, patches = variants[name]
                captured0, records0 = every.cap.captured, every.records
                with left_out(patches):
                    t0 = time.thread_time()
                    train_step(model, opt, idx, tgt, dbg)
                    best[name] = min(best[name], time.thread_time() - t0)
                if name == "every piece":
                    calls += every.cap.captured - captured0
                    records += every.records - records0
    n = rounds * len(data)
    return {"ms": {k: v * 1e3 for k, v in best.items()}, "calls": calls / n, "records": records / n}


def loop(rounds: int, calls: int, touch_kib: int) -> dict:
    """us a captured call above off on a loop of plain calls (module docstring), the fastest step of each."""
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    buf = torch.zeros(max(1, touch_kib * 1024 // 4)) if touch_kib else None
    ops: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda h: F.linear(h, w, b), F.gelu, lambda h: F.layer_norm(h, (32,)), lambda h: h * 0.5,
        lambda h: h + 1.0, torch.tanh]
    cap = overhead._CaptureOnly()

    def step(dbg) -> None:
        x = torch.randn(16, 32)
        if dbg:
            dbg.start()
        h = x
        for i in range(calls):
            h = ops[i % len(ops)](h)
            if buf is not None:
                with torch._C.DisableTorchFunction():   # the training's own traffic, not a call the mode sees
                    buf.add_(1.0)
        h.sum().backward()
        if dbg:
            dbg.stop()
        w.grad = b.grad = None
        if dbg:
            dbg.step()

    for dbg in (None, cap, None, cap):
        step(dbg)
    best = {"off": float("inf"), "captured": float("inf")}
    for _ in range(rounds):
        for name, dbg in (("off", None), ("captured", cap)):
            t0 = time.thread_time()
            step(dbg)
            best[name] = min(best[name], time.thread_time() - t0)
    return {"ms": {k: v * 1e3 for k, v in best.items()}, "calls": calls + 1}   # (the loss's sum is captured too)


def report(r: dict, lp: dict, touch_kib: int) -> None:
    ms, calls = r["ms"], r["calls"]
    per_call = {k: (v - ms["off"]) * 1e3 / calls for k, v in ms.items() if k != "off"}
    full = per_call["every piece"]
    print(f"TinyLM (tiny, bfloat16, dropout 0.1): {calls:.0f} captured calls a step ({r['records']:.0f} records with "
          f"the backward ones), variants alternating step by step; off {ms['off']:.3f} ms a step")
    print(f"  {'variant':28s} {'ms/step':>8s} {'us/captured call':>17s} {'the piece left out':>19s}")
    for name, value in per_call.items():
        piece = "" if name == "every piece" else f"{full - value:8.1f} us"
        print(f"  {name:28s} {ms[name]:8.3f} {value:17.1f} {piece:>19s}")
    lms = lp["ms"]
    loop_call = (lms["captured"] - lms["off"]) * 1e3 / lp["calls"]
    touched = f", {touch_kib} KiB written between calls" if touch_kib else ""
    print(f"a loop of {lp['calls']} plain calls (no module, no random call, no optimizer{touched}): off "
          f"{lms['off']:.3f} ms, captured {lms['captured']:.3f} ms a step")
    print()
    print("costs (us a captured call above off)")
    print(f"  TinyLM, every piece            {full:8.1f}   goal <= 20")
    print(f"  a loop of plain calls          {loop_call:8.1f}   goal <= 20")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="TinyLM steps a round")
    p.add_argument("--rounds", type=int, default=40, help="rounds over the steps (and of the loop)")
    p.add_argument("--loop-calls", type=int, default=54, help="plain calls a step of the loop")
    p.add_argument("--touch-kib", type=int, default=0, help="KiB written between the loop's calls (0: none)")
    ns = p.parse_args()
    r = split(ns.steps, ns.rounds)
    lp = loop(ns.rounds * 4, ns.loop_calls, ns.touch_kib)
    report(r, lp, ns.touch_kib)


if __name__ == "__main__":
    main()
