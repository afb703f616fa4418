"""The server replays an explicit allowlist of computational APIs only (issue 11): the table is checked by name and by
calling every entry in a sandbox that watches files, processes, sockets, module imports and torch's global state;
hostile records through a real server are SKIP "not replayable", leave no trace and do not affect other calls; a
replay that changes global torch state is SKIP and the state is restored."""
from __future__ import annotations

import os
import pickle
import re
import sys
import threading
import warnings

import pytest
import torch

from gpu_server.replay import registry
from gpu_server.replay import run as replay
from gpu_server.replay.run import ReplayError, global_state_guard, run_forward
from npu_agent.records import PendingRecord, encode_record
from npu_agent.snapshot import snapshot
from protos import apis
from protos import online_check_pb2 as pb
from tests import support
from tests.support import capture, to_job

CPU = torch.device("cpu")

# Names that would mean I/O, processes, modules, global defaults, generator seeding, hooks or leaving the tensor
# world. The allowlist must contain none of them.
FORBIDDEN = re.compile(r"save|load|file|seed|(^|_)set_|default|thread|hook|compile|storage|share|pin_memory|numpy|"
                       r"tolist|^item$|script|jit|export|^hub(_|$)|print|manual|register|module|determin|flush|warn|open|"
                       r"exec|system|import|grad_enabled|autocast|rng|_state|backend|record_stream|data_ptr|"
                       r"__reduce|__setstate|__getstate|__dlpack|__array|^apply_$|^map2?_$|^set_$|untyped|"
                       r"requires_grad|retain|^backward$|^detach_$|sparse|quantiz|mkldnn|^(ipu|xpu|mtia)$")


def all_entries():
    return sorted((category, api) for category, names in apis.ALLOWLIST.items() for api in names)


def test_allowlist_has_no_io_state_or_seeding_names():
    bad = [f"{c}.{a}" for c, a in all_entries() if FORBIDDEN.search(a)]
    assert not bad, f"allowlisted names that look like I/O or global state: {bad}"


def test_every_allowlisted_api_exists_on_this_host_and_nothing_else_resolves():
    missing = [f"{c}.{a}: {why}" for c, a in all_entries() if (why := registry.known(c, a))]
    assert not missing, missing
    for category, api in [("Torch", "save"), ("Torch", "load"), ("Torch", "set_default_device"),
                          ("Torch", "manual_seed"), ("Torch", "from_file"), ("Tensor", "tolist"),
                          ("Tensor", "register_hook"), ("Tensor", "__reduce_ex__"), ("Aten", "from_file"),
                          ("Torch", "set_num_threads"), ("Torch", "use_deterministic_algorithms"),
                          ("Functional", "__import__"), ("Torch", "compile"), ("NPU", "npu_not_there")]:
        why = registry.replayable(category, api)
        assert why and ("not replayable" in why or "no reference" in why), (category, api, why)


def test_the_npu_names_are_exactly_the_fused_references():
    from gpu_server.replay.fused import FUSED_REFERENCES

    assert set(FUSED_REFERENCES) == apis.NPU


def test_the_common_training_surface_is_allowlisted():
    must = {
        "Functional": "linear conv2d conv1d conv_transpose2d max_pool2d avg_pool2d adaptive_avg_pool2d relu gelu silu "
                      "softmax log_softmax layer_norm group_norm batch_norm rms_norm embedding dropout cross_entropy "
                      "nll_loss mse_loss binary_cross_entropy_with_logits scaled_dot_product_attention pad interpolate "
                      "one_hot normalize",
        "Torch": "add mul matmul bmm einsum cat stack sum mean softmax topk sort gather scatter index_add where "
                 "zeros_like ones empty_like arange rand randn bernoulli cumsum argmax clamp tanh exp sqrt rsqrt",
        "Tensor": "add add_ mul_ view reshape transpose permute contiguous float to __add__ __iadd__ __getitem__ "
                  "__setitem__ __matmul__ masked_fill_ index_add_ scatter_ sum mean softmax type_as expand uniform_",
        "Aten": "mm addmm gelu _softmax native_layer_norm convolution",
    }
    for category, names in must.items():
        absent = [n for n in names.split() if n not in apis.ALLOWLIST[category]]
        assert not absent, (category, absent)


# -- every allowlisted API called in a sandbox ---------------------------------------------------------------------
_EVENTS: list[tuple] = []
_WATCHING = threading.Event()
_PROCESS = ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.kill", "pty.")
_FILES = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.truncate", "os.symlink",
          "os.link", "shutil.", "os.utime", "tempfile.")


def _importing() -> bool:
    """True when the running code is part of a module import (importlib's frames are on the stack)."""
    frame = sys._getframe(2)
    while frame is not None:
        if "importlib._bootstrap" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _audit(event: str, args) -> None:
    if not _WATCHING.is_set():
        return
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        module_file = isinstance(path, str) and path.endswith((".py", ".pyc", ".so", ".pyi", ".json", ".typed"))
        if writes or not module_file:
            _EVENTS.append((event, str(path)[:200], str(mode)))
    elif event in ("exec", "compile"):
        # code run from a module file is a lazy import inside torch (sympy for symbolic shapes): modules are checked
        # below by name; code from anywhere else is not
        code = args[0] if args else None
        filename = getattr(code, "co_filename", "") or (args[1] if event == "compile" and len(args) > 1 else "")
        if not str(filename).endswith(".py") and not _importing():
            _EVENTS.append((event, str(filename)[:200]))
    elif event.startswith(_PROCESS + _FILES) or event in ("socket.connect", "socket.bind", "ctypes.dlopen",
                                                           "pickle.find_class"):
        _EVENTS.append((event, str(args)[:200]))


sys.addaudithook(_audit)


def _candidates():
    """Argument sets that reach many signatures; most fail with TypeError, which is fine: only side effects count."""
    g = torch.Generator().manual_seed(0)   # not the default generator: the sandbox watches that one

    def t():
        return torch.randn(4, 4, generator=g)

    return [
        lambda: (t(), t()),
        lambda: (t(),),
        lambda: (t(), 1),
        lambda: (),
        lambda: (t(), t(), t()),
        lambda: (t().abs() + 0.1,),
        lambda: ((2, 2),),
        lambda: (torch.randn(2, 3, 8, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g)),
        lambda: (torch.tensor([0, 3, 1, 2, 2]),),
        lambda: (t(), 1, torch.tensor([0, 1]), t()[:2]),
    ]


def _state(cpu_rng: bool):
    return [(name, read()) for name, read, _ in replay._state_items(CPU)
            if cpu_rng or name != "default generator of the CPU"]


def test_every_allowlisted_api_called_in_a_sandbox_touches_nothing_outside(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before_modules = set(sys.modules)
    problems = []
    called = 0
    for category, api in all_entries():
        fn = registry.resolve(category, api)
        random = api in apis.RANDOM
        for make in _candidates()[:4 if category == "Aten" else None]:   # aten kernels: C++, fewer tries
            args = make()
            state = _state(not random)
            _EVENTS.clear()
            _WATCHING.set()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fn(*args)
                    called += 1
            except Exception:  # noqa: BLE001 - wrong arguments for this API: only side effects are checked
                pass
            finally:
                _WATCHING.clear()
            after = _state(not random)
            changed = [name for (name, old), (_, new) in zip(state, after) if not replay._same(old, new)]
            if changed or _EVENTS:
                problems.append((f"{category}.{api}", changed, list(_EVENTS)))
            for (name, _read, restore), (_, old) in zip(replay._state_items(CPU), state):
                if name in changed:
                    restore(old)
    # lazy imports of torch's own math dependencies, the standard library and our fused references are expected
    new_modules = sorted(m for m in set(sys.modules) - before_modules
                         if not m.startswith(("torch", "sympy", "mpmath", "gpu_server.replay.fused"))
                         and m.split(".")[0] not in sys.stdlib_module_names)
    assert not problems, problems[:20]
    assert not new_modules, new_modules
    assert not os.listdir(tmp_path), os.listdir(tmp_path)
    assert called > 800, called   # the sandbox really ran the APIs


def test_the_sandbox_sees_what_it_must_catch(tmp_path, monkeypatch):
    """The detectors above fire on the very calls the allowlist keeps out."""
    monkeypatch.chdir(tmp_path)
    _EVENTS.clear()
    _WATCHING.set()
    try:
        torch.save(torch.ones(1), "x.pt")       # C++ writes it: seen by the folder check
        with open("y.txt", "w"):                 # Python I/O: seen by the audit hook
            pass
    finally:
        _WATCHING.clear()
    assert os.listdir(tmp_path)
    assert any(e[0] == "open" and e[1].endswith("y.txt") for e in _EVENTS), _EVENTS
    state = _state(True)
    torch.manual_seed(123)
    torch.set_default_dtype(torch.float64)
    try:
        changed = [n for (n, old), (_, new) in zip(state, _state(True)) if not replay._same(old, new)]
    finally:
        torch.set_default_dtype(torch.float32)
        for (_name, _read, restore), (_, old) in zip(replay._state_items(CPU), state):
            restore(old)
    assert "default dtype" in changed and "default generator of the CPU" in changed


# -- argument checks -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("category,api,args,kwargs,ok", [
    ("Functional", "gelu", (torch.ones(2),), {"approximate": "tanh"}, True),
    ("Functional", "gelu", (torch.ones(2),), {"approximate": "/etc/passwd"}, False),
    ("Functional", "cross_entropy", (torch.ones(2, 3), torch.tensor([0, 1])), {"reduction": "mean"}, True),
    ("Functional", "cross_entropy", (torch.ones(2, 3), torch.tensor([0, 1])), {"reduction": "batchmean"}, False),
    ("Functional", "kl_div", (torch.ones(2), torch.ones(2)), {"reduction": "batchmean"}, True),
    ("Torch", "div", (torch.ones(2), 2), {"rounding_mode": "floor"}, True),
    ("Functional", "conv2d", (torch.ones(1, 1, 3, 3), torch.ones(1, 1, 1, 1), None, 1, "same"), {}, True),
    ("Functional", "conv2d", (torch.ones(1, 1, 3, 3), torch.ones(1, 1, 1, 1), None, 1, "other"), {}, False),
    ("Torch", "einsum", ("bij,bjk->bik", torch.ones(1, 2, 2), torch.ones(1, 2, 2)), {}, True),
    ("Torch", "einsum", ("...ij,...jk", torch.ones(2, 2), torch.ones(2, 2)), {}, True),
    ("Torch", "einsum", ("ij;__import__('os')", torch.ones(2, 2)), {}, False),
    ("Tensor", "to", (torch.ones(2), "cuda:0"), {}, True),
    ("Tensor", "to", (torch.ones(2), "meta"), {}, False),
    ("Tensor", "add", (torch.ones(2), 1), {"alpha": "x"}, False),
    ("Tensor", "add", (torch.ones(2), [1, "x"]), {}, False),
    ("Tensor", "add", (torch.ones(2), {"a": 1}), {}, True),
    ("Tensor", "add", (torch.ones(2), {"a": "/etc/passwd"}), {}, False),
    ("Tensor", "__getitem__", (torch.ones(2, 3), (slice(0, 1), Ellipsis, None)), {}, True),
    ("Torch", "save", (torch.ones(2), "/tmp/x"), {}, False),
    ("Torch", "zeros", ((2, 2),), {"layout": torch.strided}, True),
    ("Torch", "zeros", ((2, 2),), {"layout": torch.sparse_coo}, False),   # index arrays kernels would trust
    ("Torch", "gather", (torch.ones(2, 3), 1, torch.tensor([[0], [2]])), {}, True),
    ("Torch", "gather", (torch.ones(2, 3), 1, torch.tensor([[0], [3]])), {}, False),   # tests/test_native_bounds.py
])
def test_arguments_are_checked(category, api, args, kwargs, ok):
    why = registry.replayable(category, api, args, kwargs)
    assert (why is None) == ok, why
    if not ok:
        assert why.startswith("not replayable: ")


# -- the global-state guard ------------------------------------------------------------------------------------------
def test_a_replay_that_changes_global_state_is_skip_and_the_state_is_restored(monkeypatch):
    x = torch.randn(3)
    with capture() as (mode, sink):
        with mode:
            torch.abs(x)
    job = to_job(sink.forward("Torch.abs.0"))
    rng = torch.get_rng_state()

    threads = torch.get_num_threads()

    def hostile(t):
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(1)
        torch.set_num_threads(1 if threads != 1 else 2)
        return t.abs()

    monkeypatch.setattr(replay, "resolve", lambda category, api: hostile)
    with pytest.raises(ReplayError, match=r"not replayable: .*default dtype.*intra-op thread count.*CPU.*restored"):
        run_forward(job, CPU, bench=True)
    assert torch.get_default_dtype() == torch.float32 and torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)
    monkeypatch.undo()
    assert torch.equal(run_forward(job, CPU, bench=False), x.abs())   # an honest call passes the guard


def test_the_guard_reports_state_changes_even_when_the_call_also_fails():
    with pytest.raises(ReplayError, match="default device"):
        with global_state_guard(CPU, "Torch.x"):
            torch.set_default_device("meta")
            raise RuntimeError("and then it failed")
    assert str(torch.get_default_device()) == "cpu" and torch.ones(1).device.type == "cpu"


# -- hostile records through a real server ---------------------------------------------------------------------------
class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _frames(name: str, args: tuple, kwargs: dict, out, seq: int, rank: int, run_id: str) -> list[bytes]:
    rec = PendingRecord(name=name, step=0, inputs=snapshot((args, kwargs)), output=snapshot(out), seq=seq)
    enc = encode_record(rec, run_id, rank)
    return list(enc.wire_frames(1 << 20))


def test_hostile_records_through_a_real_server(tmp_path):
    saved = tmp_path / "written_by_torch_save.pt"
    marker = tmp_path / "unpickled"
    bomb = tmp_path / "bomb.pt"
    bomb.write_bytes(pickle.dumps(_Evil(str(marker))))
    t = torch.randn(3, 3)
    hostile = [
        ("Torch.save.0", (t, str(saved)), {}, None),
        ("Torch.load.0", (str(bomb),), {"weights_only": False}, t),
        ("Torch.set_default_device.0", ("meta",), {}, None),
        ("Torch.set_default_dtype.0", (torch.float64,), {}, None),
        ("Torch.manual_seed.0", (1,), {}, None),
        ("Torch.from_file.0", (str(saved), True, 9), {}, t),
        ("Tensor.tolist.0", (t,), {}, [1.0]),
        ("Functional.gelu.0", (t,), {"approximate": str(saved)}, t),
        ("Torch.einsum.0", ("ij;__import__('os').system('touch x')", t), {}, t),
        ("Aten.from_file.0", (str(saved),), {}, t),
        ("Tensor.__reduce_ex__.0", (t, 2), {}, None),
    ]
    # allowlisted, but asking for far more memory than the device's output: refused by the meta dry run
    greedy = [("Torch.zeros.0", ((1 << 40,),), {}, torch.zeros(4)),
              ("Tensor.repeat.0", (t, 1 << 20, 1 << 20), {}, t),
              ("Functional.interpolate.0", (torch.ones(1, 1, 4, 4),), {"scale_factor": 1e5}, torch.ones(1, 1, 8, 8))]
    work = tmp_path / "srv"
    work.mkdir()
    with support.Server(str(work)) as srv:
        hello5 = pb.Frame(hello=pb.Hello(run_id="hostile", rank=5)).SerializeToString()
        msgs = [hello5]
        for seq, (name, args, kwargs, out) in enumerate(hostile + greedy):
            msgs += _frames(name, args, kwargs, out, seq, 5, "hostile")
        acks = support.stream_acks(srv.port, msgs, lambda acks: len(acks) >= len(hostile) + len(greedy))
        # then an honest rank: its calls are checked as usual
        x, w = torch.randn(4, 8), torch.randn(3, 8)
        good = [("Functional.linear.0", (x, w), {}, torch.nn.functional.linear(x, w)),
                ("Torch.add.0", (x, 1.5), {}, x + 1.5), ("Tensor.sum.0", (x,), {}, x.sum())]
        hello0 = pb.Frame(hello=pb.Hello(run_id="honest", rank=0)).SerializeToString()
        msgs = [hello0]
        for seq, (name, args, kwargs, out) in enumerate(good):
            msgs += _frames(name, args, kwargs, out, seq, 0, "honest")
        good_acks = support.stream_acks(srv.port, msgs, lambda acks: len(acks) >= len(good))
        srv.stop()
        log = srv.log()
    assert [a.status for a in acks] == [pb.Ack.REJECTED] * len(hostile) + [pb.Ack.ACCEPTED] * len(greedy), acks
    assert all("not replayable" in a.reason for a in acks[:len(hostile)]), [a.reason for a in acks]
    assert [a.status for a in good_acks] == [pb.Ack.ACCEPTED] * len(good), good_acks
    assert not saved.exists() and not marker.exists() and not (work / "x").exists()
    assert "Traceback" not in log
    rows = support.by_name(support.read_csv(srv.out, "accuracy_checking_result", 5))
    assert set(rows) == {name for name, *_ in hostile + greedy}
    for row in rows.values():
        assert row["Forward Test Success"] == "SKIP" and "not replayable" in row["Message"], row
    for name, *_ in greedy:
        assert "would produce" in rows[name]["Message"], rows[name]
    honest = support.read_csv(srv.out, "accuracy_checking_result", 0)
    assert [r["Forward Test Success"] for r in honest] == ["pass"] * len(good), honest
