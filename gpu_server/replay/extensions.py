"""The server's extension file (`gpu-server --extensions FILE`, server.json `run_ut.extensions`; docs/extensions.md).

A TOML file the server's operator writes on the bench host; never taken from the wire or the shared folder. It
names Python code the server imports and runs, so it is trusted like the server's own code (docs/security.md,
"The extension file"): it and its folder must not be writable by anyone but their owner. Three kinds of sections:

    [[reference]]     op = "mylib::fused_gelu" (a custom torch.library operator, recorded as Custom.mylib.fused_gelu)
                      or api = "NPU.npu_xxx" (a fused operator the agent records); forward = "module:function";
                      optional backward = "module:function", random = false, strings = {param = ["value", ...]}
    [[postprocess]]   api = "Custom.mylib.grouped_rows"; output = 0; rows_from_arg = "count" (or a position), or
                      rows_from_sum_of_arg = "group_list": only those first rows of that output are compared
    [[judge]]         api = "Functional.gelu"; standard = "..."; tier = "L0|L1|L2";
                      [judge.thresholds.float16] atol = ..., rtol = ...   ->
                      gpu_server.judging.standards.selection.configure

`parse` validates everything and raises ExtensionError with one line per problem; `install` registers the
references in the fused-operator registry (gpu_server/replay/fused/registry.py, the same one as the built-in references:
replay, same-dtype runs and backward work unchanged) and configures the judging; `load` does both. The replay worker
processes (gpu_server/replay/sandbox_worker.py) load the same file with `load`. The replay allowlist grows only by what
the
file names (gpu_server/replay/registry.py asks `reference_for`), and the arguments of such calls are still checked by
kind
(`Reference.argument_problem`).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import stat
import sys
from typing import Any, Callable

import torch

from gpu_server.judging.standards import selection
from gpu_server.replay.fused import registry as fused_registry

__all__ = ["ExtensionError", "Extensions", "Reference", "PostProcess", "parse", "install", "load", "uninstall",
           "active", "reference_for", "postprocess", "custom_op_message"]

_TOP_KEYS = {"reference", "postprocess", "judge"}
_REFERENCE_KEYS = {"op", "api", "forward", "backward", "random", "strings"}
_POSTPROCESS_KEYS = {"op", "api", "output", "rows_from_arg", "rows_from_sum_of_arg"}
_HANDLERS = ("rows_from_arg", "rows_from_sum_of_arg")
_JUDGE_KEYS = {"op", "api", "standard", "tier", "thresholds"}
_CATEGORIES = ("Functional", "Torch", "Tensor", "Aten", "NPU", "Custom")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,127}"
OP_NAME = re.compile(rf"({_IDENT})::({_IDENT})\Z", re.ASCII)
_QUALIFIED = re.compile(rf"({'|'.join(_CATEGORIES)})\.({_IDENT}(?:\.{_IDENT})?)\Z", re.ASCII)
_TARGET = re.compile(rf"({_IDENT}(?:\.{_IDENT})*):({_IDENT}(?:\.{_IDENT})*)\Z", re.ASCII)
_MAX_BYTES = 1 << 20

try:   # the standard library's TOML reader (Python 3.11+); on 3.10 the same reader as the tomli package
    import tomllib
except ModuleNotFoundError:   # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]


class ExtensionError(ValueError):
    """The extension file is refused; str() is a header line and one line per problem."""

    def __init__(self, path: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"invalid extension file {path}:\n  " + "\n  ".join(problems))


def custom_op_message(op: str) -> str:
    """The SKIP reason of a custom operator the extension file does not name."""
    return (f"not replayable: no reference for the custom operator {op[:160]}; give one in the server's extension "
            "file (docs/extensions.md)")


# -- what a loaded file holds ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Reference:
    """One [[reference]] section, resolved."""

    category: str                 # "Custom" or "NPU"
    api: str                      # as recorded: "mylib.fused_gelu", "npu_xxx"
    key: str                      # its name in the fused registry: "mylib::fused_gelu", "npu_xxx"
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None
    random: bool
    strings: dict[str, frozenset[str]]
    signature: inspect.Signature | None

    @property
    def qualified(self) -> str:
        return f"{self.category}.{self.api}"

    def callable(self) -> Callable[..., Any]:
        """What the replay calls: the forward, wrapped so that autograd runs the given backward when there is one."""
        return self.forward if self.backward is None else _with_backward(self)

    def argument_problem(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """None when a call's arguments may be replayed, else the SKIP reason ("not replayable: ...")."""
        if self.random:
            return (f"not replayable: the extension file declares the reference of {self.qualified} random (its "
                    "random numbers are not recorded, so the bench cannot reproduce them)")
        positional = _positional_names(self.signature)
        items = [(positional[i] if i < len(positional) else None, i, v) for i, v in enumerate(args)]
        items += [(k, None, v) for k, v in kwargs.items()]
        for param, position, value in items:
            why = _argument_problem(self, value, param, position, top=True)
            if why:
                return f"not replayable: {why}"
        return None


@dataclasses.dataclass(frozen=True)
class PostProcess:
    """One [[postprocess]] section: compare only the first rows of one output."""

    qualified: str                # "Category.api"
    output: int
    handler: str                  # "rows_from_arg" | "rows_from_sum_of_arg"
    arg: str | int                # the argument's name or position
    signature: inspect.Signature | None


@dataclasses.dataclass
class Extensions:
    path: str
    references: dict[str, Reference] = dataclasses.field(default_factory=dict)       # by qualified name
    postprocess: dict[str, list[PostProcess]] = dataclasses.field(default_factory=dict)
    judging: dict[str, Any] = dataclasses.field(default_factory=dict)              # qualified name -> ApiJudging
    python_path: tuple[str, ...] = ()     # the folders modules were imported from, beyond the child's own path


_ACTIVE: Extensions | None = None


def active() -> Extensions | None:
    return _ACTIVE


def reference_for(category: str, api: str) -> Reference | None:
    """The reference the active extension file gives for `Category.api`, else None."""
    ext = _ACTIVE
    if ext is None:
        return None
    return ext.references.get(f"{category}.{api}")


# -- parsing -----------------------------------------------------------------------------------------------------------
def _file_problems(path: str) -> list[str]:
    """The file and its folder must be regular / a folder and writable by their owner only."""
    problems = []
    for what, p in (("the file", path), ("its folder", os.path.dirname(path) or ".")):
        try:
            st = os.stat(p)
        except OSError as exc:
            problems.append(f"{what} {p}: cannot be read ({exc.strerror or exc})")
            continue
        if what == "the file" and not stat.S_ISREG(st.st_mode):
            problems.append(f"{p} is not a regular file")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            problems.append(f"{what} {p} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):o}): "
                            "it names code the server runs; make it writable by its owner only (chmod go-w)")
    return problems


def parse(path: str, python_path: tuple[str, ...] | list[str] = ()) -> Extensions:
    """Read and validate the extension file; ExtensionError with one line per problem. `python_path`: folders to
    import from besides sys.path and the file's own folder (a replay worker gets the server's)."""
    path = os.path.abspath(path)
    problems = _file_problems(path)
    if problems:
        raise ExtensionError(path, problems)
    if tomllib is None:
        raise ExtensionError(path, ["reading TOML needs Python 3.11 or later (tomllib), or the tomli package"])
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_BYTES + 1)
        if len(data) > _MAX_BYTES:
            raise ExtensionError(path, [f"larger than {_MAX_BYTES >> 20} MiB"])
        raw = tomllib.loads(data.decode("utf-8"))
    except OSError as exc:
        raise ExtensionError(path, [f"cannot be read ({exc.strerror or exc})"]) from None
    except UnicodeDecodeError:
        raise ExtensionError(path, ["is not UTF-8 text"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ExtensionError(path, [f"is not valid TOML: {exc}"]) from None
    ext = Extensions(path)
    folders = [os.path.dirname(path), *python_path]
    for folder in folders:
        if folder not in sys.path:
            sys.path.append(folder)   # after the server's own path: a module there never shadows the server's
    for key in sorted(set(raw) - _TOP_KEYS):
        problems.append(f"{key}: unknown section or key (allowed: [[reference]], [[postprocess]], [[judge]])")
    for section, fn in (("reference", _reference), ("postprocess", _postprocess), ("judge", _judge)):
        value = raw.get(section, [])
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            problems.append(f"{section}: must be a list of tables ([[{section}]])")
            continue
        for i, table in enumerate(value):
            fn(ext, f"{section}[{i}]", table, problems)
    if ext.judging:
        problems.extend(_judging_problems(ext.judging))
    if problems:
        raise ExtensionError(path, problems)
    ext.python_path = tuple(dict.fromkeys([*folders, *ext.python_path]))
    return ext


def _unknown(where: str, table: dict, allowed: set[str], problems: list[str]) -> None:
    for key in sorted(set(table) - allowed):
        problems.append(f"{where}.{key}: unknown key (allowed: {', '.join(sorted(allowed))})")


def _import_root(module: Any) -> str | None:
    """The folder on the Python path that `module` was imported from (a replay worker adds it to its own path)."""
    top = sys.modules.get(module.__name__.split(".")[0])
    origin = getattr(top, "__file__", None)
    if not origin:
        return None
    root = os.path.dirname(os.path.abspath(origin))
    return os.path.dirname(root) if getattr(top, "__path__", None) is not None else root


def _target(where: str, key: str, table: dict, problems: list[str], ext: Extensions) -> Callable[..., Any] | None:
    """The callable `module:function` names, imported; None with a problem when it cannot be."""
    folder = os.path.dirname(ext.path)
    text = table.get(key)
    if not isinstance(text, str) or not _TARGET.match(text):
        problems.append(f"{where}.{key}: {text!r} is not 'module:function'")
        return None
    module_name, attr = text.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import is a problem of the file, said in one line
        problems.append(f"{where}.{key}: cannot import module {module_name} ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200] if str(exc) else ''})")
        return None
    root = _import_root(module)
    if root is not None:
        ext.python_path = (*ext.python_path, root)
    origin = getattr(module, "__file__", None)
    if origin and os.path.dirname(os.path.abspath(origin)) == folder:
        mode = os.stat(origin).st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            problems.append(f"{where}.{key}: {origin} is writable by its group or by others (mode "
                            f"{stat.S_IMODE(mode):o}); make it writable by its owner only (chmod go-w)")
            return None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            problems.append(f"{where}.{key}: module {module_name} has no attribute {attr}")
            return None
    if not callable(fn):
        problems.append(f"{where}.{key}: {text} is not callable")
        return None
    return fn


def _signature(fn: Callable[..., Any] | None) -> inspect.Signature | None:
    if fn is None:
        return None
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _positional_names(sig: inspect.Signature | None) -> list[str]:
    if sig is None:
        return []
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _api_name(where: str, table: dict, problems: list[str], custom_only: bool = False) -> tuple[str, str] | None:
    """(category, api) from `op = "ns::op"` or `api = "Category.api"`; one of them, exactly."""
    op, api = table.get("op"), table.get("api")
    if (op is None) == (api is None):
        problems.append(f"{where}: give exactly one of op = \"namespace::op\" or api = \"Category.api\"")
        return None
    if op is not None:
        if not isinstance(op, str) or not OP_NAME.match(op):
            problems.append(f"{where}.op: {op!r} is not a custom operator name 'namespace::op' (no overload)")
            return None
        return "Custom", op.replace("::", ".")
    match = _QUALIFIED.match(api) if isinstance(api, str) else None
    if match is None:
        problems.append(f"{where}.api: {api!r} is not 'Category.api' with a category of {', '.join(_CATEGORIES)}")
        return None
    category, name = match.group(1), match.group(2)
    if category == "Custom" and "." not in name:
        problems.append(f"{where}.api: {api!r}: a custom operator is Custom.namespace.op (or op = \"namespace::op\")")
        return None
    if category != "Custom" and "." in name:
        problems.append(f"{where}.api: {api!r} is not 'Category.api'")
        return None
    if custom_only and category not in ("Custom", "NPU"):
        problems.append(f"{where}.api: {api!r}: references are given for custom operators (op = \"namespace::op\") "
                        "and fused operators (api = \"NPU.npu_xxx\") only")
        return None
    return category, name


def _reference(ext: Extensions, where: str, table: dict, problems: list[str]) -> None:
    _unknown(where, table, _REFERENCE_KEYS, problems)
    name = _api_name(where, table, problems, custom_only=True)
    forward = _target(where, "forward", table, problems, ext)
    backward = _target(where, "backward", table, problems, ext) if "backward" in table else None
    random = table.get("random", False)
    if not isinstance(random, bool):
        problems.append(f"{where}.random: {random!r} is not true or false")
    strings: dict[str, frozenset[str]] = {}
    raw_strings = table.get("strings", {})
    sig = _signature(forward)
    if not isinstance(raw_strings, dict):
        problems.append(f"{where}.strings: must be a table {{parameter = [\"value\", ...]}}")
    else:
        params = set(sig.parameters) if sig is not None else None
        for param, values in raw_strings.items():
            if not isinstance(values, list) or not values or not all(isinstance(v, str) and len(v) <= 256
                                                                     for v in values):
                problems.append(f"{where}.strings.{param}: must be a non-empty list of strings")
            elif params is not None and param not in params and not any(
                    p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
                problems.append(f"{where}.strings.{param}: the forward reference has no parameter {param!r}")
            else:
                strings[param] = frozenset(values)
    if name is None or forward is None:
        return
    category, api = name
    qualified = f"{category}.{api}"
    if qualified in ext.references:
        problems.append(f"{where}: {qualified} has a reference already (an earlier [[reference]])")
        return
    key = api.replace(".", "::") if category == "Custom" else api
    ext.references[qualified] = Reference(category, api, key, forward, backward, bool(random), strings, sig)


def _postprocess(ext: Extensions, where: str, table: dict, problems: list[str]) -> None:
    _unknown(where, table, _POSTPROCESS_KEYS, problems)
    name = _api_name(where, table, problems)
    output = table.get("output", 0)
    if isinstance(output, bool) or not isinstance(output, int) or not 0 <= output < 1024:
        problems.append(f"{where}.output: {output!r} is not the index of an output (0, 1, ...)")
        output = None
    handlers = [h for h in _HANDLERS if h in table]
    if len(handlers) != 1:
        problems.append(f"{where}: give exactly one of {', '.join(k + ' = ...' for k in _HANDLERS)}")
        return
    handler = handlers[0]
    arg = table[handler]
    if isinstance(arg, bool) or not isinstance(arg, (str, int)) or (isinstance(arg, int) and not 0 <= arg < 256):
        problems.append(f"{where}.{handler}: {arg!r} is not an argument's name or position")
        return
    if name is None or output is None:
        return
    qualified = f"{name[0]}.{name[1]}"
    sig, known = _api_signature(ext, name[0], name[1])
    if not known:
        problems.append(f"{where}: {qualified} is not an API this server replays"
                        + (" (no [[reference]] for it in this file)" if name[0] in ("Custom", "NPU") else ""))
        return
    if isinstance(arg, str):
        if sig is None:
            problems.append(f"{where}.{handler}: the signature of {qualified} is not known here; give the argument's "
                            "position instead of its name")
            return
        if arg not in sig.parameters:
            problems.append(f"{where}.{handler}: {qualified} has no argument {arg!r} (its arguments: "
                            f"{', '.join(sig.parameters)})")
            return
    elif sig is not None:
        positional = _positional_names(sig)
        if arg >= len(positional) and not any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
            problems.append(f"{where}.{handler}: {qualified} has no positional argument {arg} (it takes "
                            f"{len(positional)})")
            return
    ext.postprocess.setdefault(qualified, []).append(PostProcess(qualified, output, handler, arg, sig))


def _api_signature(ext: Extensions, category: str, api: str) -> tuple[inspect.Signature | None, bool]:
    """(signature or None, whether the API is one the server replays with this file)."""
    ref = ext.references.get(f"{category}.{api}")
    if ref is not None:
        return ref.signature, True
    if category == "Custom":
        return None, False
    from gpu_server.replay.registry import UnknownApi, resolve

    try:
        fn = resolve(category, api)
    except UnknownApi:
        return None, False
    return _signature(fn), True


def _judge(ext: Extensions, where: str, table: dict, problems: list[str]) -> None:
    _unknown(where, table, _JUDGE_KEYS, problems)
    name = _api_name(where, table, problems)
    standard, tier = table.get("standard"), table.get("tier")
    ok = True
    if standard is not None and not isinstance(standard, str):
        problems.append(f"{where}.standard: {standard!r} is not a string")
        ok = False
    if tier is not None and not isinstance(tier, str):
        problems.append(f"{where}.tier: {tier!r} is not a string")
        ok = False
    thresholds = table.get("thresholds", {})
    clean: dict[str, dict[str, float]] = {}
    if not isinstance(thresholds, dict):
        problems.append(f"{where}.thresholds: must be a table of [{where.split('[')[0]}.thresholds.<dtype>] tables")
        ok = False
    else:
        for dtype, values in thresholds.items():
            if not isinstance(values, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       for v in values.values()):
                problems.append(f"{where}.thresholds.{dtype}: must be a table of numbers (name = value)")
                ok = False
                continue
            clean[dtype] = {k: float(v) for k, v in values.items()}
    if standard is None and tier is None and not clean and ok:
        problems.append(f"{where}: give a standard, a tier or thresholds")
        return
    if name is None or not ok:
        return
    qualified = f"{name[0]}.{name[1]}"
    if name[0] == "Custom" and qualified not in ext.references:
        problems.append(f"{where}: {qualified} has no [[reference]] in this file, so it is never judged")
        return
    if qualified in ext.judging:
        problems.append(f"{where}: {qualified} is judged by an earlier [[judge]] already")
        return
    ext.judging[qualified] = _api_judging(standard, tier, clean)


def _api_judging(standard: str | None, tier: str | None, thresholds: dict[str, dict[str, float]]) -> Any:
    return selection.ApiJudging(standard=standard, tier=tier, thresholds=thresholds)


def _judging_problems(per_api: dict[str, Any]) -> list[str]:
    """What selection.configure says of these settings (one line per problem; `install` applies them)."""
    saved = dict(selection.configured())
    try:
        selection.configure(per_api)
    except ValueError as exc:
        return [f"judge: {line.strip()}" for line in str(exc).splitlines() if line.strip()]
    finally:
        selection.configure(saved)
    return []


# -- installing --------------------------------------------------------------------------------------------------------
def install(ext: Extensions) -> None:
    """Make `ext` the active extension file: its references in the fused registry, its judging configured."""
    global _ACTIVE
    uninstall()
    for ref in ext.references.values():
        fused_registry.register_extension(ref.key, ref.callable())
    if ext.judging:
        selection.configure(ext.judging)
    _ACTIVE = ext


def uninstall() -> None:
    """No extension file: the built-in references and judging only."""
    global _ACTIVE
    if _ACTIVE is not None and _ACTIVE.judging:
        selection.configure({})
    fused_registry.unregister_extensions()
    _ACTIVE = None


def load(path: str, python_path: tuple[str, ...] | list[str] = ()) -> Extensions:
    ext = parse(path, python_path)
    install(ext)
    return ext


# -- argument kinds ----------------------------------------------------------------------------------------------------
_LEAVES = (torch.Tensor, bool, int, float, complex, torch.dtype, torch.device, type(None))


def _argument_problem(ref: Reference, value: Any, param: str | None, position: int | None, top: bool) -> str | None:
    if isinstance(value, (list, tuple)):
        for v in value:
            why = _argument_problem(ref, v, param, position, False)
            if why:
                return why
        return None
    if isinstance(value, str):
        if not top:
            return f"a string inside a list argument of {ref.qualified}"
        allowed = ref.strings.get(param) if param is not None else None
        if allowed is None and param is None:
            allowed = frozenset().union(*ref.strings.values()) if ref.strings else None
        if allowed and value in allowed:
            return None
        where = f"parameter {param!r}" if param is not None else f"argument {position}"
        return (f"string {value[:64]!r} as {where} of {ref.qualified} is not one of the values its reference declares "
                "(strings = {...} in the extension file)")
    if isinstance(value, torch.Tensor) and value.layout != torch.strided:
        return f"a {value.layout} tensor for {ref.qualified}: only strided tensors are replayed"
    if isinstance(value, _LEAVES):
        return None
    from protos.codec import Opaque

    if isinstance(value, Opaque):   # the replay says which type could not travel
        return None
    return f"an argument of type {type(value).__name__} to {ref.qualified}"


# -- backward given in the file ----------------------------------------------------------------------------------------
def _with_backward(ref: Reference) -> Callable[..., Any]:
    """The forward reference as an autograd function whose backward is the file's: `backward(grad_outputs, *args,
    **kwargs)` gets a tuple of one gradient per tensor output and the forward's inputs, and returns one gradient (or
    None) per positional argument of the forward (a bare tensor where it takes one)."""
    forward, backward = ref.forward, ref.backward

    class _Reference(torch.autograd.Function):
        @staticmethod
        def forward(ctx, spec, *tensors):  # noqa: ANN001
            args, kwargs, positions = spec
            call = list(args)
            for pos, t in zip(positions, tensors):
                call[pos] = t
            ctx.spec = (call, kwargs, positions)
            ctx.save_for_backward(*tensors)
            out = forward(*call, **kwargs)
            ctx.single = isinstance(out, torch.Tensor)
            return out if ctx.single else tuple(out)

        @staticmethod
        def backward(ctx, *grads):  # noqa: ANN001
            call, kwargs, positions = ctx.spec
            call = list(call)
            for pos, t in zip(positions, ctx.saved_tensors):
                call[pos] = t
            with torch.enable_grad():
                result = backward(tuple(grads), *call, **kwargs)
            if isinstance(result, torch.Tensor) or result is None:
                result = (result,)
            result = tuple(result)
            if len(result) != len(call):
                raise RuntimeError(f"the backward reference of {ref.qualified} returned {len(result)} gradients for "
                                   f"{len(call)} positional arguments")
            return (None, *(result[pos] for pos in positions))

    def call(*args, **kwargs):
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        return _Reference.apply((args, kwargs, positions), *(args[i] for i in positions))

    call.__signature__ = ref.signature   # type: ignore[attr-defined]
    call.__name__ = getattr(forward, "__name__", "reference")
    return call


# -- post-processing of outputs ----------------------------------------------------------------------------------------
def _arg_value(pp: PostProcess, args: tuple, kwargs: dict) -> Any:
    if isinstance(pp.arg, str):
        if pp.arg in kwargs:
            return kwargs[pp.arg]
        if pp.signature is not None:
            names = _positional_names(pp.signature)
            if pp.arg in names and names.index(pp.arg) < len(args):
                return args[names.index(pp.arg)]
            param = pp.signature.parameters.get(pp.arg)
            if param is not None and param.default is not param.empty:
                return param.default
        return None
    return args[pp.arg] if pp.arg < len(args) else None


def _rows(pp: PostProcess, value: Any) -> int | None:
    """How many leading rows the argument's value says are meaningful (None: it does not say; nothing is cut)."""
    try:
        if pp.handler == "rows_from_arg":
            if isinstance(value, torch.Tensor):
                value = value.reshape(()).item() if value.numel() == 1 else None
            return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
        if isinstance(value, torch.Tensor):
            if value.dim() != 1 or value.is_floating_point() or value.is_complex():
                return None
            return int(value.sum().item())
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return sum(value)
    except (RuntimeError, TypeError, ValueError, OverflowError):
        return None
    return None


def postprocess(category: str, api: str, args: tuple, kwargs: dict, runs: list[list]) -> list[list]:
    """The compared outputs of each run (the device's, the bench's, the same-dtype and spread runs), each cut to
    what the extension file says is meaningful. Runs without such a section come back unchanged."""
    ext = _ACTIVE
    steps = ext.postprocess.get(f"{category}.{api}") if ext is not None else None
    if not steps:
        return runs
    cuts: dict[int, int] = {}
    for pp in steps:
        n = _rows(pp, _arg_value(pp, args, kwargs))
        if n is not None:
            cuts[pp.output] = max(0, n)
    return [cut_rows(run, cuts) for run in runs]


def cut_rows(outputs: list, cuts: dict[int, int]) -> list:
    if outputs is None or not cuts:
        return outputs
    out = list(outputs)
    for i, n in cuts.items():
        if i < len(out) and isinstance(out[i], torch.Tensor) and out[i].dim() >= 1:
            out[i] = out[i][:n]
    return out


def has_postprocess(category: str, api: str) -> bool:
    ext = _ACTIVE
    return ext is not None and bool(ext.postprocess.get(f"{category}.{api}"))
