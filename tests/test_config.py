"""Config validation (issue 2): every bad key gets its own message naming the key, the value and what is allowed."""
import json

import pytest

from gpu_server.config import ServerConfigError, parse_server_config
from npu_agent import ConfigError, PrecisionDebugger
from npu_agent.config import parse_config

GOOD = {"task": "tensor", "dump_path": "./dump", "level": "L1", "rank": [], "step": [],
        "tensor": {"scope": [], "list": [], "online_run_ut": True, "nfs_path": "", "host": "127.0.0.1",
                   "port": 50051, "tls_path": "", "online_run_ut_recompute": False}}


def _with(**changes):
    cfg = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        section, _, name = key.rpartition("__")
        (cfg[section] if section else cfg)[name] = value
    return cfg


@pytest.mark.parametrize("key,value,expect", [
    ("task", "statistics", "task: 'statistics'"),
    ("level", "L0", "level: 'L0'"),
    ("rank", [0, -1], "rank: entry -1"),
    ("rank", "0", "rank: '0' is not a list"),
    ("step", ["3-1"], "step: entry '3-1'"),
    ("tensor__scope", ["Functional.linear.0"], "tensor.scope"),
    ("tensor__list", [1], "tensor.list"),
    ("tensor__online_run_ut", "yes", "tensor.online_run_ut: 'yes' is not true or false"),
    ("tensor__online_run_ut_recompute", 1, "tensor.online_run_ut_recompute: 1"),
    ("tensor__host", "bad host!", "tensor.host: 'bad host!'"),
    ("tensor__host", ["10.0.0.1"], "tensor.host: entry '10.0.0.1' is not 'host:port'"),
    ("tensor__port", 70000, "tensor.port: 70000"),
    ("tensor__port", "50051", "tensor.port: '50051'"),
    ("tensor__tls_path", "/nonexistent/tls", "tensor.tls_path: '/nonexistent/tls' is not an existing directory"),
    ("tensor__nfs_path", "/nonexistent/nfs", "tensor.nfs_path: '/nonexistent/nfs' is not an existing directory"),
    ("tensor__online_policy", "wait", "tensor.online_policy: 'wait'"),
    ("tensor__online_memory_mb", -5, "tensor.online_memory_mb: -5"),
    ("tensor__online_run_utt", True, "tensor.online_run_utt: unknown key; did you mean 'online_run_ut'?"),
    ("tensor__online_sample_steps", 0, "tensor.online_sample_steps: 0 is not an integer >= 1"),
    ("tensor__online_sample_steps", 2.5, "tensor.online_sample_steps: 2.5 is not an integer >= 1"),
    ("tensor__online_sample_ranks", True, "tensor.online_sample_ranks: True is not an integer >= 1"),
    ("tensor__online_coverage_steps", -1, "tensor.online_coverage_steps: -1 is not an integer >= 0"),
    ("tensor__online_overhead_budget", 1.5, "tensor.online_overhead_budget: 1.5 is not a number in [0, 1]"),
    ("tensor__online_overhead_budget", "5%", "tensor.online_overhead_budget: '5%' is not a number in [0, 1]"),
    ("tensor__online_keep_freed_memory", "no", "tensor.online_keep_freed_memory: 'no' is not true or false"),
])
def test_each_bad_agent_key_has_its_own_message(key, value, expect):
    with pytest.raises(ConfigError) as info:
        parse_config(_with(**{key: value}))
    text = str(info.value)
    assert expect in text
    assert len(text.splitlines()) == 2, text  # the title line and exactly one problem


def test_several_bad_keys_are_all_reported_at_once():
    with pytest.raises(ConfigError) as info:
        parse_config(_with(tensor__port=0, level="mix", tensor__online_policy="x"))
    assert len(str(info.value).splitlines()) == 4


def test_good_config_parses_with_defaults_and_endpoint_lists():
    cfg = parse_config(_with(tensor__host=["10.0.0.1:5000", "[::1]:6000"], rank=[0, "2-3"], step=[1]))
    assert cfg.ranks == {0, 2, 3} and cfg.steps == {1}
    assert cfg.endpoint_for(0).target == "10.0.0.1:5000" and cfg.endpoint_for(3).target == "[::1]:6000"
    assert cfg.policy == "block" and cfg.memory_bytes == 1 << 30
    assert parse_config(_with(tensor__host="::1")).endpoint_for(0).target == "[::1]:50051"
    assert (cfg.sample_steps, cfg.sample_ranks, cfg.coverage_steps, cfg.overhead_budget) == (1, 1, 0, 0.0)
    cfg = parse_config(_with(tensor__online_sample_steps=4, tensor__online_sample_ranks=8,
                             tensor__online_coverage_steps=10, tensor__online_overhead_budget=0.05))
    assert (cfg.sample_steps, cfg.sample_ranks, cfg.coverage_steps, cfg.overhead_budget) == (4, 8, 10, 0.05)
    assert parse_config(GOOD).keep_freed_memory
    assert not parse_config(_with(tensor__online_keep_freed_memory=False)).keep_freed_memory


def test_debugger_rejects_a_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="is not a readable file"):
        PrecisionDebugger(config_path=str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        PrecisionDebugger(config_path=str(bad))


SERVER = {"task": "run_ut", "run_ut": {"white_list": [], "black_list": [], "error_data_path": "./",
                                       "is_online": True, "nfs_path": "", "host": "127.0.0.1", "port": 50051,
                                       "rank_list": [], "tls_path": ""}}


@pytest.mark.parametrize("key,value,expect", [
    ("white_list", ["lin ear"], "run_ut.white_list"),
    ("black_list", "relu", "run_ut.black_list"),
    ("is_online", False, "run_ut.is_online: False"),
    ("host", "", "run_ut.host: ''"),
    ("port", 0, "run_ut.port: 0"),
    ("rank_list", [-1], "run_ut.rank_list: [-1]"),
    ("tls_path", "/nonexistent", "run_ut.tls_path: '/nonexistent' is not an existing directory"),
    ("nfs_path", "/nonexistent", "run_ut.nfs_path: '/nonexistent' is not an existing directory"),
    ("hosts", "x", "run_ut.hosts: unknown key; did you mean 'host'?"),
])
def test_each_bad_server_key_has_its_own_message(key, value, expect):
    cfg = json.loads(json.dumps(SERVER))
    cfg["run_ut"][key] = value
    with pytest.raises(ServerConfigError) as info:
        parse_server_config(cfg)
    assert expect in str(info.value)
    assert len(str(info.value).splitlines()) == 2, str(info.value)


def test_server_rank_list_empty_means_every_rank():
    cfg = parse_server_config(SERVER)
    assert cfg.wants_rank(0) and cfg.wants_rank(17)
