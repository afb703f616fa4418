"""How the project's compiled modules are built and loaded, the agent's (npu_agent/compiled.py) and the server's
(gpu_server/compiled.py) alike (docs/design.md §4, "Skipped calls in C"; §6.2, "Records decoded in C").

Each is a CPython extension next to the Python module that uses it, and each has a pure-Python path that gives the
same results; that path runs where the module is not built, where it fails to load, or with
ONLINE_CHECK_PURE_PYTHON=1. Most are plain C (no torch headers), compiled with the C compiler Python was built with,
a few seconds; two (`npu_agent/_fasthook.cpp`, `npu_agent/_fastmask.cpp`) are C++ against torch's own headers and
libraries, compiled with Python's C++ compiler in about 15 s each. `python -m npu_agent.compiled --build` and
`python -m gpu_server.compiled --build` (scripts/setup.sh runs both) compile them. A binary's name carries a hash of
its source (and, for a module against torch, of the torch it was built for), so a changed source or another torch
never runs a stale binary: the module is then missing until rebuilt, and its Python path runs.
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
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PURE_PYTHON_ENV = "ONLINE_CHECK_PURE_PYTHON"


class Compiled:
    """One compiled module: `<stem>.c` in `folder` (`<stem>.cpp` built against torch, with `torch`), loaded as
    `<package>.<stem>`; `python_path` says, for the log, what runs without it ("skipped calls are answered in
    Python"), `build_command` how to build it."""

    def __init__(self, stem: str, python_path: str, folder: Path, package: str, torch: bool = False) -> None:
        self.stem = stem
        self.torch = torch
        self.source = folder / f"{stem}.{'cpp' if torch else 'c'}"
        self.python_path = python_path
        self.package = package
        self.build_command = f"python -m {package}.compiled --build"
        self.log = logging.getLogger(package)
        self.loaded: list[ModuleType | None] = []   # [] until the first load; then [the module] or [None]

    def binary_path(self) -> Path:
        """Where the build puts the module for this source and this interpreter."""
        text = self.source.read_bytes() + (_torch_build().encode() if self.torch else b"")
        digest = hashlib.sha256(text).hexdigest()[:16]
        return self.source.with_name(f"{self.stem}-{digest}{sysconfig.get_config_var('EXT_SUFFIX')}")

    def build(self, quiet: bool = False) -> Path:
        """Compile the module for this interpreter; returns its path. Raises CalledProcessError with the compiler's
        message, or OSError when there is no compiler."""
        out = self.binary_path()
        include = sysconfig.get_paths()["include"]
        tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
        if self.torch:
            cmd = [*_torch_command(), f"-I{include}", str(self.source), "-o", str(tmp), *_torch_libraries()]
        else:
            cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
            cmd = [*cc, "-O2", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{include}", str(self.source), "-o", str(tmp)]
        try:
            subprocess.run(cmd, check=True, capture_output=quiet)
            os.replace(tmp, out)   # a process loading it meanwhile sees the old file or the whole new one
        finally:
            tmp.unlink(missing_ok=True)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        for old in self.source.parent.glob(f"{self.stem}-*{suffix}"):   # this interpreter's binaries of earlier
            if old != out:                                              # sources (another interpreter's are its own)
                old.unlink(missing_ok=True)
        return out

    def load(self) -> ModuleType | None:
        """The compiled module, or None (not built for this source, ONLINE_CHECK_PURE_PYTHON=1, or it failed to
        load: said once, at info level, with the command that builds it)."""
        if self.loaded:
            return self.loaded[0]
        module = None
        if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
            self.log.info("online check: %s is set, %s", PURE_PYTHON_ENV, self.python_path)
        else:
            try:
                path = self.binary_path()
                if path.exists():
                    spec = importlib.util.spec_from_file_location(f"{self.package}.{self.stem}", path)
                    assert spec is not None and spec.loader is not None
                    module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                else:
                    self.log.info("online check: %s is not built (%s); %s", self.source.name, self.build_command,
                                  self.python_path)
            except Exception as exc:  # noqa: BLE001 - the Python path runs instead
                self.log.info("online check: %s did not load (%s); %s", self.source.name, exc, self.python_path)
                module = None
        self.loaded.append(module)
        return module


def _torch_build() -> str:
    """What a module built against torch depends on: torch's version, its commit and its C++ ABI."""
    import torch

    return f"torch {torch.__version__} {torch.version.git_version} abi {int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def _torch_command() -> list[str]:
    """The C++ compiler and flags of a module against torch: torch's headers as system headers (their own warnings
    are not ours), its C++ standard and ABI."""
    import torch

    root = Path(torch.__file__).parent / "include"
    cxx = shlex.split(sysconfig.get_config_var("CXX") or "c++")
    return [*cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-Wall", "-Werror",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-isystem", str(root), "-isystem", str(root / "torch" / "csrc" / "api" / "include")]


def _torch_libraries() -> list[str]:
    """torch's libraries, found at run time where they were at build time."""
    import torch

    lib = Path(torch.__file__).resolve().parent / "lib"
    return [f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]


def main(modules: Sequence[Compiled], argv: list[str] | None, prog: str, description: str) -> int:
    """The command line of a package's compiled modules: `--build` compiles them, else says which are built."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--build", action="store_true", help="compile the modules for this interpreter")
    ns = ap.parse_args(argv)
    failed = 0
    for module in modules:
        if not ns.build:
            path = module.binary_path()
            print(f"{path}: {'built' if path.exists() else 'not built'}")
            continue
        try:
            print(f"built {module.build()}")
        except (OSError, subprocess.CalledProcessError) as exc:
            failed += 1
            print(f"{prog}: could not compile {module.source.name} ({exc}); {module.python_path}, with the same "
                  "results", file=sys.stderr)
    return 1 if failed else 0
