"""Checking one job end to end: replay, compare every output, write the report rows (docs/design.md §6.4-§6.6).

A forward job gives `.forward.output.i` rows; a backward job gives `.backward.output.i` rows. The result rows
(one per API call, with both Forward and Backward Test Success) are written when the call is complete: at once
when no backward is expected, else when its backward job has been checked (or when the rank ended without one).
What waits, what is restored after a restart and what the journal may say is decided by gpu_server/pending.py;
`check` returns that decision as a `Completion`.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import OrderedDict
from typing import Any

import torch

from gpu_server import error_data, extensions, metrics, spread
from gpu_server.columns import BLANK
from gpu_server.job import CallKey, Job, call_key
from gpu_server.nonfinite import CallFiniteness
from gpu_server.output_kind import TENSORS, classify
from gpu_server.pending import Completion, PendingCalls, Waiting
from gpu_server.pooled import PooledErrors
from gpu_server.replay import ReplayError, flatten_outputs
from gpu_server.report_files import row_name
from gpu_server.reports import NULL_REPORTS, RankReports, ReportWriteError, Where
from gpu_server.sandbox import InlineReplayer, OnLost, Replayer, WorkerLost
from gpu_server.standards.judging import judge_pair
from gpu_server.statuses import ERROR, PASS, SKIP, WARNING, aggregate
from gpu_server.summary import Summary
from gpu_server.verdict import compare_pair
from protos import online_check_pb2 as pb

log = logging.getLogger("gpu_server")


@dataclasses.dataclass
class Outcome:
    """One direction of one call: statuses of its detail rows and the first message worth showing."""

    statuses: list[str] = dataclasses.field(default_factory=list)
    precision: list[str] = dataclasses.field(default_factory=list)
    message: str = ""
    precision_message: str = ""


def _dtype(x: Any) -> str:
    return str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else "()"


def _to_bench(device_output: Any, bench: Any) -> Any:
    """The device's output (a host tensor from the wire) on the bench output's device: a CUDA bench gets it through
    pinned memory, copied asynchronously on the current stream (the metrics that read it are queued after it)."""
    if not (isinstance(device_output, torch.Tensor) and isinstance(bench, torch.Tensor)):
        return device_output
    if device_output.device == bench.device:
        return device_output
    if bench.device.type == "cuda" and device_output.device.type == "cpu":
        return device_output.pin_memory().to(bench.device, non_blocking=True)
    return device_output.to(bench.device)


@dataclasses.dataclass
class _Graphs:
    """The forward replays of a call waiting for its backward record, with their autograd graphs (held by the
    replayer, gpu_server/sandbox.py: in this process or in its worker process)."""

    job: weakref.ref          # the forward job (weakly: an eviction from gpu_server/pending.py frees its inputs)
    kept: Any
    nbytes: int


class Checker:
    """Owns the report files of the ranks routed to it; called from one worker thread.

    The forward replays of a call whose backward record will come keep their autograd graphs (up to `graph_budget`
    bytes, the oldest dropped first): its backward replay then runs on them instead of replaying the forward again
    (a call whose graph was dropped is replayed in full, with the same rows)."""

    def __init__(self, out_dir: str, ts: str, device: torch.device, summary: Summary, backward_budget: int = 4 << 30,
                 error_data_base: str | None = None, pending: PendingCalls | None = None,
                 evidence: error_data.Evidence | None = None, graph_budget: int = 2 << 30,
                 pooled: PooledErrors | None = None, replayer: Replayer | None = None,
                 on_lost: OnLost | None = None):
        self.out_dir = out_dir
        self.pooled = pooled          # the run's pooled statistics across calls (gpu_server/pooled.py), shared
        self._pool_failed = False
        self.ts = ts
        self.device = device
        self.summary = summary
        self.pending = pending if pending is not None else PendingCalls(backward_budget)
        self.evidence = evidence or (error_data.Evidence(error_data_base, ts) if error_data_base else None)
        self._reports: dict[int, RankReports] = {}
        self._write_rows = True
        self.match_threads = True     # CPU same-dtype runs take the training's thread count (one CPU worker only)
        self.graph_budget = graph_budget
        self._graphs: OrderedDict[CallKey, _Graphs] = OrderedDict()   # oldest first
        self._graph_bytes = 0
        self.replayer = replayer if replayer is not None else InlineReplayer(device)
        self.on_lost = on_lost or (lambda job, why: None)   # a replay that killed its worker: quarantine the record

    def reports(self, rank: int) -> RankReports:
        if not self._write_rows:
            return NULL_REPORTS
        rep = self._reports.get(rank)
        if rep is None:
            rep = self._reports[rank] = RankReports(self.out_dir, self.ts, rank)
            self.summary.add_files(rank, rep.paths)
        return rep

    # -- entry point -----------------------------------------------------------------------------------------
    def check(self, job: Job) -> Completion:
        """Check one job; returns what its records' journal lines may say. A forward record restored from the
        spool after a restart (its detail rows exist) only rebuilds its wait for the backward record.
        Raises ReportWriteError when rows cannot be written (its records then stay in the spool)."""
        self._write_rows = not (job.direction != pb.BACKWARD and self.pending.is_restored(job))
        try:
            return self._check(job)
        finally:
            self._write_rows = True

    def _check(self, job: Job) -> Completion:
        waiting = self.pending.take(job) if job.direction == pb.BACKWARD else None
        try:
            if job.direction == pb.BACKWARD:
                return self._check_backward(job, waiting)
            return self._check_forward(job)
        except ReportWriteError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad job must not stop the worker
            log.exception("internal error while checking %s", job.name)
            why = f"internal error while checking: {type(exc).__name__}: {exc}"
            if job.direction != pb.BACKWARD:
                return self._forward_complete(job, Outcome([SKIP], [SKIP], why, why))
            forward = waiting.outcome if waiting is not None else Outcome([SKIP], [SKIP], why, why)
            self._finish(job, forward, Outcome([SKIP], [SKIP], why, why))
            return self.pending.backward_done(job, waiting)

    # -- forward -----------------------------------------------------------------------------------------------
    def _check_forward(self, job: Job) -> Completion:
        rep = self.reports(job.rank)
        if job.skip_reason:
            out = self._skip_rows(rep, job, "forward", job.skip_reason)
            return self._forward_complete(job, out)
        keep = job.backward_expected and self.graph_budget > 0
        try:
            runs = self.replayer.forward(job, keep, self.match_threads)
        except (ReplayError, WorkerLost) as exc:
            out = self._skip_rows(rep, job, "forward", self._failed(job, exc))
            return self._forward_complete(job, out)
        if runs.kept is not None:
            self._keep_graphs(job, _Graphs(weakref.ref(job), runs.kept, runs.nbytes))
        device, bench, same = flatten_outputs(job.output), runs.bench, runs.same
        if extensions.has_postprocess(job.category, job.api):   # only the meaningful part of each run is compared
            device, bench, same = extensions.postprocess(job.category, job.api, job.args, job.kwargs,
                                                         [device, bench, same])
        self._note_finiteness(job, "forward", (job.args, job.kwargs), device, bench)
        members = (spread.LazyRuns(lambda: extensions.postprocess(
            job.category, job.api, job.args, job.kwargs, self.replayer.forward_members(job, self.match_threads)))
            if runs.same is not None else None)
        outcome = self._compare(rep, job, "forward", device, bench, same, runs.same_error, members)
        if job.backward_expected:
            return self._hold(job, outcome)
        self._finish(job, outcome, None, fwd_job=job)
        return self.pending.forward_done(job)

    def _forward_complete(self, job: Job, outcome: Outcome) -> Completion:
        """A forward that gets no replay. One whose backward record is to come waits for it (one call, one result
        row), and so does a restored one (its SKIP or result may have differed at first): its result row is not
        written yet."""
        if not self._write_rows or job.backward_expected:
            return self._hold(job, outcome)
        self._finish(job, outcome, None)
        return self.pending.forward_done(job)

    def _hold(self, job: Job, outcome: Outcome) -> Completion:
        done, displaced = self.pending.hold(job, outcome)
        if displaced is not None:   # a second forward record of one call: the first one's result row now
            why = "a second forward record of this call arrived before its backward record"
            self._finish_waiting(job.run_id, job.rank, job.step, job.name, displaced, why)
            done.done.append(displaced.record)
        return done

    # -- backward ----------------------------------------------------------------------------------------------
    def _check_backward(self, job: Job, waiting: Waiting | None) -> Completion:
        rep = self.reports(job.rank)
        graphs = self._drop_graphs(call_key(job), used=True)   # used by this backward replay, or by none
        used = None
        fwd_job = waiting.job if waiting is not None else None
        forward = waiting.outcome if waiting is not None else Outcome(
            [SKIP], [SKIP], "forward record of this call was not received")
        if job.skip_reason:
            bwd = self._skip_rows(rep, job, "backward", job.skip_reason)
        elif fwd_job is not None and fwd_job.skip_reason:
            bwd = self._skip_rows(rep, job, "backward", f"backward not replayed: its forward record was skipped "
                                                        f"({fwd_job.skip_reason})")
        elif fwd_job is None:
            why = ("its forward inputs were evicted from the server's backward memory; raise --backward-memory-mb"
                   if waiting is not None and waiting.evicted else "its forward record was not received")
            bwd = self._skip_rows(rep, job, "backward", f"backward not replayed: {why}")
        elif job.grad_input is None or not flatten_outputs(job.grad_input):
            bwd = Outcome()   # no gradient reached this call's inputs: no backward rows (" ")
        else:
            used = graphs if graphs and graphs.job() is fwd_job else None
            bwd = self._replay_backward(rep, fwd_job, job, used)
        if graphs is not None and used is None:
            self.replayer.drop(graphs.kept)
        self._finish(job, forward, bwd, fwd_job=fwd_job, bwd_job=job)
        return self.pending.backward_done(job, waiting)

    # -- forward graphs kept for the backward replay -------------------------------------------------------------
    def _keep_graphs(self, job: Job, graphs: _Graphs) -> None:
        key = call_key(job)
        self._drop_graphs(key)
        self._graphs[key] = graphs
        self._graph_bytes += graphs.nbytes
        while self._graph_bytes > self.graph_budget and self._graphs:
            self._drop_graphs(next(iter(self._graphs)))

    def _drop_graphs(self, key: CallKey, used: bool = False) -> _Graphs | None:
        graphs = self._graphs.pop(key, None)
        if graphs is not None:
            self._graph_bytes -= graphs.nbytes
            if not used:
                self.replayer.drop(graphs.kept)
        return graphs

    def _failed(self, job: Job, exc: Exception) -> str:
        """The SKIP reason of a replay that failed; one that cost its worker process quarantines the record."""
        why = str(exc)
        if isinstance(exc, WorkerLost):
            log.error("%s (rank %d, step %d, seq %d): %s", job.name, job.rank, job.step, job.seq, why)
            self.on_lost(job, why)
        return why

    def _replay_backward(self, rep: RankReports, fwd: Job, bwd: Job, graphs: _Graphs | None = None) -> Outcome:
        try:
            runs = self.replayer.backward(fwd, bwd, graphs.kept if graphs else None, self.match_threads)
        except (ReplayError, WorkerLost) as exc:
            return self._skip_rows(rep, bwd, "backward", self._failed(bwd, exc))
        bench, same, same_error = runs.bench, runs.same, runs.same_error
        device = list(bwd.grad_input) if isinstance(bwd.grad_input, (list, tuple)) else [bwd.grad_input]
        keep = [i for i, g in enumerate(device) if g is not None]
        # a backward call's inputs: the gradient that reached it and its forward inputs
        self._note_finiteness(bwd, "backward", (bwd.grad_output, fwd.args, fwd.kwargs), [device[i] for i in keep],
                              [bench[i] for i in keep])
        members = (spread.LazyRuns(lambda: [[m[i] for i in keep] for m in self.replayer.backward_members(
            fwd, bwd, self.match_threads)]) if same is not None else None)
        return self._compare(rep, bwd, "backward", [device[i] for i in keep], [bench[i] for i in keep],
                             [same[i] for i in keep] if same is not None else None, same_error, members)

    # -- comparison rows ---------------------------------------------------------------------------------------
    def _compare(self, rep: RankReports, job: Job, direction: str, device: list, bench: list,
                 same: list | None, same_error: str, members: spread.LazyRuns | None = None) -> Outcome:
        outcome = Outcome()
        if len(bench) != len(device):
            msg = f"bench and device outputs differ in structure: {len(bench)} vs {len(device)} compared values"
            where = Where(job.seq, job.module, job.source)
            rep.write_detail(row_name(job.name, direction, 0), BLANK, BLANK, BLANK, None, ERROR, msg, job.step,
                             where=where)
            rep.write_precision_detail(row_name(job.name, direction, 0), {}, ERROR, BLANK, msg, job.step,
                                       where=where)
            self._note_row(job, row_name(job.name, direction, 0), ERROR, "accuracy_checking", msg)
            return Outcome([ERROR], [ERROR], msg, msg)
        for i, (d, b) in enumerate(zip(device, bench)):
            row = row_name(job.name, direction, i)
            # the bench and same-dtype outputs stay where they were computed (the metrics run on the bench device);
            # the device's output goes there once
            b_on = b.detach() if isinstance(b, torch.Tensor) else b
            s = same[i] if same is not None and i < len(same) else None
            s_on = s.detach() if isinstance(s, torch.Tensor) else s
            d_on = _to_bench(d, b_on)
            others = members.output(i) if members is not None else ()   # gpu_server.spread's runs, lazily
            with metrics.shared():   # each (bench, other) pair is analysed once, the host's two in one pass
                metrics.prefetch(b_on, [d_on, s_on])
                pair = classify(b_on, d_on)   # sorted into its kind once, for both reports
                cmp = compare_pair(pair, spread.with_host(s_on, others))
                # by Category.api: the per-API judging of the extension file's [[judge]] (standards/selection.py)
                verdict = judge_pair(job.api, pair, s_on, spread=others, category=job.category)
            if self._write_rows and self.pooled is not None and pair.kind == TENSORS:
                self._pool(job, direction, i, b_on, d_on, s_on)
            rep.write_detail(row, _dtype(b), _dtype(d), _shape(d), cmp.metrics, cmp.status, cmp.message, job.step,
                             where=Where(job.seq, job.module, job.source))
            self._note_row(job, row, cmp.status, "accuracy_checking", cmp.message)
            outcome.statuses.append(cmp.status)
            if cmp.status in (ERROR, WARNING) and not outcome.message:
                outcome.message = f"{row}: {cmp.message}"
            message = "; ".join(m for m in (verdict.message, same_error) if m)
            rep.write_precision_detail(row, verdict.cells, verdict.status, verdict.algorithm, message, job.step,
                                       where=Where(job.seq, job.module, job.source))
            self._note_row(job, row, verdict.status, "api_precision_compare", f"{verdict.algorithm} {message}")
            if self._write_rows:
                self.summary.standard_row(verdict.algorithm, verdict.status)
            outcome.precision.append(verdict.status)
            if verdict.status == ERROR and not outcome.precision_message:
                outcome.precision_message = f"{row}: {verdict.algorithm} {message}".strip()
        return outcome

    def _pool(self, job: Job, direction: str, index: int, bench: Any, device: Any, same: Any) -> None:
        """One compared output into the pooled statistics across calls; never fails the row (logged once)."""
        try:
            self.pooled.observe(f"{job.category}.{job.api}", direction, bench, device, same, output_index=index)
        except Exception:  # noqa: BLE001 - the pooled statistics are a view of the rows, never a reason to lose one
            if not self._pool_failed:
                self._pool_failed = True
                log.exception("pooled statistics: %s could not be pooled (logged once)",
                              row_name(job.name, direction, index))

    def _skip_rows(self, rep: RankReports, job: Job, direction: str, reason: str, status: str = SKIP) -> Outcome:
        """One detail row in each report with a fixed status (SKIP, or ERROR for a collective judged wrong without
        a comparison) and its reason."""
        row = row_name(job.name, direction, 0)
        where = Where(job.seq, job.module, job.source)
        rep.write_detail(row, BLANK, BLANK, BLANK, None, status, reason, job.step, where=where)
        rep.write_precision_detail(row, {}, status, BLANK, reason, job.step, where=where)
        self._note_row(job, row, status, "accuracy_checking", reason)
        if status != SKIP:
            self._note_row(job, row, status, "api_precision_compare", reason)
        return Outcome([status], [status], reason, reason)

    def _note_row(self, job: Job, row: str, status: str, report: str, message: str) -> None:
        """The summary's first anomaly in execution order (gpu_server/summary.py) sees every details row."""
        if self._write_rows:
            self.summary.row_done(job.rank, job.step, job.seq, row, status, report, message, job.module, job.source)

    def _note_finiteness(self, job: Job, direction: str, inputs: Any, device: list, bench: list) -> None:
        """Whether this call made the first inf/NaN from finite inputs, or received some (gpu_server/nonfinite.py)."""
        if not self._write_rows:
            return
        try:
            fin = CallFiniteness.of(inputs, device, bench)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never fail the call's rows
            log.debug("finiteness of %s not measured: %s", job.name, exc)
            return
        if fin.origin or not fin.inputs_finite:
            self.summary.nonfinite(job.rank, job.step, job.seq, job.name, direction, job.module, job.source,
                                   fin.inputs_finite, fin.device, fin.bench)

    # -- collectives (gpu_server/collectives.py) ------------------------------------------------------------------
    def check_collective(self, finding: Any, verdict: Any) -> Completion:
        """Write one rank's rows of a collective the matcher has decided (`finding`, a collectives.Finding;
        `verdict`, its collectives.RankVerdict for this rank): the detail rows (compared against the reference made
        from every member's inputs, the members' orders of reduction as the spread; or the verdict's fixed status),
        the result row, and the collective CSV's row. The record is then done. Raises ReportWriteError."""
        job = verdict.job
        self._write_rows = True
        rep = self.reports(job.rank)
        device = flatten_outputs(job.output) if job.output is not None else []
        bench = list(verdict.bench) if verdict.bench else []
        try:
            if verdict.status is not None:
                outcome = self._skip_rows(rep, job, "forward", verdict.message or finding.message or "collective "
                                          f"{finding.kind}", status=verdict.status)
            elif not bench:   # a send, reduce's non-root ranks: this rank's output is not what is judged
                outcome = self._skip_rows(rep, job, "forward", verdict.message or finding.message or "nothing to "
                                          "compare on this rank: the collective's result is judged on the ranks "
                                          "that receive it")
            else:
                members = verdict.members
                outcome = self._compare(rep, job, "forward", device, bench, verdict.same, "",
                                        spread.LazyRuns(lambda: list(members or [])) if members else None)
        except ReportWriteError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad collective must not stop the worker
            log.exception("internal error while writing the collective %s", job.name)
            why = f"internal error while checking: {type(exc).__name__}: {exc}"
            outcome = self._skip_rows(rep, job, "forward", why)
        self._finish(job, outcome, None, fwd_job=job)
        status = aggregate(outcome.statuses + outcome.precision)   # the worse of the two reports' verdicts
        self._collective_row(rep, job, finding, verdict, status, outcome)
        return self.pending.forward_done(job)

    def _collective_row(self, rep: RankReports, job: Job, finding: Any, verdict: Any, status: str,
                        outcome: Outcome) -> None:
        info = job.collective
        message = finding.message or verdict.message
        if finding.kind == "matched" and status == ERROR:
            failed = f"rank {job.rank} failed: {outcome.message or outcome.precision_message}".strip()
            message = f"{message}; {failed}" if message else failed   # the finding (the suspect rank) first
        elif verdict.message and verdict.message not in message:
            message = f"{message}; {verdict.message}" if message else verdict.message
        device = flatten_outputs(job.output) if job.output is not None else []
        tensors = [t for t in device if isinstance(t, torch.Tensor)]
        dtype = ", ".join(sorted({str(t.dtype) for t in tensors}))
        shape = _shape(tensors[0]) if len(tensors) == 1 else ", ".join(_shape(t) for t in tensors[:8])
        group = info.group if info is not None else ""
        ranks = " ".join(str(r) for r in info.ranks) if info is not None else ""
        if rep.write_collective(job.name, group, ranks, info.seq if info is not None else BLANK,
                                info.op if info is not None else "", dtype, shape, status, finding.kind, message,
                                job.step, where=Where(job.seq, job.module, job.source)):
            self.summary.add_files(job.rank, rep.paths)
        self.summary.collective_row(job.rank, job.name, group, info.seq if info is not None else -1, status,
                                    finding.kind, message, tuple(getattr(finding, "named", ()) or ()), members=ranks)

    # -- result rows -------------------------------------------------------------------------------------------
    def _finish(self, job: Job, forward: Outcome, backward: Outcome | None, fwd_job: Job | None = None,
                bwd_job: Job | None = None) -> None:
        rep = self.reports(job.rank)
        fwd, bwd = aggregate(forward.statuses), aggregate(backward.statuses) if backward else BLANK
        pfwd, pbwd = aggregate(forward.precision), aggregate(backward.precision) if backward else BLANK
        msg = forward.message or (backward.message if backward else "")
        pmsg = forward.precision_message or (backward.precision_message if backward else "")
        call = fwd_job if fwd_job is not None else job   # the result row is the call's: its forward record's
        where = Where(call.seq, call.module, call.source)
        rep.write_result(job.name, fwd, bwd, msg if SKIP in (fwd, bwd) or ERROR in (fwd, bwd)
                         or WARNING in (fwd, bwd) else "", job.step, where=where)
        rep.write_precision_result(job.name, pfwd, pbwd, pmsg if pfwd != PASS or pbwd not in (PASS, BLANK) else "",
                                   job.step, where=where)
        if not self._write_rows:
            return
        self.summary.call_done(job.rank, job.name, fwd, bwd, pfwd, pbwd, pmsg or msg, module=call.module)
        if self.evidence is not None and fwd_job is not None and ERROR in (fwd, bwd, pfwd, pbwd):
            folder = self.evidence.save(fwd_job, bwd_job, pmsg or msg)
            if folder:
                self.summary.evidence_saved(job.rank, job.name, job.step, folder)

    def _finish_waiting(self, run_id: str, rank: int, step: int, name: str, waiting: Waiting, why: str) -> None:
        fwd = waiting.job   # None once evicted: its seq is still known
        job = Job(run_id=run_id, rank=rank, step=step, seq=fwd.seq if fwd is not None else waiting.record.seq,
                  name=name, category="", api="", direction=pb.BACKWARD, module=fwd.module if fwd is not None else "",
                  source=fwd.source if fwd is not None else "")
        self._finish(job, waiting.outcome, Outcome([SKIP], [SKIP], why, why), fwd_job=waiting.job)

    def flush_run(self, run_id: str, rank: int, why: str) -> Completion:
        """The rank ended: calls still waiting for a backward record get their result row."""
        done = Completion()
        for key in [k for k in self._graphs if k.run_id == run_id and k.rank == rank]:
            self._drop_graphs(key)
        for (rid, rk, step, name), waiting in self.pending.rank_ended(run_id, rank):
            self._finish_waiting(rid, rk, step, name, waiting, f"backward record never arrived ({why})")
            done.done.append(waiting.record)
        return done

    def close(self) -> None:
        """Close the reports. Calls still waiting for their backward record get no result row: that is
        gpu_server/pending.py's decision (they stay in the spool for a restart)."""
        self._graphs.clear()
        self._graph_bytes = 0
        for rep in self._reports.values():
            rep.close()
        self.replayer.close()
