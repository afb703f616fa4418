"""Collectives checked across ranks, end to end (docs/collectives.md): a real 4-rank gloo training
(tests/collective_training.py: tensor-parallel layers calling all_reduce forward and backward, data-parallel averaging
with a sync and an async all_reduce, FSDP-style reduce_scatter_tensor/all_gather_into_tensor, broadcast, all_gather,
reduce, reduce_scatter, all_to_all, all_to_all_single, send/recv and isend/irecv) under the agent, against real
gpu-server processes on loopback.

- A correct run gives no error row on any rank, every collective matched, and the training's process-group calls
  (count and order) are exactly those it makes without the agent.
- The same training checked by 2 servers gives the same rows.
- Faults installed in one rank's process only, inside the collective: a wrong reduction (its contribution scaled by
  1 + 2**-10), a corrupted recv (one bit), a rank calling all_gather where the others call all_reduce (gloo times
  out): each is flagged on that collective only, and the report names the rank.
"""
from __future__ import annotations

import collections
import json
import os

import pytest

from gpu_server.reports import files as report_files
from tests.support import Server, agent_config, free_port, read_csv, run_ranks
from tests.test_durability import counts_of, summary_of

WORLD = 4
STEPS = 2
HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "collective_training.py"), encoding="utf-8") as _fh:
    TRAIN = _fh.read()
COLLECTIVE = report_files.COLLECTIVE


def launch(cfg: str, fault: str = "none", fault_rank: int = 0, gloo_timeout_s: float = 60) -> list:
    port = str(free_port())
    jobs = [([cfg, str(STEPS), fault, str(fault_rank)],
             {"RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "GLOO_TIMEOUT_S": str(gloo_timeout_s)})
            for r in range(WORLD)]
    return run_ranks(TRAIN, jobs, timeout=240)


def printed(proc, key: str):
    line = [x for x in proc.stdout.splitlines() if x.startswith(key + " ")][-1]
    return json.loads(line[len(key) + 1:])


def rows_of(outs: list[str], kind: str = "accuracy_checking_result") -> dict[int, list[dict]]:
    """Every rank's rows of one report kind, over one or more servers' --out folders."""
    got: dict[int, list[dict]] = collections.defaultdict(list)
    for out in outs:
        for rank in range(WORLD):
            got[rank] += read_csv(out, kind, rank)
    return got


def checked(workdir: str, fault: str = "none", fault_rank: int = 0, servers: int = 1,
            gloo_timeout_s: float = 60) -> tuple[list[str], list]:
    """One 4-rank training against `servers` servers (--exit-when-done); (their --out folders, the ranks' processes)."""
    started = [Server(workdir, out=os.path.join(workdir, f"out{i}"),
                      args=("--world-size", str(WORLD)) + (("--exit-when-done",) if servers == 1 else ())).start()
               for i in range(servers)]
    try:
        hosts = [f"127.0.0.1:{s.port}" for s in started]
        cfg = agent_config(os.path.join(workdir, "agent.json"), host=hosts if servers > 1 else "127.0.0.1",
                           port=started[0].port, online_max_retry_s=0.3)
        procs = launch(cfg, fault, fault_rank, gloo_timeout_s)
        for s in started:
            if servers == 1:
                assert s.proc.wait(120) == 0, s.log()[-3000:]   # every rank ended: the server exits by itself
            else:
                assert s.stop() == 0, s.log()[-3000:]
    finally:
        for s in started:
            if s.proc is not None and s.proc.poll() is None:
                s.kill()
    for proc in procs:
        counts = counts_of(proc)
        assert counts["captured"] == counts["acknowledged"] and counts["dropped"] == 0, counts
    return [s.out for s in started], procs


_RANK = {"error": 3, "SKIP": 2, "warning": 1, "pass": 0}


def status_by_call(outs: list[str]) -> dict[tuple[int, str, str], str]:
    """(rank, call, step) -> the worse of its two result rows (accuracy_checking and api_precision_compare)."""
    got: dict[tuple[int, str, str], str] = {}
    for kind, key in (("accuracy_checking_result", "API name"), ("api_precision_compare_result", "API Name")):
        for rank, rs in rows_of(outs, kind).items():
            for r in rs:
                k, status = (rank, r[key], r["Step"]), r["Forward Test Success"]
                if _RANK.get(status, 0) >= _RANK.get(got.get(k, "pass"), 0):
                    got[k] = status
    return got


@pytest.fixture(scope="module")
def correct(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("correct"))
    return checked(work)


def test_a_correct_training_gives_no_error_and_every_collective_matches(correct, tmp_path):
    outs, procs = correct
    results = rows_of(outs)
    statuses = status_by_call(outs)
    errors = {k: v for k, v in statuses.items() if v == "error"}
    assert not errors, {k: v for k, v in list(errors.items())[:10]}
    bad = {k: v for k, v in statuses.items() if k[1].startswith("Distributed.") and v not in ("pass", "warning")}
    # a send (and a reduce's non-root rank) has nothing of its own to compare: its tensor is the reference of the
    # matching recv, judged on the receiving rank
    nothing = {k for k, v in bad.items() if v == "SKIP" and k[1].rsplit(".", 2)[1] in ("send", "isend", "reduce")}
    assert nothing, "no send got its SKIP row"
    bad = {k: v for k, v in bad.items() if k not in nothing}
    assert not bad, {k: v for k, v in list(bad.items())[:10]}
    apis = {name.rsplit(".", 1)[0] for (_, name, _) in statuses}
    for api in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv"):
        assert f"Distributed.{api}" in apis, (api, sorted(apis))
    # the broadcast into torch.zeros: zeros is reported with its own value, whatever the broadcast wrote after it
    for rank in range(1, WORLD):   # rank 0 is the broadcast's source
        zeros = [r for r in results[rank] if r["API name"].startswith("Torch.zeros.")]
        assert zeros and all(r["Forward Test Success"] == "pass" for r in zeros), (rank, zeros)
    collective = rows_of(outs, COLLECTIVE)
    for rank in range(WORLD):
        assert collective[rank], f"rank {rank} has no collective rows"
        assert {r["Finding"] for r in collective[rank]} == {"matched"}, collective[rank][:3]
        six = [r for r in collective[rank] if r["API Name"].startswith("Distributed.all_reduce.") and r["Step"] == "0"]
        assert len(six) == 6, six   # TP forward, TP backward, 3 sync gradient averages, 1 async
    summary = summary_of(outs[0])
    assert summary["collectives"], summary.keys()
    # checking added no process-group call and reordered none: the same calls as without the agent
    plain = launch(agent_config(str(tmp_path / "off.json"), online_run_ut=False))
    for rank, (with_agent, without) in enumerate(zip(procs, plain)):
        assert printed(with_agent, "CALLS") == printed(without, "CALLS"), rank


def test_two_servers_give_the_same_rows(correct, tmp_path):
    outs, _ = correct
    two, _ = checked(str(tmp_path), servers=2)
    one_rows, two_rows = rows_of(outs), rows_of(two)
    assert status_by_call(outs) == status_by_call(two)
    for rank in range(WORLD):
        names_one = sorted((r["API name"], r["Step"], r["Forward Test Success"]) for r in one_rows[rank])
        names_two = sorted((r["API name"], r["Step"], r["Forward Test Success"]) for r in two_rows[rank])
        assert names_one == names_two, rank
    coll_one, coll_two = rows_of(outs, COLLECTIVE), rows_of(two, COLLECTIVE)
    for rank in range(WORLD):
        key = lambda r: (r["API Name"], r["Step"], r["Group Seq"], r["Finding"])  # noqa: E731
        assert sorted(map(key, coll_one[rank])) == sorted(map(key, coll_two[rank])), rank


def _not_pass(outs: list[str]) -> dict[tuple[int, str, str], str]:
    """Rows that are neither pass nor warning, leaving out the SKIPs a correct run has too."""
    return {k: v for k, v in status_by_call(outs).items() if v == "error"
            or (k[1].startswith("Distributed.") and v not in ("pass", "warning")
                and not (v == "SKIP" and k[1].rsplit(".", 2)[1] in ("send", "isend", "reduce")))}


def test_a_wrong_reduction_on_one_rank_is_flagged_on_all_reduce_naming_that_rank(tmp_path):
    outs, _ = checked(str(tmp_path), fault="reduction", fault_rank=2)
    bad = _not_pass(outs)
    assert bad and all(name.startswith("Distributed.all_reduce.") for (_, name, _) in bad), bad
    assert all(v == "error" for v in bad.values()), bad
    assert {rank for (rank, _, _) in bad} == set(range(WORLD))   # every rank received the wrong sum
    flagged = [r for rs in rows_of(outs, COLLECTIVE).values() for r in rs if r["Status"] == "error"]
    assert len(flagged) == len(bad), (len(flagged), len(bad))
    named = [r for r in flagged if "contribution looks wrong" in r["Message"]]
    # every collective whose ranks sent different inputs names rank 2; the gradients of the layer before the
    # tensor-parallel region are equal on every rank (its backward all_reduce made them so): those cannot name one
    assert named and all("rank 2's contribution looks wrong" in r["Message"] for r in named), named[:3]
    tied = [r for r in flagged if r not in named]
    assert all("cannot be told from this collective" in r["Message"] for r in tied), tied[:3]
    names = {r["API Name"] for r in named}
    assert {"Distributed.all_reduce.0", "Distributed.all_reduce.1", "Distributed.all_reduce.4"} <= names, names


def test_a_corrupted_recv_is_flagged_on_that_recv_only(tmp_path):
    outs, _ = checked(str(tmp_path), fault="recv", fault_rank=1)
    bad = _not_pass(outs)
    assert bad, "the flipped bit was not found"
    assert {rank for (rank, _, _) in bad} == {1}, bad
    assert {name.rsplit(".", 1)[0] for (_, name, _) in bad} == {"Distributed.recv", "Distributed.irecv"}, bad
    flagged = [r for r in rows_of(outs, COLLECTIVE)[1] if r["Status"] == "error"]
    assert flagged and all("rank 1" in r["Message"] or "element" in r["Message"] for r in flagged), flagged


def test_a_rank_calling_another_collective_is_named_as_the_mismatch(tmp_path):
    outs, procs = checked(str(tmp_path), fault="mismatch", fault_rank=3, gloo_timeout_s=12)
    assert all(printed(p, "FAILED") for p in procs), "gloo did not time out: the test proves nothing"
    collective = rows_of(outs, COLLECTIVE)
    mismatches = [r for rs in collective.values() for r in rs if r["Finding"] == "mismatch"]
    assert len(mismatches) == WORLD, mismatches
    for r in mismatches:
        assert "rank 3" in r["Message"] and "all_gather" in r["Message"] and "all_reduce" in r["Message"], r
    summary = json.dumps(summary_of(outs[0])["collectives"])
    assert "mismatch" in summary and "rank 3" in summary
