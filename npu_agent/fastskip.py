"""The capture mode's compiled answer for calls the sampling skips (docs/design.md §4, "Skipped calls in C").

`npu_agent/_fastskip.c` is a plain CPython extension (no torch headers): `Skipper.skip(func, args, kwargs)` either
does exactly the bookkeeping the Python path does for a call the sampling skips and returns True, or changes
nothing and returns False, and the Python path (npu_agent.capture) decides as it always has. Without the compiled
module, or with ONLINE_CHECK_PURE_PYTHON=1, the Python path answers every call: the records, the counts and the
reports are the same either way (tests/test_fastskip.py).

Built by `python -m npu_agent.fastskip --build` (scripts/setup.sh runs it) with the C compiler Python was built
with. The file's name carries a hash of the source, so a changed source is never run from a stale binary: the
module is then missing until rebuilt, and the Python path answers.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from npu_agent.capture import Capturer

log = logging.getLogger("npu_agent")

SOURCE = Path(__file__).with_name("_fastskip.c")
PURE_PYTHON_ENV = "ONLINE_CHECK_PURE_PYTHON"
_loaded: list[ModuleType | None] = []   # [] until the first load; then [the module] or [None]


def binary_path() -> Path:
    """Where the build puts the module for this source and this interpreter."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return SOURCE.with_name(f"_fastskip-{digest}{sysconfig.get_config_var('EXT_SUFFIX')}")


def build(quiet: bool = False) -> Path:
    """Compile the module for this interpreter; returns its path. Raises CalledProcessError with the compiler's
    message, or OSError when there is no compiler."""
    out = binary_path()
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    include = sysconfig.get_paths()["include"]
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    cmd = [*cc, "-O2", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{include}", str(SOURCE), "-o", str(tmp)]
    try:
        subprocess.run(cmd, check=True, capture_output=quiet)
        os.replace(tmp, out)   # a process loading it meanwhile sees the old file or the whole new one
    finally:
        tmp.unlink(missing_ok=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for old in SOURCE.parent.glob(f"_fastskip-*{suffix}"):   # this interpreter's binaries of earlier sources (another
        if old != out:                                       # interpreter's, of this source or another, are its own)
            old.unlink(missing_ok=True)
    return out


def load() -> ModuleType | None:
    """The compiled module, or None (not built for this source, ONLINE_CHECK_PURE_PYTHON=1, or it failed to load:
    said once, at info level, with the command that builds it)."""
    if _loaded:
        return _loaded[0]
    module = None
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        log.info("online check: %s is set, skipped calls are answered in Python", PURE_PYTHON_ENV)
    else:
        try:
            path = binary_path()
            if path.exists():
                spec = importlib.util.spec_from_file_location("npu_agent._fastskip", path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            else:
                log.info("online check: the compiled skip path is not built (python -m npu_agent.fastskip --build); "
                         "skipped calls are answered in Python")
        except Exception as exc:  # noqa: BLE001 - the Python path answers instead
            log.info("online check: the compiled skip path did not load (%s); skipped calls are answered in Python",
                     exc)
            module = None
    _loaded.append(module)
    return module


def skipper(capturer: "Capturer") -> Callable[[Any, tuple[Any, ...], dict[str, Any] | None], bool] | None:
    """`skip(func, args, kwargs)` for this capturer's calls, or None where the Python path answers alone: no
    compiled module, no sampler, or a scope or an api list (their selection comes first, in Python)."""
    sampler = capturer.sampler
    if sampler is None or capturer.scope or capturer.api_list:
        return None
    module = load()
    if module is None:
        return None
    import torch

    if type(torch.Tensor).__instancecheck__ is not type.__instancecheck__:   # is_tensor in _fastskip.c relies on it
        return None

    from npu_agent import capture, naming, sampling
    from npu_agent.snapshot import HELD

    # the Python path's own containers: mutated in place, never replaced (tests/test_fastskip.py checks it)
    s = module.Skipper(naming.CLASSIFIED, capture._KINDS, sampling._KIND_OF, torch.Tensor, HELD.pending,
                       torch.is_grad_enabled, torch._C._current_graph_task_id, capturer._writes_inputs,
                       capturer._counts, sampler, sampler.last, sampler._counts)
    sampler.flush_skipped = s.flush   # the sampler's counts of the calls skipped in C, added before they are read
    skip: Callable[[Any, tuple[Any, ...], dict[str, Any] | None], bool] = s.skip
    return skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m npu_agent.fastskip", description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="store_true", help="compile the module for this interpreter")
    ns = ap.parse_args(argv)
    if not ns.build:
        path = binary_path()
        print(f"{path}: {'built' if path.exists() else 'not built'}")
        return 0
    try:
        print(f"built {build()}")
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"npu_agent.fastskip: could not compile {SOURCE.name} ({exc}); the agent answers skipped calls in "
              "Python, with the same records", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
