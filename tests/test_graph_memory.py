"""gpu-server --graph-memory-mb end to end: a real server and a real TinyLM training. With a budget too small for any
forward's autograd graphs, every backward replay runs its forward again, and the server says so: summary.json's
memory section counts the backward replays on kept graphs, those that replayed the forward again and the kept
graphs dropped for the budget, and the console summary names the option. The backward rows are checked all the
same (tests/test_fast_paths.py: the same rows with and without kept graphs)."""
from __future__ import annotations

import os

from tests import support
from tests.faulty_kernels import run_trainings
from tests.test_durability import summary_of


def test_a_graph_budget_too_small_replays_each_forward_again_and_says_so(tmp_path):
    work = str(tmp_path)
    with support.Server(work, args=["--graph-memory-mb", "0.001"]) as server:   # about 1 KiB a worker
        config = support.agent_config(os.path.join(work, "agent.json"), server.port)
        run_trainings(config, [["--model", "tinylm", "--dtype", "float32", "--steps", "1"]])
    memory = summary_of(server.out)["memory"]
    assert memory["backward_replays_on_kept_graphs"] == 0, memory
    assert memory["backward_replays_forward_again"] > 0, memory
    assert memory["kept_graphs_dropped_for_memory"] >= memory["backward_replays_forward_again"], memory
    assert "--graph-memory-mb; a larger one keeps them" in server.log()
    rows = support.read_csv(server.out, "accuracy_checking_result")
    backward = [r["Backward Test Success"] for r in rows if r["Backward Test Success"] not in ("", " ")]
    assert backward and set(backward) == {"pass"}, rows
