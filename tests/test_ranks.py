"""Many ranks (docs/design.md §3, §6.1): a 4-rank torch.distributed gloo job on the CPU, every rank streaming at once,
against
one server and spread over two (`tensor.host` as a list of endpoints); the agent's `rank` and the server's `rank_list`
filters. Real server subprocesses, real gRPC, four real training processes."""
from __future__ import annotations

import glob
import json
import os

from tests.support import Server, agent_config, free_port, run_ranks
from tests.test_durability import TRAIN, check_exactly_once, counts_of

WORLD = 4
STEPS = 2


def _launch(cfg: str) -> dict[int, dict]:
    """The 4-rank gloo job (one process per rank, MASTER_ADDR/PORT rendezvous); returns each rank's counts."""
    port = str(free_port())
    jobs = [([cfg, str(STEPS), "0.0", "1", "32"],
             {"RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}) for r in range(WORLD)]
    return dict(enumerate(counts_of(proc) for proc in run_ranks(TRAIN, jobs, timeout=150)))


def _ranks_with_files(out: str) -> set[int]:
    return {int(p.rsplit("_rank", 1)[1][:-4]) for p in glob.glob(os.path.join(out, "accuracy_checking_result_*.csv"))}


def _check_rank(out: str, rank: int, counts: dict) -> int:
    assert counts["captured"] == counts["acknowledged"] and counts["dropped"] == 0, (rank, counts)
    per_step = check_exactly_once(out, rank, STEPS)
    assert any(n.startswith("Distributed.all_reduce.") for n in per_step[0]), per_step[0]
    return sum(map(len, per_step.values()))


def test_four_gloo_ranks_against_one_server(tmp_path):
    work = str(tmp_path)
    with Server(work, args=("--world-size", str(WORLD), "--exit-when-done")) as server:
        cfg = agent_config(os.path.join(work, "agent.json"), server.port, online_max_retry_s=0.3)
        counts = _launch(cfg)
        assert server.proc.wait(60) == 0     # every rank ended: the server exits by itself
    assert _ranks_with_files(server.out) == set(range(WORLD))
    calls = {r: _check_rank(server.out, r, counts[r]) for r in range(WORLD)}
    with open(glob.glob(os.path.join(server.out, "summary_*.json"))[0]) as fh:
        summary = json.load(fh)
    assert sorted(e["rank"] for e in summary["ranks_ended"]) == list(range(WORLD))
    print(f"\n4 ranks, one server: captured {[counts[r]['captured'] for r in range(WORLD)]}, acknowledged "
          f"{[counts[r]['acknowledged'] for r in range(WORLD)]}, reported calls {[calls[r] for r in range(WORLD)]}")


def test_four_gloo_ranks_spread_over_two_servers_with_rank_filters(tmp_path):
    work = str(tmp_path)
    # Agent: ranks 0-2 capture (rank 3 does not). Server A checks rank 0 only (rank 2 reaches it and is filtered).
    with Server(work, out=os.path.join(work, "a"), rank_list=[0]) as a, Server(work, out=os.path.join(work, "b")) as b:
        cfg = agent_config(os.path.join(work, "agent.json"), host=[f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"],
                           online_max_retry_s=0.3)
        with open(cfg) as fh:
            raw = json.load(fh)
        raw["rank"] = [0, 1, 2]
        with open(cfg, "w") as fh:
            json.dump(raw, fh)
        counts = _launch(cfg)
    assert _ranks_with_files(a.out) == {0}           # ranks 0 and 2 go to A (rank % 2 == 0); A keeps rank 0
    assert _ranks_with_files(b.out) == {1}           # ranks 1 and 3 go to B; rank 3 does not capture
    _check_rank(a.out, 0, counts[0])
    _check_rank(b.out, 1, counts[1])
    assert counts[2]["acknowledged"] == counts[2]["captured"] > 0    # accepted by A and filtered there
    assert counts[3] == {"loop_s": counts[3]["loop_s"]}              # rank 3 never started capturing
    assert "rank 2" in a.log() and "rank 1" not in a.log() and "rank 1" in b.log()
