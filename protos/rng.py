"""Reading and setting a device's default random generator: one pair of helpers for both sides of the contract
(in the spirit of torch/utils/checkpoint.py's get_device_states / set_device_states).

The agent records the generator state of the training's device before a random call (npu_agent/capture.py); the
server replays that call from the same state on a bench of the same device type (gpu_server/replay/run.py). Both go
through these two functions, so the state they exchange is the same object: the `uint8` tensor that
`torch.get_rng_state()` / `torch.<device>.get_rng_state()` return, sent as its raw bytes.
"""
from __future__ import annotations

import torch


def _module(device: torch.device) -> object | None:
    """torch.cuda, torch.npu (when torch_npu is installed), torch.xpu, ...: the module that owns the generator."""
    return None if device.type == "cpu" else getattr(torch, device.type, None)


def generator_state(device: torch.device | str) -> torch.Tensor | None:
    """The default generator's state on `device` (a type such as "cuda" means its current device), or None when
    this torch has no generator API for that device type."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.get_rng_state()
    getter = getattr(_module(dev), "get_rng_state", None)
    if getter is None:
        return None
    state = getter(dev) if dev.index is not None else getter()
    return state if isinstance(state, torch.Tensor) else None


def set_generator_state(device: torch.device | str, state: torch.Tensor) -> None:
    """Set the default generator of `device` to `state` (RuntimeError when the state does not fit it)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_rng_state(state)
        return
    setter = getattr(_module(dev), "set_rng_state", None)
    if setter is None:
        raise RuntimeError(f"torch has no generator API for device type {dev.type!r}")
    if dev.index is not None:
        setter(state, dev)
    else:
        setter(state)
