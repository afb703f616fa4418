"""seed_all: msprobe's helper to make runs repeatable (docs/design.md §2)."""
from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
import torch


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False) -> None:
    """Seed Python, NumPy and torch (all devices). `mode=True` also turns on deterministic algorithms.
    `rm_dropout=True` makes the dropout family a no-op (p=0), as msprobe did, for runs compared bit for bit."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed_all: seed {seed!r} must be an integer in [0, 2**32)")
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if mode:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if rm_dropout:
        _remove_dropout()


def _remove_dropout() -> None:
    import torch.nn.functional as F

    for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"):
        original = getattr(F, name)
        if getattr(original, "_online_check_no_dropout", False):
            continue

        def no_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False,
                       _original: Callable[..., torch.Tensor] = original) -> torch.Tensor:
            return _original(input, 0.0, training, inplace)

        no_dropout._online_check_no_dropout = True  # type: ignore[attr-defined]  # a marker on the function
        no_dropout.__name__ = name
        setattr(F, name, no_dropout)
