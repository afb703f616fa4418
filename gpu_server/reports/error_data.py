"""`error_data_path` online (docs/design.md §6.1): the inputs, outputs and gradients of each failing API call are saved
as
safetensors with a JSON description of the call and a small script that replays that one call.

    error_data/{ts}/{run_id}/rank{r}/{Functional.linear.0}.step{s}/
        tensors.safetensors   every tensor, by key (input.3, output.0, grad_output.0, grad_input.1, mask)
        call.json             the API, the argument structure with tensor keys, autocast, what failed
        replay.py             python replay.py  -> replays the call (bench and same-dtype) and prints the metrics

Loading never unpickles: safetensors holds raw buffers behind a validated header, call.json is plain JSON.

Each training run (the agent's run id) has its own folder, so a second run never overwrites the first's evidence.
The evidence is capped (`Evidence`): past the cap, and when the disk is full, a call's evidence is not saved (the
call is still checked and reported; the skip is counted in the summary and said once in the log) and a folder is
never left half written. A call is saved only when its tensors fit whole under the cap (their bytes are reserved
before writing, so workers saving at once never overshoot it together).

The cap, per server session (`error_data/{ts}/`, kept across restarts with the same --out), is
`--error-data-max-mb` when given (0: save nothing), else the default `default_max_bytes`:

    min(1 GiB, a quarter of the space free on the error_data_path file system when the session starts)

so that a client sending many failing calls with large tensors can neither fill the disk (the spool and the reports
need it; a full disk pauses intake for every agent: gpu_server/disk.py) nor take more than a quarter of what is
left. When the free space cannot be measured, the cap is 1 GiB. For more, give --error-data-max-mb explicitly.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gpu_server.job import Job
from protos.codec import dtype_from_name, dtype_name

_SCRIPT = '''"""Replays {name} (step {step}, rank {rank}) from the saved data: python replay.py"""
import os
import sys

from gpu_server.reports.error_data import replay_folder

sys.exit(replay_folder(os.path.dirname(os.path.abspath(__file__))))
'''


def _encode(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}.{len(tensors)}"
        tensors[key] = obj
        return {"tensor": key}
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    if isinstance(obj, torch.dtype):
        return {"dtype": dtype_name(obj)}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, slice):
        return {"slice": [_encode(v, tensors, prefix) for v in (obj.start, obj.stop, obj.step)]}
    if obj is Ellipsis:
        return {"ellipsis": True}
    if isinstance(obj, torch.Size):
        return {"size": list(obj)}
    if isinstance(obj, (tuple, list)):
        return {"tuple" if isinstance(obj, tuple) else "list": [_encode(v, tensors, prefix) for v in obj]}
    if isinstance(obj, dict):
        return {"dict": {str(k): _encode(v, tensors, prefix) for k, v in obj.items()}}
    return {"opaque": type(obj).__name__}


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(obj, dict):
        return obj
    (kind, value), = obj.items()
    if kind == "tensor":
        return tensors[value]
    if kind == "dtype":
        return dtype_from_name(value)
    if kind == "device":
        return torch.device("cpu")
    if kind == "slice":
        return slice(*(_decode(v, tensors) for v in value))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "size":
        return torch.Size(value)
    if kind in ("tuple", "list"):
        items = [_decode(v, tensors) for v in value]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _decode(v, tensors) for k, v in value.items()}
    raise ValueError(f"call.json: an argument of kind {kind!r} cannot be replayed")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:200]


log = logging.getLogger("gpu_server")


def folder_of(base: str, ts: str, fwd: Job) -> str:
    return os.path.join(base, "error_data", ts, _safe(fwd.run_id) or "run", f"rank{int(fwd.rank)}",
                        f"{_safe(fwd.name)}.step{int(fwd.step)}")


DEFAULT_MAX_BYTES = 1 << 30            # the default cap: 1 GiB ...
DEFAULT_FREE_SHARE = 4                 # ... or a quarter of the free disk space, when that is less


def _free_bytes(path: str) -> int | None:
    """Bytes free to this user on the file system that holds `path` (its nearest existing ancestor)."""
    path = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(path)
            return int(st.f_bavail) * int(st.f_frsize)
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent


def default_max_bytes(base: str) -> int:
    """The cap when --error-data-max-mb is not given: min(1 GiB, a quarter of the free space under `base`)."""
    free = _free_bytes(base)
    return DEFAULT_MAX_BYTES if free is None else min(DEFAULT_MAX_BYTES, free // DEFAULT_FREE_SHARE)


def _du(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


class Evidence:
    """The error data of one session, bounded by `max_bytes` (None: the default cap, `default_max_bytes`); shared
    by the workers."""

    def __init__(self, base: str, ts: str, max_bytes: int | None = None):
        self.explicit = max_bytes is not None
        self.base, self.ts = base, ts
        self.max_bytes: int = max(0, int(max_bytes)) if max_bytes is not None else default_max_bytes(base)
        self._lock = threading.Lock()
        self.used = _du(os.path.join(base, "error_data", ts))     # a restarted session's evidence counts
        self.saved = 0
        self.skipped = 0
        self._said = False
        if not self.explicit:
            log.info("error data (the tensors of failing calls) capped at %.0f MiB per session: min(1 GiB, a "
                     "quarter of the free disk space); --error-data-max-mb sets the cap", self.max_bytes / (1 << 20))

    def _cap_words(self) -> str:
        mib = f"{self.max_bytes / (1 << 20):.4g} MiB"
        if self.explicit:
            return f"--error-data-max-mb ({mib})"
        return (f"the default cap on error data ({mib}: min(1 GiB, a quarter of the free disk space at the start); "
                "--error-data-max-mb sets another)")

    def save(self, fwd: Job, bwd: Job | None, reason: str) -> str | None:
        """Save one failing call's data (never raises); the folder, or None when it was not saved (past the cap,
        or when it could not be written)."""
        folder = folder_of(self.base, self.ts, fwd)
        try:
            need = _tensor_bytes(fwd, bwd) + _FILES_OVERHEAD
        except Exception as exc:  # noqa: BLE001 - saving evidence must not stop the checking
            self._skip(fwd, f"{type(exc).__name__}: {exc}")
            return None
        with self._lock:
            fits = self.used + need <= self.max_bytes
            if fits:
                self.used += need            # reserved: workers saving at once never overshoot the cap together
        if not fits:
            self._skip(fwd, f"{self._cap_words()} is reached (this call's tensors: {need / (1 << 20):.4g} MiB, "
                            f"saved so far: {self.used / (1 << 20):.4g} MiB)")
            return None
        try:
            save(self.base, self.ts, fwd, bwd, reason)
        except Exception as exc:  # noqa: BLE001 - saving evidence must not stop the checking
            shutil.rmtree(folder, ignore_errors=True)       # never half a folder
            with self._lock:
                self.used -= need
            self._skip(fwd, f"{type(exc).__name__}: {exc}")
            return None
        size = _du(folder)
        with self._lock:
            self.used += size - need
            self.saved += 1
        return folder

    def _skip(self, fwd: Job, why: str) -> None:
        with self._lock:
            self.skipped += 1
            say, self._said = not self._said, True
        if say:
            log.warning("error data of %s not saved (the call is reported; later calls not saved are counted in the "
                        "summary, not logged): %s", fwd.name, why)
        return None


_FILES_OVERHEAD = 64 << 10    # call.json, replay.py and the safetensors header of one call, at most (roughly)


def _tensor_bytes(fwd: Job, bwd: Job | None) -> int:
    """The bytes of the tensors `save` writes for this call (before writing any)."""
    tensors: dict[str, torch.Tensor] = {}
    for value, prefix in ((fwd.args, "input"), (fwd.kwargs, "input"), (fwd.output, "output")):
        _encode(value, tensors, prefix)
    if bwd is not None:
        _encode(bwd.grad_output, tensors, "grad_output")
        _encode(bwd.grad_input, tensors, "grad_input")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return total + (fwd.mask.numel() * fwd.mask.element_size() if fwd.mask is not None else 0)


def save(base: str, ts: str, fwd: Job, bwd: Job | None, reason: str) -> str:
    """Write one failing call's data; returns the folder."""
    folder = folder_of(base, ts, fwd)
    os.makedirs(folder, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    call = {
        "name": fwd.name, "category": fwd.category, "api": fwd.api, "step": fwd.step, "rank": fwd.rank,
        "reason": reason, "autocast": list(fwd.autocast), "inplace": fwd.inplace,
        "args": _encode(fwd.args, tensors, "input"), "kwargs": _encode(fwd.kwargs, tensors, "input"),
        "output": _encode(fwd.output, tensors, "output"),
        "requires_grad": [k for k, t in tensors.items() if id(t) in fwd.requires_grad],
    }
    if fwd.mask is not None:
        tensors["mask"] = fwd.mask
    if bwd is not None:
        call["grad_output"] = _encode(bwd.grad_output, tensors, "grad_output")
        call["grad_input"] = _encode(bwd.grad_input, tensors, "grad_input")
        call["grad_input_positions"] = list(bwd.grad_input_positions)
    # private, contiguous copies: decoded tensors are views into one record payload
    save_file({k: t.detach().clone().contiguous() for k, t in tensors.items()},
              os.path.join(folder, "tensors.safetensors"))
    with open(os.path.join(folder, "call.json"), "w", encoding="utf-8") as fh:
        json.dump(call, fh, indent=1, ensure_ascii=False)
    with open(os.path.join(folder, "replay.py"), "w", encoding="utf-8") as fh:
        fh.write(_SCRIPT.format(name=fwd.name, step=fwd.step, rank=fwd.rank))
    return folder


def load(folder: str) -> tuple[Job, Job | None]:
    """The saved call as jobs the replay understands."""
    tensors = load_file(os.path.join(folder, "tensors.safetensors"))
    with open(os.path.join(folder, "call.json"), encoding="utf-8") as fh:
        call = json.load(fh)
    grads = frozenset(id(tensors[k]) for k in call.get("requires_grad", []))
    fwd = Job(run_id="error-data", rank=call["rank"], step=call["step"], seq=0, name=call["name"],
              category=call["category"], api=call["api"], direction=1, args=_decode(call["args"], tensors),
              kwargs=_decode(call["kwargs"], tensors), output=_decode(call["output"], tensors),
              requires_grad=grads, autocast=tuple(call["autocast"]), inplace=call["inplace"],
              mask=tensors.get("mask"))
    bwd = None
    if "grad_output" in call:
        bwd = Job(run_id="error-data", rank=call["rank"], step=call["step"], seq=0, name=call["name"],
                  category=call["category"], api=call["api"], direction=2,
                  grad_output=_decode(call["grad_output"], tensors), grad_input=_decode(call["grad_input"], tensors),
                  grad_input_positions=tuple(call["grad_input_positions"]))
    return fwd, bwd


def replay_folder(folder: str) -> int:
    """Replay a saved call and print each output's two-way status and metrics against the device's values."""
    from gpu_server.judging.verdict import compare_output
    from gpu_server.replay.run import flatten_outputs, run_backward, run_forward

    fwd, bwd = load(folder)
    device = torch.device("cpu")
    print(f"{fwd.name} (step {fwd.step}, rank {fwd.rank})")
    bench = flatten_outputs(run_forward(fwd, device, bench=True))
    for i, (b, d) in enumerate(zip(bench, flatten_outputs(fwd.output))):
        cmp = compare_output(b, d)
        print(f"  forward.output.{i}: {cmp.status} {cmp.message}")
    if bwd is not None and bwd.grad_input:
        grads = run_backward(fwd, bwd, device, bench=True)
        for i, (b, d) in enumerate(zip(grads, bwd.grad_input)):
            if b is not None and d is not None:
                cmp = compare_output(b, d)
                print(f"  backward.output.{i}: {cmp.status} {cmp.message}")
    return 0
