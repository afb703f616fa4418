"""Mutation check (issue 24): break the product on purpose, one small text patch at a time, and see the tests fail.

Each mutation below is a bug an audit once found the tests blind to. For each one this script copies the
repository (the files `git ls-files --cached --others --exclude-standard` lists, as they are in the working tree,
and `.venv` as a symlink) to a temporary folder, applies the patch to the COPY (the checkout is never touched), runs
the mutation's relevant test files there with pytest (PYTHONPATH set to the copy, so the copy's packages are the
ones imported, in the test process, in the gpu-server subprocesses and in the trainings), and records whether the
tests failed (the mutant is killed) or passed (it survived). A patch whose text is no longer found in the product is
reported as `patch does not apply`, never skipped quietly; a mutant whose tests pass unchanged makes the script
exit 1.

Run it by hand (it is not part of the test suite: each mutant runs real servers and trainings, minutes in all):

    .venv/bin/python tests/mutants.py                  # every mutation, one after the other
    .venv/bin/python tests/mutants.py --only no-fsync  # one (repeatable); --list names them
    .venv/bin/python tests/mutants.py --keep           # keep the temporary copies (their paths are printed)

It prints one row per mutation: its name, the test files run, killed / survived / patch does not apply / timeout,
and the seconds it took. `--timeout` bounds each mutant's pytest run (default 900 s; running past it is reported as
`timeout`, not killed). Each pytest run stops at its first failure (-x); `--all-failures` runs every test of
the files and lists each one that fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    patches: tuple[tuple[str, str, str], ...]   # (file, text found exactly once, its replacement)
    tests: tuple[str, ...]                      # pytest arguments: test files (or node ids)


_FSYNC_FILES = ("gpu_server/atomic_file.py", "gpu_server/spool/acks.py", "gpu_server/spool/journal.py",
                "gpu_server/spool/recovery.py")

_SPREAD_JUDGE = ("            result = standard.judge(StandardInput(device.dtype, device_metrics, same_metrics, "
                 "spread_metrics,\n                                                  **extra))\n")

MUTATIONS = (
    Mutation(
        "spool-forgets-accepted",
        "a restart forgets which (run, rank, seq) records it accepted (the spool's accepted set restores empty)",
        (("gpu_server/spool/store.py",
          '        """Every (run, rank, seq) this --out has accepted: completely reported or still in the spool."""\n',
          '        """Every (run, rank, seq) this --out has accepted: completely reported or still in the spool."""\n'
          "        if self.dir:\n            return\n"),),
        ("tests/test_durability.py",)),
    Mutation(
        "restart-forgets-accepted",
        "a restarted server does not seed its intake with what the spool accepted: re-sent records are new again",
        (("gpu_server/app.py", "        for run_id, rank, seq in self.spool.seen():\n",
          "        for run_id, rank, seq in ():\n"),),
        ("tests/test_durability.py",)),
    Mutation(
        "no-fsync",
        "every os.fsync of the spool, its journal and the atomic files is a no-op",
        tuple((path, "os.fsync(", "(lambda _fd: None)(") for path in _FSYNC_FILES),
        ("tests/test_durability.py",)),
    Mutation(
        "judge-passes-with-spread",
        "the precision standards' judge passes any output once spread runs exist",
        (("gpu_server/judging/standards/judging.py", _SPREAD_JUDGE,
          _SPREAD_JUDGE + "            result.status = PASS\n"),),
        ("tests/test_standards.py",)),
    Mutation(
        "verdict-passes-with-spread",
        "the two-way status forgives any error once a comparable same-dtype or spread run exists",
        (("gpu_server/judging/verdict.py",
          "        if not comparable_member(member, pair.device):\n            continue\n"
          "        if i == 0 and bit_identical(member, pair.device):\n",
          "        if not comparable_member(member, pair.device):\n            continue\n"
          "        cmp.status = PASS\n        return\n"
          "        if i == 0 and bit_identical(member, pair.device):\n"),),
        ("tests/test_verdict.py",)),
    Mutation(
        "absolute-tolerates-5pct",
        "the absolute threshold tolerates error rates up to 5 % (the limit is 0)",
        (("gpu_server/judging/standards/absolute.py", "        ok = rate == 0\n", "        ok = rate <= 0.05\n"),),
        ("tests/test_standards.py",)),
    Mutation(
        "second-device-not-installed",
        "the second device's kernels are never installed: the trainings compute exactly like the host",
        (("tests/second_device.py", "    if _installed:\n        return\n", "    if True:\n        return\n"),),
        ("tests/test_second_device.py", "tests/test_faulty_device.py")),
    Mutation(
        "start-is-a-no-op",
        "PrecisionDebugger.start() does nothing: nothing is captured",
        (("npu_agent/debugger.py", "    def start(self) -> None:\n        with self._lock:\n",
          "    def start(self) -> None:\n        return\n        with self._lock:\n"),),
        ("tests/test_numerics.py",)),
    Mutation(
        "start-captures-nothing",
        "PrecisionDebugger.start() sets up the agent but never enters its capture mode: nothing is captured",
        (("npu_agent/debugger.py", "            self._mode.__enter__()\n", "            pass\n"),),
        ("tests/test_numerics.py",)),
    Mutation(
        "intake-accepts-invalid",
        "a record that fails validation gets its SKIP row but is answered ACCEPTED",
        (("gpu_server/intake/admission.py",
          "            return REJECTED, reason, None\n",
          "            return ACCEPTED, \"\", None\n"),),
        ("tests/test_fuzz.py",)),
    Mutation(
        "sigterm-sets-an-event",
        "the SIGTERM handler sets a threading.Event the main thread waits on: a signal inside the wait hangs it",
        (("gpu_server/stop_signal.py", "        self.signum: int | None = None\n",
          "        self.signum: int | None = None\n        import threading\n        self._ev = threading.Event()\n"),
         ("gpu_server/stop_signal.py", "            os.write(self._w, b\"\\0\")\n",
          "            self._ev.set()\n"),
         ("gpu_server/stop_signal.py", "            ready, _, _ = select.select([self._r], [], [], timeout)\n",
          "            ready = self._ev.wait(timeout) and False\n")),
        ("tests/test_stop_signal.py",)),
    Mutation(
        "fastencode-loses-requires-grad",
        "the compiled walk leaves TensorMeta.requires_grad out of the tensors it writes itself",
        (("npu_agent/_fastencode.c", "    if (rg && (put_key(&e, 6, 0) < 0 || put_byte(&e, 1) < 0))\n",
          "    if (0 && rg && (put_key(&e, 6, 0) < 0 || put_byte(&e, 1) < 0))\n"),),
        ("tests/test_fastencode.py",)),
    Mutation(
        "fastdecode-one-level-deeper",
        "the compiled decoder takes a value one level deeper than --max-depth allows, which Python refuses",
        (("gpu_server/_fastdecode.c", "    if (++x->count > x->max_values || depth > x->max_depth)\n",
          "    if (++x->count > x->max_values || depth > x->max_depth + 1)\n"),),
        ("tests/test_fastdecode.py",)),
    Mutation(
        "fastdecode-kwargs-at-depth-0",
        "the compiled decoder reads keyword arguments' values at depth 0, not 1 as RecordDecoder.mapping does",
        (("gpu_server/_fastdecode.c", ": i == 1 ? mapping(&x, c, 0, &out[i])",
          ": i == 1 ? mapping(&x, c, -1, &out[i])"),),
        ("tests/test_fastdecode.py",)),
    Mutation(
        "fastdecode-int-not-zigzag",
        "the compiled decoder reads Value.i (a sint64) as a plain varint",
        (("gpu_server/_fastdecode.c", "(long long)((v >> 1) ^ (~(v & 1) + 1))", "(long long)v"),),
        ("tests/test_fastdecode.py",)),
    Mutation(
        "fastencode-int-not-zigzag",
        "the compiled walk writes a negative int as a plain varint instead of zigzag (Value.i is a sint64)",
        (("npu_agent/_fastencode.c", "    uint64_t zigzag = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);\n",
          "    uint64_t zigzag = (uint64_t)v;\n"),),
        ("tests/test_fastencode.py",)),
    Mutation(
        "fastencode-ignores-copy-on-write",
        "the compiled copy writes the training's tensor as it is now, not the copy taken before the training wrote it",
        (("npu_agent/_fastencode.c", "        if (src == NULL)\n            src = t;\n",
          "        src = t;\n"),),
        ("tests/test_fastencode.py", "tests/test_capture_refs.py", "tests/test_batching.py")),
    Mutation(
        "gather-reads-a-cut-element-from-its-start",
        "the compiled gather copies the end of an element cut at a frame's or a scratch piece's start from the "
        "element's first byte",
        (("npu_agent/_fastencode.c", "        memcpy(dst, src + e * step + part, (size_t)n);\n",
          "        memcpy(dst, src + e * step, (size_t)n);\n"),),
        ("tests/test_fastencode.py",)),
    Mutation(
        "gather-tiles-step-columns-by-the-row-stride",
        "the compiled gather's tiled copy of a transpose moves from one tile of columns to the next by the rows' "
        "stride",
        (("npu_agent/_fastencode.c", "src + i * s1 + j0 * s2, s2, item, 0, n);\n",
          "src + i * s1 + j0 * s1, s2, item, 0, n);\n"),),
        ("tests/test_fastencode.py",)),
    Mutation(
        "clone-stride-keeps-a-slices-strides",
        "the compiled walk writes a non-contiguous tensor's own strides into its table entry even where its elements "
        "are not dense (a slice), whose clone is row-major",
        (("npu_agent/_fastencode.c", "            return ndim == 4 || ndim == 5 ? -2 : 0;\n",
          "            return ndim == 4 || ndim == 5 ? -2 : 1;\n"),),
        ("tests/test_fastencode.py",)),
    Mutation(
        "fastencode-writes-past-its-buffer",
        "the compiled walk puts a field's key and length in front of it without making room: it writes past its buffer",
        (("npu_agent/_fastencode.c", "    if (reserve(b, k) < 0)\n        return -1;\n    memmove(b->p + start + k,",
          "    memmove(b->p + start + k,"),),
        ("tests/test_frame_pool_bounds.py",)),
    Mutation(
        "seen-meta-skips-the-payload-check",
        "a tensor meta the decoder validated before is trusted whole: its bytes are not checked against this payload",
        (("protos/codec.py", "                self._inside(i, known[0][3], known[0][4])", "                pass"),),
        ("tests/test_decode_views.py",)),
    Mutation(
        "seen-metas-shared-across-limits",
        "the decoder's validated metas are kept once for all limits: a meta valid under one passes under stricter ones",
        (("protos/codec.py", "    found = _SEEN.get(id(limits))", "    found = _SEEN.get(0)"),
         ("protos/codec.py", "        found = _SEEN[id(limits)] =", "        found = _SEEN[0] =")),
        ("tests/test_decode_views.py",)),
    Mutation(
        "payload-view-at-the-byte-offset",
        "a tensor beside others is taken from the payload's dtype view at its byte offset, not its element offset",
        (("protos/codec.py", "dense, offset // size)", "dense, offset)"),),
        ("tests/test_decode_views.py",)),
    Mutation(
        "fastlocate-keeps-the-cell",
        "the compiled frame walk takes `self` of `_call_impl` as it lies in the frame, a cell, not its content",
        (("npu_agent/_fastlocate.c",
          "        if (self != NULL && PyCell_Check(self))\n            self = PyCell_GET(self);\n", ""),),
        ("tests/test_location.py",)),
    Mutation(
        "fastlocate-walks-on-from-a-finished-frame",
        "the compiled frame walk goes on from a finished frame by `previous`, which ends there, instead of leaving it "
        "to Python",
        (("npu_agent/_fastlocate.c", "        if (f->owner == FRAME_OWNED_BY_FRAME_OBJECT) {",
          "        if (0) {"),),
        ("tests/test_location.py",)),
    Mutation(
        "fasttap-zero-is-not-zero",
        "the compiled argument read gives a float argument's signature part as 'not 0' instead of 'is 0'",
        (("npu_agent/_fasttap.c", "PyFloat_AS_DOUBLE(value) == 0.0)", "PyFloat_AS_DOUBLE(value) != 0.0)"),),
        ("tests/test_fasttap.py",)),
    Mutation(
        "fasttap-a-list-of-tensors-passes",
        "the compiled argument read takes a list holding tensors for a shape: it neither ends the read nor taps them",
        (("npu_agent/_fasttap.c", "            if (!truth)\n                return 1;\n", ""),),
        ("tests/test_fasttap.py",)),
    Mutation(
        "fasttap-positions-stand-still",
        "the compiled argument read gives every tapped tensor the same flattened position",
        (("npu_agent/_fasttap.c", "    *position += 1;\n", ""),),
        ("tests/test_fasttap.py",)),
    Mutation(
        "fasttap-hold-counts-a-tensor-twice",
        "the compiled read of a recorded call's inputs holds a tensor passed twice twice (its bytes counted twice)",
        (("npu_agent/_fasttap.c", "    if (known != 0) {", "    if (known < 0) {"),),
        ("tests/test_fasttap.py",)),
    Mutation(
        "fasttap-known-tree-ignores-its-edge-count",
        "the compiled check of a known tree takes a node whose edges that are not None are more or fewer for it",
        (("npu_agent/_fasttap.c", "ok && count == want_count ?", "ok ?"),),
        ("tests/test_fasttap.py",)),
    Mutation(
        "fasttap-known-tree-trusts-a-leaf",
        "the compiled check of a known tree takes any leaf's AccumulateGrad node for the tapped parameter's",
        (("npu_agent/_fasttap.c", "            same = variable == NULL ? -1 : variable == t;",
          "            same = variable == NULL ? -1 : 1;"),),
        ("tests/test_fasttap.py",)),
    Mutation(
        "fasttap-grads-weigh-nothing",
        "the compiled hold of a backward record's gradients counts none of their bytes",
        (("npu_agent/_fasttap.c", "    PyObject *size = tree == NULL ? NULL : PyLong_FromLongLong(nbytes);",
          "    PyObject *size = tree == NULL ? NULL : PyLong_FromLongLong(0);"),),
        ("tests/test_fasttap.py",)),
    Mutation(
        "fastmask-chunks-pass-nan",
        "the compiled dropout check reading a tensor in place takes NaN and infinity for finite in its chunks",
        (("npu_agent/_fastmask.cpp",
          "            bad |= static_cast<unsigned>(u == 0) | static_cast<unsigned>(u >= inf);",
          "            bad |= static_cast<unsigned>(u == 0);"),),
        ("tests/test_fastmask.py",)),
    Mutation(
        "fastmask-tail-passes-infinity",
        "the compiled dropout check reading a tensor in place takes infinity for finite after its last chunk",
        (("npu_agent/_fastmask.cpp", "        if (u == 0 || u >= inf)", "        if (u == 0 || u > inf)"),),
        ("tests/test_fastmask.py",)),
    Mutation(
        "fastmask-zero-passes-through-the-ops",
        "the compiled dropout check through torch's ops (another device, dtype or a subclass) takes 0 for not zero",
        (("npu_agent/_fastmask.cpp", "    return v[0] > 0 && v[1]", "    return v[0] >= 0 && v[1]"),),
        ("tests/test_fastmask.py",)),
    Mutation(
        "fastmask-state-read-as-stored",
        "the compiled read of a generator state's bytes reads its memory as stored, not its elements in order",
        (("npu_agent/_fastmask.cpp", "        host = THPVariable_Unpack(arg).cpu().contiguous();",
          "        host = THPVariable_Unpack(arg).cpu();"),),
        ("tests/test_fastmask.py",)),
    Mutation(
        "held-copies-forget-nothing",
        "a writer's check for references still held says yes once any snapshot is pending, gone or copied",
        (("npu_agent/snapshot.py",
          "            return any(entry[2] is None for snap in self._live() for entry in snap.held.values())",
          "            return bool(self.pending)"),),
        ("tests/test_capture_refs.py",)),
    Mutation(
        "fasthook-post-hook-gets-its-inputs-twice",
        "a post-hook put on in C++ gets the node's grad_inputs where its grad_outputs belong",
        (("npu_agent/_fasthook.cpp", "            outputs = wrap(grad_outputs);",
          "            outputs = wrap(grad_inputs);"),),
        ("tests/test_fasthook.py",)),
    Mutation(
        "fasthook-beside-torchs-dict",
        "a hook put on in C++ on a node that has torch's dict of Python hooks becomes a hook of its own (after them "
        "all) instead of going into the dict after the hooks put on before it",
        (("npu_agent/_fasthook.cpp", "    if (dict != nullptr) {", "    if (dict != nullptr && false) {"),),
        ("tests/test_fasthook.py",)),
    Mutation(
        "fasthook-gradient-not-copied",
        "a parameter's gradient is kept as the compiled copy's detached view of it, not a copy",
        (("npu_agent/_fasthook.cpp", "        copy = g.detach().clone();", "        copy = g.detach();"),),
        ("tests/test_fasthook.py",)),
    Mutation(
        "fasthook-compiled-post-hook-as-pre",
        "under compiled autograd, a post-hook put on in C++ is handed to the compiler as a pre-hook",
        (("npu_agent/_fasthook.cpp", "        args.add_post_hook(held.for_compiler());",
          "        args.add_pre_hook(held.for_compiler());"),),
        ("tests/test_fasthook.py",)),
    Mutation(
        "a-shape-may-hold-tensors",
        "a tuple or list whose items include tensors passes for a shape: the flat walks neither hold nor tap them",
        (("npu_agent/snapshot.py", "            kind = arg_kind(type(v))\n        if kind:\n            return False\n",
          "            kind = arg_kind(type(v))\n        if kind == NESTED:\n            return False\n"),),
        ("tests/test_shape_arguments.py",)),
    Mutation(
        "a-known-graph-trusts-its-leaves",
        "a parameter's edge passes for any tapped leaf: two parameters' gradients may be swapped in the record",
        (("npu_agent/backward.py", "                if getattr(edge, \"variable\", None) is not t:\n",
          "                if edge is None:\n"),),
        ("tests/test_known_graphs.py",)),
    Mutation(
        "a-known-graph-ignores-other-edges",
        "a node with an input edge the known graph did not have passes for known",
        (("npu_agent/backward.py", "        if len(nf) != size or sum(n is not None for n, _ in nf) != count:\n",
          "        if len(nf) != size:\n"),),
        ("tests/test_known_graphs.py",)),
    Mutation(
        "a-call-reading-an-input-twice-is-learned",
        "a composite that reads an input along two edges is learned: its later calls take one edge's gradient only",
        (("npu_agent/backward.py",
          "    if sorted(slot for *_, edges in tree for _, slot in edges) != list(range(slots)):\n",
          "    if not set(slot for *_, edges in tree for _, slot in edges) == set(range(slots)):\n"),),
        ("tests/test_known_graphs.py",)),
    Mutation(
        "a-known-call-that-is-not-loses-its-outputs",
        "a call of a known signature whose graph is another makes no backward record at all (no output hooked)",
        (("npu_agent/backward.py",
          "{ctx.record.step})\")\n        self._hook_outputs(ctx, entry, out)\n",
          "{ctx.record.step})\")\n"),),
        ("tests/test_known_graphs.py",)),
    Mutation(
        "a-kept-graph-is-its-inputs-and-outputs",
        "a kept forward graph counts its leaves and outputs only: an attention's saved projections and weights go "
        "uncounted against --graph-memory-mb",
        (("gpu_server/replay/run.py", '            if name.startswith("_saved_") or name == "saved_tensors":\n',
          '            if name == "saved_tensors":\n'),),
        ("tests/test_graph_bytes.py",)),
    Mutation(
        "a-kept-graph-frees-what-its-backward-reads",
        "a kept graph lets go of every output, a softmax's and an exp's too, which their backward reads",
        (("gpu_server/replay/run.py", "        if _storage_key(t) in needed:\n            continue\n", ""),),
        ("tests/test_sandbox_kept.py",)),
    Mutation(
        "a-kept-graph-keeps-every-output",
        "a replay worker's kept graphs keep the outputs they answered, counted against --graph-memory-mb",
        (("gpu_server/replay/sandbox_worker.py", "                    replay.release_outputs(kept[0])\n",
          "                    pass\n"),),
        ("tests/test_sandbox_kept.py",)),
    Mutation(
        "a-dead-workers-graph-handles-are-still-sent",
        "a backward whose kept graphs died with their worker process sends their handles to the next one, without "
        "its forward record",
        (("gpu_server/replay/sandbox.py", "kept.generation == self.generation and self._alive() else None",
          "kept.generation == self.generation else None"),),
        ("tests/test_sandbox.py",)),
    Mutation(
        "a-worker-that-ended-between-requests-is-blamed-on-the-next",
        "a worker process that ended after its last answer is found only by the next request, which is lost",
        (("gpu_server/replay/sandbox.py", "if self._proc is not None and self._hello and not self._alive():",
          "if False:"),),
        ("tests/test_sandbox.py",)),
    Mutation(
        "the-replay-worker-dies-with-the-servers-process-group",
        "the replay worker shares the server's process group and takes SIGINT and SIGTERM: the replay in flight when "
        "the group is signalled is quarantined",
        (("gpu_server/replay/prestart.py", "start_new_session=True)", "start_new_session=False)"),
         ("gpu_server/replay/sandbox_worker.py", "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n", "")),
        ("tests/test_sandbox.py",)),
    Mutation(
        "a-replay-worker-outlives-its-server",
        "a replay worker whose server was killed goes on with its replay (to its end, or forever)",
        (("gpu_server/replay/sandbox_worker.py", "    _die_with_the_server()\n", ""),),
        ("tests/test_sandbox.py",)),
    Mutation(
        "a-forked-worker-is-not-the-servers-child",
        "the server starts its fork server without becoming a subreaper: the workers it forks are orphans of init, "
        "which the server can neither wait for nor see end",
        (("gpu_server/replay/prestart.py", "and fork_server.become_subreaper():", "and True:"),),
        ("tests/test_prestart.py",)),
    Mutation(
        "the-fork-server-holds-the-servers-end-of-its-socket",
        "the fork server keeps the server's end of their socket open: the server closing it no longer ends the fork "
        "server's input, and a fork server outlives its server's stop until the parent-death signal",
        (("gpu_server/replay/fork_server.py", "        server_end.close()\n", ""),),
        ("tests/test_prestart.py::test_the_server_s_workers_are_forked_by_its_fork_server",)),
    Mutation(
        "a-process-running-threads-forks-its-fork-server",
        "a process that runs threads (a test, an embedding process) forks its fork server from itself: the fork may "
        "inherit a lock another thread held, and torch's thread pools, which it then uses",
        (("gpu_server/replay/prestart.py", "if fork and threading.active_count() == 1:", "if fork:"),),
        ("tests/test_prestart.py::test_replaced_workers_are_forked_and_once_the_fork_server_is_gone_started_fresh",)),
    Mutation(
        "a-forked-worker-does-not-wait-to-be-the-servers",
        "a forked worker takes its parent-death signal before the server adopts it: the short-lived child in "
        "between ends, and the signal kills the worker at once",
        (("gpu_server/replay/fork_server.py", "    while os.getppid() != server:", "    while False:"),),
        ("tests/test_prestart.py",)),
    Mutation(
        "a-forked-workers-end-is-not-seen",
        "a forked worker that ended still polls as running: the next request goes to it and is lost",
        (("gpu_server/replay/fork_server.py", "        pid = self._known(0.0)\n        if self.returncode",
          "        return None\n        if self.returncode"),),
        ("tests/test_prestart.py",)),
    Mutation(
        "a-forked-workers-exit-status-is-lost",
        "a forked worker's end is reported without the signal that ended it (the quarantine's message names none)",
        (("gpu_server/replay/fork_server.py", "self.returncode = os.waitstatus_to_exitcode(status)",
          "self.returncode = 1"),),
        ("tests/test_prestart.py",)),
    Mutation(
        "killing-a-worker-not-yet-forked-waits-for-its-fork",
        "a server stopping a worker its fork server has not forked yet waits for the fork server's whole start timeout",
        (("gpu_server/replay/fork_server.py", "pid = self._known(min(KILL_WAIT_S, self._start_timeout))",
          "pid = self._known(self._start_timeout)"),),
        ("tests/test_prestart.py::test_a_worker_the_fork_server_never_forks_counts_as_killed_without_waiting_for_it",)),
    Mutation(
        "a-short-tile-takes-a-full-tiles-rows",
        "the metrics' last, shorter tile is written into and summed over a full tile's rows (stale summands)",
        (("gpu_server/judging/metrics.py", "(full, grid) if m == size else", "(full, grid) if True else"),),
        ("tests/test_fast_paths.py",)),
    Mutation(
        "graphs-dropped-go-uncounted",
        "kept graphs dropped for --graph-memory-mb are not counted: the summary never says the budget is too small",
        (("gpu_server/checking/pending.py", "            self.graphs_dropped += 1\n", ""),),
        ("tests/test_fast_paths.py", "tests/test_graph_memory.py")),
    Mutation(
        "a-known-graph-is-never-forgotten",
        "a call whose graph was not the known one leaves its signature known: later calls go without aliases too",
        (("npu_agent/backward.py", "        self.known.pop(signature, None)\n", "        pass\n"),
         ("npu_agent/backward.py", "        if signature not in self.mixed:\n            self.mixed.add(signature)\n",
          "        if signature not in self.mixed:\n            pass\n")),
        ("tests/test_known_graphs.py",)),
    Mutation(
        "every-bound-slot-runs-unseen",
        "the compiled skip runs any method-wrapper at once, a property's setter too, not only its getter",
        (("npu_agent/_fastskip.c", 'PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__get__") == 0',
          "PyUnicode_Check(name)"),),
        ("tests/test_fastskip.py",)),
    Mutation(
        "agent-hands-freed-memory-back",
        "the agent never fixes glibc's thresholds: the training's next tensors fault in new pages while records hold "
        "the step before's",
        (("npu_agent/debugger.py", "freed_memory.keep_for_held(self.config.memory_bytes)", "pass"),),
        ("tests/test_malloc_policy.py",)),
    Mutation(
        "agent-keeps-only-glibcs-own",
        "the agent's trim threshold leaves out what its records may hold",
        (("npu_agent/freed_memory.py", "trim = min(int(memory_bytes) + 2 * malloc.MMAP_THRESHOLD",
          "trim = min(2 * malloc.MMAP_THRESHOLD"),),
        ("tests/test_malloc_policy.py",)),
    Mutation(
        "plaintext-answer-not-a-refusal",
        "a TLS agent's own handshake that gets a plaintext server's answer takes it for an outage (an UNAVAILABLE "
        "warning first, the refusal only on the next try)",
        (("npu_agent/refusal.py",
          "        if _has(why, _PLAINTEXT_SERVER):\n            return _plaintext_server(why, tls_dir)\n", ""),),
        ("tests/test_agent_refusal.py",)),
    Mutation(
        "cpu-use-counts-before-its-start",
        "the server's CPU by thread counts what a thread spent before the count began (the summary's split would "
        "hold a test process's or the start's CPU)",
        (("gpu_server/reports/cpu_use.py", "[t.name, seconds if first else 0.0, seconds]", "[t.name, 0.0, seconds]"),),
        ("tests/test_cpu_use.py",)),
    Mutation(
        "cpu-use-forgets-ended-threads",
        "the server's CPU by thread drops a thread once it has ended (the checking threads end before the summary "
        "is written)",
        (("gpu_server/reports/cpu_use.py", "self._ended.get(role(name), 0.0) + max(0.0, last - start)",
          "self._ended.get(role(name), 0.0)"),),
        ("tests/test_cpu_use.py",)),
    Mutation(
        "server-never-holds-answers",
        "the server answers every message at once, though the agent asked for its answers",
        (("gpu_server/intake/grpc_service.py", "            self.asked = True\n", "            self.asked = False\n"),),
        ("tests/test_answers_when_asked.py",)),
    Mutation(
        "held-answers-without-bound",
        "an agent that asked once and never again holds its stream's answers without bound",
        (("gpu_server/intake/grpc_service.py", "self.messages >= HELD_MESSAGES or",
          "self.messages >= HELD_MESSAGES * 1000 or"),),
        ("tests/test_answers_when_asked.py",)),
    Mutation(
        "agent-never-asks",
        "the agent's sender never asks for its answers (its server answers message by message)",
        (("npu_agent/sender.py", 'self._ask = getattr(transport, "ask", None)', "self._ask = None"),),
        ("tests/test_answers_when_asked.py",)),
)


def copy_repo(dest: str) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if not os.path.lexists(src):       # deleted in the working tree
            continue
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), target)
        elif os.path.isfile(src):
            shutil.copy2(src, target)
    os.symlink(os.path.join(ROOT, ".venv"), os.path.join(dest, ".venv"))


def apply(dest: str, mutation: Mutation) -> str:
    """Patch the copy; "" when every patch applied, else why not."""
    for rel, old, new in mutation.patches:
        path = os.path.join(dest, rel)
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            return f"{rel}: {exc}"
        count = text.count(old)
        if count == 0:
            return f"{rel}: the text to replace is not there"
        if count > 1 and not old.endswith("("):    # a call replaced everywhere (os.fsync), else exactly one place
            return f"{rel}: the text to replace is there {count} times"
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text.replace(old, new))
    return ""


def run_one(mutation: Mutation, keep: bool, timeout: float, every: bool = False) -> tuple[str, float, str]:
    """(outcome, seconds, where the copy is or the tail of pytest's output)."""
    since = time.monotonic()
    dest = tempfile.mkdtemp(prefix=f"mutant-{mutation.name}-")
    try:
        copy_repo(dest)
        why = apply(dest, mutation)
        if why:
            return "patch does not apply", time.monotonic() - since, why
        env = dict(os.environ, PYTHONPATH=dest, PYTHONDONTWRITEBYTECODE="1")
        py = os.path.join(ROOT, ".venv", "bin", "python")
        probe = "import gpu_server, npu_agent; print(gpu_server.__file__, npu_agent.__file__)"
        where = subprocess.run([py, "-c", probe], cwd=dest, env=env, capture_output=True, text=True).stdout
        if not all(p.startswith(dest) for p in where.split()):
            return "copy not imported", time.monotonic() - since, where
        cmd = [py, "-m", "pytest", *([] if every else ["-x"]), "-q", "-p", "no:cacheprovider",
               "--basetemp", os.path.join(dest, ".pt"), *mutation.tests]
        try:
            proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
            out, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired:
            return "timeout", time.monotonic() - since, f"pytest ran past {timeout:.0f} s"
        if code == 0:
            outcome = "survived"
        elif code == 1:
            outcome = "killed"
        else:
            outcome = f"error (pytest exit {code})"
        tail = "\n".join(line for line in out.splitlines() if line.startswith(("FAILED", "ERROR")) or " passed" in line
                         or " failed" in line)
        return outcome, time.monotonic() - since, (dest if keep else "") + ("\n" if keep else "") + tail
    finally:
        if not keep:
            shutil.rmtree(dest, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", action="append", default=[], help="run only this mutation (repeatable)")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--all-failures", action="store_true",
                   help="run every test of the files (no -x): lists every test that kills the mutant")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mutant's pytest run")
    ns = p.parse_args(argv)
    if ns.list:
        for m in MUTATIONS:
            print(f"{m.name:30} {m.what}")
        return 0
    unknown = set(ns.only) - {m.name for m in MUTATIONS}
    if unknown:
        p.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    chosen = [m for m in MUTATIONS if not ns.only or m.name in ns.only]
    rows = []
    for m in chosen:
        print(f"-- {m.name}: {m.what}", flush=True)
        outcome, seconds, detail = run_one(m, ns.keep, ns.timeout, ns.all_failures)
        rows.append((m.name, " ".join(m.tests), outcome, seconds))
        print(f"   {outcome} in {seconds:.0f} s\n   " + detail.replace("\n", "\n   "), flush=True)
    width = max(len(r[0]) for r in rows)
    twidth = max(len(r[1]) for r in rows)
    print(f"\n{'mutation':{width}}  {'tests run':{twidth}}  {'outcome':22}  seconds")
    for name, tests, outcome, seconds in rows:
        print(f"{name:{width}}  {tests:{twidth}}  {outcome:22}  {seconds:7.0f}")
    return 0 if all(r[2] == "killed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
