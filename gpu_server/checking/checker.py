"""Checking one job: replay, compare every output, compute the report rows (docs/design.md §6.4-§6.6).

A forward job gives `.forward.output.i` rows; a backward job gives `.backward.output.i` rows; a complete call gives
its result rows (one per API call, with both Forward and Backward Test Success). The checker computes: each method
returns the rows as values (`Checked`: `reports.Row`s, in order, and what the summary learns once they are
written), and never writes them. When a call is complete, what waits for its backward record, what is restored after
a restart and what the journal may say are decided by gpu_server/checking/pending.py; gpu_server/checking/workers.py
writes the rows.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import torch

from gpu_server.checking.pending import Graphs, Waiting
from gpu_server.checking.pooled import PooledErrors
from gpu_server.columns import BLANK
from gpu_server.job import CallKey, Job
from gpu_server.judging import extremes, metrics
from gpu_server.judging.nonfinite import CallFiniteness, all_finite
from gpu_server.judging.output_kind import TENSORS, classify
from gpu_server.judging.standards.judging import judge_pair
from gpu_server.judging.verdict import compare_pair
from gpu_server.replay import extensions, spread
from gpu_server.replay.run import ReplayError, flatten_outputs
from gpu_server.replay.sandbox import InlineReplayer, OnLost, Replayer, WorkerLost
from gpu_server.reports import error_data
from gpu_server.reports.files import row_name
from gpu_server.reports.rank_reports import (
    Row,
    Where,
    collective_row,
    detail_row,
    precision_detail_row,
    precision_result_row,
    result_row,
)
from gpu_server.reports.summary import Summary
from gpu_server.statuses import ERROR, PASS, SKIP, WARNING, aggregate
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
class Checked:
    """What checking computed for one rank: its report rows, in order, and what the summary (and the pooled
    statistics, the error data) learn once they are written. gpu_server/checking/workers.py writes them."""

    rank: int
    rows: list[Row] = dataclasses.field(default_factory=list)
    notes: list[Callable[[], Any]] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: Checked) -> Checked:
        self.rows += other.rows
        self.notes += other.notes
        return self


@dataclasses.dataclass
class Forward:
    """A checked forward job: its outcome (the call's result row waits for it or is made from it), its detail rows
    and the autograd graphs its replays kept for the backward replay (None: none kept)."""

    outcome: Outcome
    checked: Checked
    graphs: Graphs | None = None


class Checker:
    """Computes the rows of the ranks routed to its worker; called from that one worker thread. Its replayer
    (gpu_server/replay/sandbox.py) runs the replays; the forward replays of a call whose backward record will come keep
    their autograd graphs when asked (gpu_server/checking/pending.py holds them with the waiting call): its backward
    replay
    then runs on them instead of replaying the forward again (a call whose graphs were dropped is replayed in full,
    with the same rows)."""

    def __init__(self, device: torch.device, summary: Summary, evidence: error_data.Evidence | None = None,
                 pooled: PooledErrors | None = None, replayer: Replayer | None = None,
                 on_lost: OnLost | None = None):
        self.pooled = pooled          # the run's pooled statistics across calls (gpu_server/checking/pooled.py), shared
        self._pool_failed = False
        self.device = device
        self.summary = summary
        self.evidence = evidence
        self.match_threads = True     # CPU same-dtype runs take the training's thread count (one CPU worker only)
        self.replayer = replayer if replayer is not None else InlineReplayer(device)
        self.on_lost = on_lost or (lambda job, why: None)   # a replay that killed its worker: quarantine the record

    # -- forward -----------------------------------------------------------------------------------------------
    def forward(self, job: Job, keep: bool) -> Forward:
        """Replay and compare a forward job (or take its SKIP reason): its detail rows and outcome. `keep`: keep
        its replays' autograd graphs for the backward replay."""
        fwd = Forward(Outcome(), Checked(job.rank))
        try:
            fwd.outcome = self._forward(job, keep, fwd)
        except Exception as exc:  # noqa: BLE001 - one bad job must not stop the worker
            log.exception("internal error while checking %s", job.name)
            why = f"internal error while checking: {type(exc).__name__}: {exc}"
            fwd.outcome = Outcome([SKIP], [SKIP], why, why)
        return fwd

    def _forward(self, job: Job, keep: bool, fwd: Forward) -> Outcome:
        out = fwd.checked
        if job.skip_reason:
            return self._skip_rows(out, job, "forward", job.skip_reason)
        try:
            runs = self.replayer.forward(job, keep, self.match_threads)
        except (ReplayError, WorkerLost) as exc:
            return self._skip_rows(out, job, "forward", self._failed(job, exc))
        if runs.kept is not None:
            fwd.graphs = Graphs(runs.kept, runs.nbytes, self.replayer)
        device, bench, same = flatten_outputs(job.output), runs.bench, runs.same
        if extensions.has_postprocess(job.category, job.api):   # only the meaningful part of each run is compared
            device, bench, same = extensions.postprocess(job.category, job.api, job.args, job.kwargs,
                                                         [device, bench, same])
        members = (spread.LazyRuns(lambda: extensions.postprocess(
            job.category, job.api, job.args, job.kwargs, self.replayer.forward_members(job, self.match_threads)))
            if runs.same is not None else None)
        with extremes.remembered():   # the outputs' extremes, read for their finiteness, serve the metrics too
            self._note_finiteness(out, job, "forward", lambda: self._inputs_finite(job), device, bench)
            return self._compare(out, job, "forward", device, bench, same, runs.same_error, members)

    # -- backward ----------------------------------------------------------------------------------------------
    def backward(self, job: Job, waiting: Waiting | None) -> Checked:
        """Check a backward job against its waiting forward (None if none waits): its detail rows and the call's
        result rows. The waiting call's kept graphs are used by this replay, or freed."""
        out = Checked(job.rank)
        try:
            fwd_job = waiting.job if waiting is not None else None
            forward = waiting.outcome if waiting is not None else Outcome(
                [SKIP], [SKIP], "forward record of this call was not received")
            bwd = self._backward(out, job, waiting)
            out += self.result(job, forward, bwd, fwd_job=fwd_job, bwd_job=job)
        except Exception as exc:  # noqa: BLE001 - one bad job must not stop the worker
            log.exception("internal error while checking %s", job.name)
            why = f"internal error while checking: {type(exc).__name__}: {exc}"
            forward = waiting.outcome if waiting is not None else Outcome([SKIP], [SKIP], why, why)
            out += self.result(job, forward, Outcome([SKIP], [SKIP], why, why))
        return out

    def _backward(self, out: Checked, job: Job, waiting: Waiting | None) -> Outcome:
        graphs = waiting.graphs if waiting is not None else None   # used by this backward replay, or freed
        fwd_job = waiting.job if waiting is not None else None
        used = None
        if job.skip_reason:
            bwd = self._skip_rows(out, job, "backward", job.skip_reason)
        elif fwd_job is not None and fwd_job.skip_reason:
            bwd = self._skip_rows(out, job, "backward", f"backward not replayed: its forward record was skipped "
                                                        f"({fwd_job.skip_reason})")
        elif fwd_job is None:
            why = ("its forward inputs were evicted from the server's backward memory; raise --backward-memory-mb"
                   if waiting is not None and waiting.evicted else "its forward record was not received")
            bwd = self._skip_rows(out, job, "backward", f"backward not replayed: {why}")
        elif job.grad_input is None or not flatten_outputs(job.grad_input):
            bwd = Outcome()   # no gradient reached this call's inputs: no backward rows (" ")
        else:
            used = graphs
            bwd = self._replay_backward(out, fwd_job, job, used)
        if graphs is not None and used is None:
            graphs.drop()
        return bwd

    def _failed(self, job: Job, exc: Exception) -> str:
        """The SKIP reason of a replay that failed; one that cost its worker process quarantines the record."""
        why = str(exc)
        if isinstance(exc, WorkerLost):
            log.error("%s (rank %d, step %d, seq %d): %s", job.name, job.rank, job.step, job.seq, why)
            self.on_lost(job, why)
        return why

    def _replay_backward(self, out: Checked, fwd: Job, bwd: Job, graphs: Graphs | None = None) -> Outcome:
        self.summary.backward_replayed(graphs is not None)
        try:
            runs = self.replayer.backward(fwd, bwd, graphs.kept if graphs else None, self.match_threads)
        except (ReplayError, WorkerLost) as exc:
            return self._skip_rows(out, bwd, "backward", self._failed(bwd, exc))
        bench, same, same_error = runs.bench, runs.same, runs.same_error
        device = list(bwd.grad_input) if isinstance(bwd.grad_input, (list, tuple)) else [bwd.grad_input]
        keep = [i for i, g in enumerate(device) if g is not None]
        members = (spread.LazyRuns(lambda: [[m[i] for i in keep] for m in self.replayer.backward_members(
            fwd, bwd, self.match_threads)]) if same is not None else None)
        with extremes.remembered():
            # a backward call's inputs: the gradient that reached it and its forward inputs
            self._note_finiteness(out, bwd, "backward",
                                  lambda: all_finite(bwd.grad_output) and self._inputs_finite(fwd),
                                  [device[i] for i in keep], [bench[i] for i in keep])
            return self._compare(out, bwd, "backward", [device[i] for i in keep], [bench[i] for i in keep],
                                 [same[i] for i in keep] if same is not None else None, same_error, members)

    # -- comparison rows ---------------------------------------------------------------------------------------
    def _compare(self, out: Checked, job: Job, direction: str, device: list, bench: list,
                 same: list | None, same_error: str, members: spread.LazyRuns | None = None) -> Outcome:
        outcome = Outcome()
        where = Where(job.seq, job.module, job.source)
        if len(bench) != len(device):
            msg = f"bench and device outputs differ in structure: {len(bench)} vs {len(device)} compared values"
            out.rows += [detail_row(row_name(job.name, direction, 0), BLANK, BLANK, BLANK, None, ERROR, msg, job.step,
                                    where=where),
                         precision_detail_row(row_name(job.name, direction, 0), {}, ERROR, BLANK, msg, job.step,
                                              where=where)]
            self._note_row(out, job, row_name(job.name, direction, 0), ERROR, "accuracy_checking", msg)
            return Outcome([ERROR], [ERROR], msg, msg)
        for i, (d, b) in enumerate(zip(device, bench)):
            row = row_name(job.name, direction, i)
            # the bench and same-dtype outputs stay where they were computed (the metrics run on the bench device);
            # the device's output goes there once
            b_on = b.detach() if isinstance(b, torch.Tensor) else b
            s = same[i] if same is not None and i < len(same) else None
            s_on = s.detach() if isinstance(s, torch.Tensor) else s
            d_on = _to_bench(d, b_on)
            others = members.output(i) if members is not None else ()   # gpu_server.replay.spread's runs, lazily
            with metrics.shared():   # each (bench, other) pair is analysed once, the host's two in one pass
                metrics.prefetch(b_on, [d_on, s_on])
                pair = classify(b_on, d_on)   # sorted into its kind once, for both reports
                cmp = compare_pair(pair, spread.with_host(s_on, others))
                # by Category.api: the per-API judging of the extension file's [[judge]] (standards/selection.py)
                verdict = judge_pair(job.api, pair, s_on, spread=others, category=job.category)
            if self.pooled is not None and pair.kind == TENSORS:
                out.notes.append(functools.partial(self._pool, job, direction, i, b_on, d_on, s_on))
            out.rows.append(detail_row(row, _dtype(b), _dtype(d), _shape(d), cmp.metrics, cmp.status, cmp.message,
                                       job.step, where=where))
            self._note_row(out, job, row, cmp.status, "accuracy_checking", cmp.message)
            outcome.statuses.append(cmp.status)
            if cmp.status in (ERROR, WARNING) and not outcome.message:
                outcome.message = f"{row}: {cmp.message}"
            message = "; ".join(m for m in (verdict.message, same_error) if m)
            out.rows.append(precision_detail_row(row, verdict.cells, verdict.status, verdict.algorithm, message,
                                                 job.step, where=where))
            self._note_row(out, job, row, verdict.status, "api_precision_compare", f"{verdict.algorithm} {message}")
            out.notes.append(functools.partial(self.summary.standard_row, verdict.algorithm, verdict.status))
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

    def _skip_rows(self, out: Checked, job: Job, direction: str, reason: str, status: str = SKIP) -> Outcome:
        """One detail row in each report with a fixed status (SKIP, or ERROR for a collective judged wrong without
        a comparison) and its reason."""
        row = row_name(job.name, direction, 0)
        where = Where(job.seq, job.module, job.source)
        out.rows += [detail_row(row, BLANK, BLANK, BLANK, None, status, reason, job.step, where=where),
                     precision_detail_row(row, {}, status, BLANK, reason, job.step, where=where)]
        self._note_row(out, job, row, status, "accuracy_checking", reason)
        if status != SKIP:
            self._note_row(out, job, row, status, "api_precision_compare", reason)
        return Outcome([status], [status], reason, reason)

    def _note_row(self, out: Checked, job: Job, row: str, status: str, report: str, message: str) -> None:
        """The summary's first anomaly in execution order (gpu_server/reports/summary.py) sees every details row."""
        out.notes.append(functools.partial(self.summary.row_done, job.rank, job.step, job.seq, row, status, report,
                                           message, job.module, job.source))

    @staticmethod
    def _inputs_finite(fwd: Job) -> bool:
        """Every float input of a forward call is finite: measured by its forward's check, read by its backward's."""
        if fwd.inputs_finite is None:
            fwd.inputs_finite = all_finite((fwd.args, fwd.kwargs))
        return fwd.inputs_finite

    def _note_finiteness(self, out: Checked, job: Job, direction: str, inputs_finite: Callable[[], bool],
                         device: list, bench: list) -> None:
        """Whether this call made the first inf/NaN from finite inputs, or received some
        (gpu_server/judging/nonfinite.py)."""
        try:
            fin = CallFiniteness.measure(inputs_finite(), device, bench)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never fail the call's rows
            log.debug("finiteness of %s not measured: %s", job.name, exc)
            return
        if fin.origin or not fin.inputs_finite:
            out.notes.append(functools.partial(self.summary.nonfinite, job.rank, job.step, job.seq, job.name,
                                               direction, job.module, job.source, fin.inputs_finite, fin.device,
                                               fin.bench))

    # -- collectives (gpu_server/checking/collectives.py)
    # ------------------------------------------------------------------
    def check_collective(self, finding: Any, verdict: Any) -> Checked:
        """One rank's rows of a collective the matcher has decided (`finding`, a collectives.Finding; `verdict`, its
        collectives.RankVerdict for this rank): the detail rows (compared against the reference made from every
        member's inputs, the members' orders of reduction as the spread; or the verdict's fixed status), the result
        row, and the collective CSV's row."""
        job = verdict.job
        out = Checked(job.rank)
        device = flatten_outputs(job.output) if job.output is not None else []
        bench = list(verdict.bench) if verdict.bench else []
        try:
            if verdict.status is not None:
                outcome = self._skip_rows(out, job, "forward", verdict.message or finding.message or "collective "
                                          f"{finding.kind}", status=verdict.status)
            elif not bench:   # a send, reduce's non-root ranks: this rank's output is not what is judged
                outcome = self._skip_rows(out, job, "forward", verdict.message or finding.message or "nothing to "
                                          "compare on this rank: the collective's result is judged on the ranks "
                                          "that receive it")
            else:
                members = verdict.members
                outcome = self._compare(out, job, "forward", device, bench, verdict.same, "",
                                        spread.LazyRuns(lambda: list(members or [])) if members else None)
        except Exception as exc:  # noqa: BLE001 - one bad collective must not stop the worker
            log.exception("internal error while writing the collective %s", job.name)
            why = f"internal error while checking: {type(exc).__name__}: {exc}"
            outcome = self._skip_rows(out, job, "forward", why)
        out += self.result(job, outcome, None, fwd_job=job)
        status = aggregate(outcome.statuses + outcome.precision)   # the worse of the two reports' verdicts
        self._collective_row(out, job, finding, verdict, status, outcome)
        return out

    def _collective_row(self, out: Checked, job: Job, finding: Any, verdict: Any, status: str,
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
        out.rows.append(collective_row(job.name, group, ranks, info.seq if info is not None else BLANK,
                                       info.op if info is not None else "", dtype, shape, status, finding.kind,
                                       message, job.step, where=Where(job.seq, job.module, job.source)))
        out.notes.append(functools.partial(
            self.summary.collective_row, job.rank, job.name, group, info.seq if info is not None else -1, status,
            finding.kind, message, tuple(getattr(finding, "named", ()) or ()), members=ranks))

    # -- result rows -------------------------------------------------------------------------------------------
    def result(self, job: Job, forward: Outcome, backward: Outcome | None, fwd_job: Job | None = None,
               bwd_job: Job | None = None) -> Checked:
        """The call's result rows (both reports) from its forward and backward outcomes; a failing call's error
        data is saved once they are written."""
        out = Checked(job.rank)
        fwd, bwd = aggregate(forward.statuses), aggregate(backward.statuses) if backward else BLANK
        pfwd, pbwd = aggregate(forward.precision), aggregate(backward.precision) if backward else BLANK
        msg = forward.message or (backward.message if backward else "")
        pmsg = forward.precision_message or (backward.precision_message if backward else "")
        call = fwd_job if fwd_job is not None else job   # the result row is the call's: its forward record's
        where = Where(call.seq, call.module, call.source)
        out.rows += [result_row(job.name, fwd, bwd, msg if SKIP in (fwd, bwd) or ERROR in (fwd, bwd)
                                or WARNING in (fwd, bwd) else "", job.step, where=where),
                     precision_result_row(job.name, pfwd, pbwd, pmsg if pfwd != PASS or pbwd not in (PASS, BLANK)
                                          else "", job.step, where=where)]
        out.notes.append(functools.partial(self.summary.call_done, job.rank, job.name, fwd, bwd, pfwd, pbwd,
                                           pmsg or msg, module=call.module))
        if self.evidence is not None and fwd_job is not None and ERROR in (fwd, bwd, pfwd, pbwd):
            out.notes.append(functools.partial(self._save_evidence, job, fwd_job, bwd_job, pmsg or msg))
        return out

    def _save_evidence(self, job: Job, fwd_job: Job, bwd_job: Job | None, reason: str) -> None:
        folder = self.evidence.save(fwd_job, bwd_job, reason)
        if folder:
            self.summary.evidence_saved(job.rank, job.name, job.step, folder)

    def unfinished(self, key: CallKey, waiting: Waiting, why: str) -> Checked:
        """The result rows of a waiting call that gets no backward check: its backward is SKIP with `why`."""
        fwd = waiting.job   # None once evicted: its seq is still known
        job = Job(run_id=key.run_id, rank=key.rank, step=key.step, seq=fwd.seq if fwd is not None
                  else waiting.record.seq, name=key.name, category="", api="", direction=pb.BACKWARD,
                  module=fwd.module if fwd is not None else "", source=fwd.source if fwd is not None else "")
        return self.result(job, waiting.outcome, Outcome([SKIP], [SKIP], why, why), fwd_job=waiting.job)

    def close(self) -> None:
        self.replayer.close()
