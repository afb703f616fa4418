"""Checking one job end to end: replay, compare every output, write the report rows (SPEC §5.2, §6, §7).

A forward job gives `.forward.output.i` rows; a backward job gives `.backward.output.i` rows. The result rows
(one per API call, with both Forward and Backward Test Success) are written when the call is complete: at once
when no backward is expected, else when its backward job has been checked (or when the rank ended without one).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch

from gpu_server import error_data, spread, standards
from gpu_server.columns import BLANK
from gpu_server.intake import Job
from gpu_server.replay import ReplayError, flatten_outputs, run_backward, run_forward
from gpu_server.reports import NULL_REPORTS, RankReports
from gpu_server.standards.registry import ERROR, PASS, SKIP, WARNING
from gpu_server.summary import Summary
from gpu_server.verdict import aggregate, compare_output
from protos import online_check_pb2 as pb

log = logging.getLogger("gpu_server")


@dataclasses.dataclass
class Outcome:
    """One direction of one call: statuses of its detail rows and the first message worth showing."""

    statuses: list[str] = dataclasses.field(default_factory=list)
    precision: list[str] = dataclasses.field(default_factory=list)
    message: str = ""
    precision_message: str = ""


class ForwardStore:
    """Forward jobs kept for their backward check, bounded by bytes; the oldest are evicted first."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.held = 0
        self._jobs: dict[tuple, Job] = {}
        self.evicted: set[tuple] = set()

    def put(self, key: tuple, job: Job) -> None:
        self._jobs[key] = job
        self.held += job.nbytes
        while self.held > self.budget and len(self._jobs) > 1:
            old_key = next(iter(self._jobs))
            old = self._jobs.pop(old_key)
            self.held -= old.nbytes
            self.evicted.add(old_key)

    def take(self, key: tuple) -> Job | None:
        job = self._jobs.pop(key, None)
        if job is not None:
            self.held -= job.nbytes
        return job

    def drop_run(self, run_id: str, rank: int) -> None:
        for key in [k for k in self._jobs if k[0] == run_id and k[1] == rank]:
            self.held -= self._jobs.pop(key).nbytes


def _dtype(x: Any) -> str:
    return str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else "()"


class Checker:
    """Owns the report files of the ranks routed to it; called from one worker thread."""

    def __init__(self, out_dir: str, ts: str, device: torch.device, summary: Summary, backward_budget: int,
                 error_data_base: str | None = None):
        self.out_dir = out_dir
        self.error_data_base = error_data_base
        self.ts = ts
        self.device = device
        self.summary = summary
        self.store = ForwardStore(backward_budget)
        self._reports: dict[int, RankReports] = {}
        self._pending: dict[tuple, Outcome] = {}   # (run, rank, step, name) -> forward outcome awaiting backward
        self._lock = threading.Lock()
        self._write_rows = True
        self.match_threads = True     # CPU same-dtype runs take the training's thread count (one CPU worker only)

    def reports(self, rank: int) -> RankReports:
        if not self._write_rows:
            return NULL_REPORTS
        rep = self._reports.get(rank)
        if rep is None:
            rep = self._reports[rank] = RankReports(self.out_dir, self.ts, rank)
            self.summary.add_files(rank, rep.paths)
        return rep

    # -- entry point -----------------------------------------------------------------------------------------
    def check(self, job: Job, write_rows: bool = True) -> None:
        """Check one job. `write_rows=False` (a forward restored from the spool after a restart, whose rows exist
        already) only rebuilds the state its backward check needs."""
        self._write_rows = write_rows
        try:
            self._check(job)
        finally:
            self._write_rows = True

    def awaiting_backward(self, job: Job) -> bool:
        """True while this forward call's result row waits for its backward record."""
        with self._lock:
            return (job.run_id, job.rank, job.step, job.name) in self._pending

    def _check(self, job: Job) -> None:
        try:
            if job.direction == pb.BACKWARD:
                self._check_backward(job)
            else:
                self._check_forward(job)
        except Exception as exc:  # noqa: BLE001 - one bad job must not stop the worker
            log.exception("internal error while checking %s", job.name)
            self._finish(job, Outcome([SKIP], [SKIP], f"internal error while checking: {type(exc).__name__}: {exc}"),
                         None)

    # -- forward -----------------------------------------------------------------------------------------------
    def _check_forward(self, job: Job) -> None:
        rep = self.reports(job.rank)
        key = (job.run_id, job.rank, job.step, job.name)
        if job.skip_reason:
            out = self._skip_rows(rep, job, "forward", job.skip_reason)
            self._finish(job, out, None)
            return
        try:
            bench = run_forward(job, self.device, bench=True)
        except ReplayError as exc:
            out = self._skip_rows(rep, job, "forward", str(exc))
            self._finish(job, out, None)
            return
        try:
            same = run_forward(job, self.device, bench=False, match_threads=self.match_threads)
            same_error = ""
        except ReplayError as exc:
            same, same_error = None, f"same-dtype run failed: {exc}"
        members = (spread.LazyRuns(lambda: spread.forward_members(job, self.device, self.match_threads))
                   if same is not None else None)
        outcome = self._compare(rep, job, "forward", flatten_outputs(job.output), flatten_outputs(bench),
                                flatten_outputs(same) if same is not None else None, same_error, members)
        if job.backward_expected:
            self.store.put(key, job)
            with self._lock:
                self._pending[key] = outcome
        else:
            self._finish(job, outcome, None, fwd_job=job)

    # -- backward ----------------------------------------------------------------------------------------------
    def _check_backward(self, job: Job) -> None:
        rep = self.reports(job.rank)
        key = (job.run_id, job.rank, job.step, job.name)
        with self._lock:
            forward = self._pending.pop(key, None)
        fwd_job = self.store.take(key)
        if forward is None:
            forward = Outcome([SKIP], [SKIP], "forward record of this call was not received")
        if job.skip_reason:
            bwd = self._skip_rows(rep, job, "backward", job.skip_reason)
        elif fwd_job is None:
            why = ("its forward inputs were evicted from the server's backward memory; raise --backward-memory-mb"
                   if key in self.store.evicted else "its forward record was not received")
            bwd = self._skip_rows(rep, job, "backward", f"backward not replayed: {why}")
        elif job.grad_input is None or not flatten_outputs(job.grad_input):
            bwd = Outcome()   # no gradient reached this call's inputs: no backward rows (" ")
        else:
            bwd = self._replay_backward(rep, fwd_job, job)
        self._finish(job, forward, bwd, fwd_job=fwd_job, bwd_job=job)

    def _replay_backward(self, rep: RankReports, fwd: Job, bwd: Job) -> Outcome:
        try:
            bench = run_backward(fwd, bwd, self.device, bench=True)
        except ReplayError as exc:
            return self._skip_rows(rep, bwd, "backward", str(exc))
        try:
            same, same_error = run_backward(fwd, bwd, self.device, bench=False, match_threads=self.match_threads), ""
        except ReplayError as exc:
            same, same_error = None, f"same-dtype run failed: {exc}"
        device = list(bwd.grad_input) if isinstance(bwd.grad_input, (list, tuple)) else [bwd.grad_input]
        keep = [i for i, g in enumerate(device) if g is not None]
        members = (spread.LazyRuns(lambda: [[m[i] for i in keep] for m in spread.backward_members(
            fwd, bwd, self.device, self.match_threads)]) if same is not None else None)
        return self._compare(rep, bwd, "backward", [device[i] for i in keep], [bench[i] for i in keep],
                             [same[i] for i in keep] if same is not None else None, same_error, members)

    # -- comparison rows ---------------------------------------------------------------------------------------
    def _compare(self, rep: RankReports, job: Job, direction: str, device: list, bench: list,
                 same: list | None, same_error: str, members: spread.LazyRuns | None = None) -> Outcome:
        outcome = Outcome()
        if len(bench) != len(device):
            msg = f"bench and device outputs differ in structure: {len(bench)} vs {len(device)} compared values"
            rep.write_detail(f"{job.name}.{direction}.output.0", BLANK, BLANK, BLANK, None, ERROR, msg, job.step)
            rep.write_precision_detail(f"{job.name}.{direction}.output.0", {}, ERROR, BLANK, msg, job.step)
            return Outcome([ERROR], [ERROR], msg, msg)
        for i, (d, b) in enumerate(zip(device, bench)):
            row = f"{job.name}.{direction}.output.{i}"
            b_cpu = b.detach().cpu() if isinstance(b, torch.Tensor) else b
            s = same[i] if same is not None and i < len(same) else None
            s_cpu = s.detach().cpu() if isinstance(s, torch.Tensor) else s
            others = members.output(i) if members is not None else ()   # gpu_server.spread's runs, lazily
            cmp = compare_output(b_cpu, d, spread.with_host(s_cpu, others))
            rep.write_detail(row, _dtype(b), _dtype(d), _shape(d), cmp.metrics, cmp.status, cmp.message, job.step)
            outcome.statuses.append(cmp.status)
            if cmp.status in (ERROR, WARNING) and not outcome.message:
                outcome.message = f"{row}: {cmp.message}"
            verdict = standards.judge(job.api, b_cpu, d, s_cpu, device_metrics=cmp.metrics, spread=others)
            message = "; ".join(m for m in (verdict.message, same_error) if m)
            rep.write_precision_detail(row, verdict.cells, verdict.status, verdict.algorithm, message, job.step)
            if self._write_rows:
                self.summary.standard_row(verdict.algorithm, verdict.status)
            outcome.precision.append(verdict.status)
            if verdict.status == ERROR and not outcome.precision_message:
                outcome.precision_message = f"{row}: {verdict.algorithm} {message}".strip()
        return outcome

    def _skip_rows(self, rep: RankReports, job: Job, direction: str, reason: str) -> Outcome:
        row = f"{job.name}.{direction}.output.0"
        rep.write_detail(row, BLANK, BLANK, BLANK, None, SKIP, reason, job.step)
        rep.write_precision_detail(row, {}, SKIP, BLANK, reason, job.step)
        return Outcome([SKIP], [SKIP], reason, reason)

    # -- result rows -------------------------------------------------------------------------------------------
    def _finish(self, job: Job, forward: Outcome, backward: Outcome | None, fwd_job: Job | None = None,
                bwd_job: Job | None = None) -> None:
        rep = self.reports(job.rank)
        fwd, bwd = aggregate(forward.statuses), aggregate(backward.statuses) if backward else BLANK
        pfwd, pbwd = aggregate(forward.precision), aggregate(backward.precision) if backward else BLANK
        msg = forward.message or (backward.message if backward else "")
        pmsg = forward.precision_message or (backward.precision_message if backward else "")
        rep.write_result(job.name, fwd, bwd, msg if SKIP in (fwd, bwd) or ERROR in (fwd, bwd)
                         or WARNING in (fwd, bwd) else "", job.step)
        rep.write_precision_result(job.name, pfwd, pbwd, pmsg if pfwd != PASS or pbwd not in (PASS, BLANK) else "",
                                   job.step)
        if not self._write_rows:
            return
        self.summary.call_done(job.rank, job.name, fwd, bwd, pfwd, pbwd, pmsg or msg)
        if self.error_data_base and fwd_job is not None and ERROR in (fwd, bwd, pfwd, pbwd):
            try:
                error_data.save(self.error_data_base, self.ts, fwd_job, bwd_job, pmsg or msg)
            except Exception as exc:  # noqa: BLE001 - saving evidence must not stop the checking
                log.warning("could not save the error data of %s: %s", job.name, exc)

    def flush_run(self, run_id: str, rank: int, why: str) -> None:
        """The rank ended (or the server stops): calls still waiting for a backward record get their result row."""
        with self._lock:
            keys = [k for k in self._pending if k[0] == run_id and k[1] == rank] if run_id else list(self._pending)
            calls = [(k, self._pending.pop(k)) for k in keys]
        for (rid, rk, step, name), forward in calls:
            job = Job(run_id=rid, rank=rk, step=step, seq=0, name=name, category="", api="", direction=pb.BACKWARD)
            self._finish(job, forward, Outcome([SKIP], [SKIP], f"backward record never arrived ({why})",
                                                    f"backward record never arrived ({why})"))
        if run_id:
            self.store.drop_run(run_id, rank)

    def close(self) -> None:
        """Close the reports. Calls of ranks that have not ended and still wait for their backward record get no
        result row now: their forward stays in the spool, and a restart with the same --out finishes them."""
        with self._lock:
            waiting = len(self._pending)
        if waiting:
            log.warning("%d calls of ranks that have not ended wait for their backward records; they are kept in the "
                        "spool and finished after a restart with the same --out", waiting)
        for rep in self._reports.values():
            rep.close()
