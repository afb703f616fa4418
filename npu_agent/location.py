"""Where a captured call was made: the module it ran in and the line of the user's code that made it.

- The module path: while capture is on (`install()` at `PrecisionDebugger.start()`, `uninstall()` at `stop()`),
  the modules whose forward is running on this thread are read off the thread's own frames, when a captured call
  asks: every frame of `nn.Module._call_impl` (the frame of `module(...)`, hooks or not) holds its module as
  `self` (the walk in C where npu_agent/_fastlocate.c is built: 0.14 us against 3.2 us for four nested modules;
  the same list). Nothing runs on the calls that are not captured: global module hooks would cost every module
  call of the training 3-5 us (torch leaves its fast path for all modules once one exists) and are used only where
  torch has no `_call_impl` to recognise (then forward pre/post hooks push and pop a per-thread stack). The path of the
  innermost module is the outermost module's class name followed by the dotted attribute names down to it:
  `TinyLM.blocks.0.attn.proj` (a child found through its parent's `_modules`, or deeper: a `ModuleList` is never
  called itself; each (parent, child) name is looked up once). Outside any module: "".
- The source location: the first frame that is not torch's, ours (`npu_agent`, `protos`) or a stdlib wrapper
  (`contextlib`, `functools`), i.e. the user's code: `path/to/train.py:123 (forward)`, the path relative to the
  working directory when under it. Which code objects are skipped is cached per code object, the final string per
  (code object, instruction), so a call site seen before costs a short walk of dictionary look-ups.

Nothing here raises into the training: a failure gives "" and is logged once.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import weakref
from types import CodeType, FrameType
from typing import Any, Callable

import torch
from torch.compiler import is_compiling
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import protos

log = logging.getLogger("npu_agent")

MAX_TEXT = 512            # module paths and source locations are cut to this on the agent
_MAX_CACHE = 1 << 16      # entries of each cache before it is emptied and refilled
_MAX_SEARCH = 100_000     # submodules searched for a child that is not a direct attribute of its caller


class _Stack(threading.local):
    """Per thread: the modules whose forward is running, outermost first, and the paths of its prefixes."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []
        self.paths: list[str] = []   # paths[i]: the path of modules[i] (len(paths) <= len(modules))


_STACK = _Stack()
_handles: list[Any] = []
_failed = False
_following = False   # install()ed: module_path() reads the frames
# npu_agent/_fastlocate.c's `modules(frame, code, module_type)`: _walk in C (None from it: Python walks); None
# where it is not built for this interpreter
_compiled_walk: Callable[[FrameType, CodeType, type], list[torch.nn.Module] | None] | None = None
_loaded = False
# the code of `module(...)`: its frames hold the module as `self`; None on a torch without it (hooks then)
_CALL_IMPL: CodeType | None = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)
if _CALL_IMPL is not None and _CALL_IMPL.co_varnames[:1] != ("self",):
    _CALL_IMPL = None


# -- the module stack -------------------------------------------------------------------------------------------
def _push(module: torch.nn.Module, args: Any) -> None:
    if is_compiling():   # a compiled region: nothing of ours is traced into it
        return None
    _STACK.modules.append(module)
    return None


def _pop(module: torch.nn.Module, args: Any, output: Any) -> None:
    if is_compiling():
        return None
    s = _STACK
    mods = s.modules
    if mods and mods[-1] is module:
        mods.pop()
    else:   # hooks installed while this module was running, or a module whose forward re-entered: cut to it
        for i in range(len(mods) - 1, -1, -1):
            if mods[i] is module:
                del mods[i:]
                break
    if len(s.paths) > len(mods):
        del s.paths[len(mods):]
    return None


def install() -> None:
    """Start following the modules (idempotent): read off the frames (in C where npu_agent/_fastlocate.c is built
    for this interpreter), or on a torch without `_call_impl`, a stack kept by global hooks, which starts empty on
    the calling thread."""
    global _following
    _following = True
    if not _loaded:
        _load_walk()
    if _CALL_IMPL is not None or _handles:
        return
    _STACK.modules.clear()
    _STACK.paths.clear()
    _handles.append(register_module_forward_pre_hook(_push))
    _handles.append(register_module_forward_hook(_pop, always_call=True))


def _load_walk() -> None:
    global _compiled_walk, _loaded
    from npu_agent.compiled import LOCATE

    _loaded = True
    module = LOCATE.load()
    _compiled_walk = getattr(module, "modules", None) if module is not None else None


def uninstall() -> None:
    """Stop following the modules; remove the global hooks where there are any (idempotent)."""
    global _following
    _following = False
    while _handles:
        _handles.pop().remove()
    _STACK.modules.clear()
    _STACK.paths.clear()


def installed() -> bool:
    return _following


# (id(parent), id(child)) -> the child's name under the parent. An entry goes when either module is freed (the
# callbacks of the weak references in _REFS), before its id can be reused: a hit needs no further check.
_NAMES: dict[tuple[int, int], str] = {}
_REFS: dict[tuple[int, int], tuple[Any, Any]] = {}


# (type of the outermost module, id of each module innermost first) -> the path. Every module of a path of two or
# more is in a pair of _NAMES, so freeing any of them empties this cache (in _forget) before its id can be reused.
_PATHS: dict[tuple[Any, ...], str] = {}


def _forget(key: tuple[int, int], _ref: Any) -> None:
    _NAMES.pop(key, None)
    _REFS.pop(key, None)
    _PATHS.clear()


def _child_name(parent: torch.nn.Module, child: torch.nn.Module) -> str:
    key = (id(parent), id(child))
    name = _NAMES.get(key)
    if name is not None:
        return name
    name = _find(parent, child)
    if len(_NAMES) >= _MAX_CACHE:
        _NAMES.clear()
        _REFS.clear()   # no callback empties _PATHS for these modules any more: emptied now
        _PATHS.clear()
    forget = functools.partial(_forget, key)
    _REFS[key] = (weakref.ref(parent, forget), weakref.ref(child, forget))
    _NAMES[key] = name
    return name


def _find(parent: torch.nn.Module, child: torch.nn.Module) -> str:
    """The dotted attribute path of `child` under `parent`, the shallowest first (`blocks.0` for a block of a
    ModuleList); the child's class name when it is not a submodule of `parent` at all."""
    for name, m in parent._modules.items():
        if m is child:
            return name
    seen = {id(parent)}
    level: list[tuple[str, torch.nn.Module]] = [("", parent)]
    searched = 0
    while level and searched < _MAX_SEARCH:
        below: list[tuple[str, torch.nn.Module]] = []
        for prefix, mod in level:
            for name, m in mod._modules.items():
                if m is None or id(m) in seen:
                    continue
                path = prefix + name
                if m is child:
                    return path
                seen.add(id(m))
                searched += 1
                below.append((path + ".", m))
        level = below
    return type(child).__name__


def module_path(frame: FrameType | None = None) -> str:
    """The path of the innermost module running on this thread (its frames from `frame` up, default the caller's),
    or "" outside any module or when not installed."""
    if not _following:
        return ""
    if _CALL_IMPL is None:
        return _stack_path()
    target = _CALL_IMPL
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    walk = _compiled_walk
    mods = walk(f, target, torch.nn.Module) if walk is not None and f is not None else None
    if mods is None:   # not built, or a frame that has finished (the C walk leaves those to Python)
        mods = _walk(f, target)
    if not mods:
        return ""
    if len(mods) == 1:
        return type(mods[0]).__name__
    key = (type(mods[-1]), *map(id, mods))
    path = _PATHS.get(key)
    if path is not None:
        return path
    path = type(mods[-1]).__name__
    for i in range(len(mods) - 1, 0, -1):
        path += "." + _child_name(mods[i], mods[i - 1])
    if len(_PATHS) >= _MAX_CACHE:
        _PATHS.clear()
    _PATHS[key] = path
    return path


def _walk(f: FrameType | None, target: CodeType) -> list[torch.nn.Module]:
    """The module of each frame from `f` outwards that runs `target`, innermost first (npu_agent/_fastlocate.c
    `modules` where built: the same list)."""
    mods: list[torch.nn.Module] = []
    while f is not None:
        if f.f_code is target:
            m = f.f_locals.get("self")
            if isinstance(m, torch.nn.Module):
                mods.append(m)
        f = f.f_back
    return mods


def _stack_path() -> str:
    """module_path from the stack the hooks keep."""
    s = _STACK
    mods, paths = s.modules, s.paths
    n = len(mods)
    if n == len(paths):
        return paths[-1] if n else ""
    while len(paths) < n:
        i = len(paths)
        paths.append(type(mods[0]).__name__ if i == 0 else paths[-1] + "." + _child_name(mods[i - 1], mods[i]))
    return paths[-1]


# -- the source location ----------------------------------------------------------------------------------------
def _package_dir(module: Any) -> str:
    path: str = module.__file__
    return os.path.dirname(os.path.abspath(path)) + os.sep


_SKIP_DIRS: tuple[str, ...] = (_package_dir(torch), os.path.dirname(os.path.abspath(__file__)) + os.sep,
                                _package_dir(protos))
_SKIP_FILES = frozenset(os.path.abspath(m.__file__) for m in (contextlib, functools) if m.__file__)
_npu_dir: str | None = None   # torch_npu's folder once it is imported ("" when it has no file)

# id(code) -> _SKIPPED, or {f_lasti: "file:line (function)"} for the user's code. _HELD holds each code object
# while it is there, so its id is not reused.
_SKIPPED: dict[int, str] = {}
_CODES: dict[int, dict[int, str]] = {}
_HELD: dict[int, CodeType] = {}
_sites = 0


def _skipped(filename: str) -> bool:
    global _npu_dir
    if _npu_dir is None and "torch_npu" in sys.modules:   # Ascend hosts: torch_npu's frames are torch's
        module = sys.modules["torch_npu"]
        _npu_dir = _package_dir(module) if getattr(module, "__file__", None) else ""
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path in _SKIP_FILES or path.startswith(_SKIP_DIRS):
        return True
    npu = _npu_dir
    return npu is not None and npu != "" and path.startswith(npu)


def _classify(code: CodeType) -> dict[int, str]:
    global _sites
    if len(_CODES) >= _MAX_CACHE or _sites >= _MAX_CACHE:
        _CODES.clear()
        _HELD.clear()
        _sites = 0
    _HELD[id(code)] = code
    sites = _CODES[id(code)] = _SKIPPED if _skipped(code.co_filename) else {}
    return sites


def _site(frame: FrameType, sites: dict[int, str]) -> str:
    global _sites
    code = frame.f_code
    path = code.co_filename
    if not path.startswith("<"):
        cwd = os.getcwd()
        full = os.path.abspath(path)
        if full.startswith(cwd.rstrip(os.sep) + os.sep):
            path = os.path.relpath(full, cwd)
    text = sites[frame.f_lasti] = f"{path}:{frame.f_lineno} ({code.co_name})"[:MAX_TEXT]
    _sites += 1
    return text


def source(frame: FrameType | None = None) -> str:
    """`file:line (function)` of the user's code that led to this call (from `frame`, default the caller's), or ""
    when every frame is torch's or ours."""
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    codes, skipped = _CODES, _SKIPPED
    while f is not None:
        sites = codes.get(id(f.f_code))
        if sites is None:
            sites = _classify(f.f_code)
        if sites is not skipped:
            text = sites.get(f.f_lasti)
            return text if text is not None else _site(f, sites)
        f = f.f_back
    return ""


def current(depth: int = 1) -> tuple[str, str]:
    """(module path, source location) of the call being made now; ("", "") if finding them failed (logged once).
    The walk for the source starts `depth` frames up (1: the caller's frame); a caller that knows frames of its own
    are next skips them (`sys._getframe(n)` passes over frames without building their frame objects)."""
    try:
        frame = sys._getframe(depth)
        return module_path(frame), source(frame)
    except Exception as exc:  # noqa: BLE001 - never raise into the training
        global _failed
        if not _failed:
            _failed = True
            log.warning("online check: finding the module and source line of a call failed (%s: %s); such calls "
                        "are reported without them", type(exc).__name__, exc)
        return "", ""
