"""protos/config_checks.py: the one toolkit both config loaders use, so both sides accept the same hosts."""
import pytest

from gpu_server.config import ServerConfigError, parse_server_config
from npu_agent.config import ConfigError, parse_config
from protos.config_checks import read_json, unknown_keys, valid_host

GOOD = ["127.0.0.1", "::1", "[::1]", "10.0.0.5", "bench-01", "gpu.example.org", "a" * 63, "x1.y2.z3"]
BAD = ["", " 127.0.0.1", "host name", "-lead", "trail-", "a" * 64, "bad_underscore", "emoji\u00e9", "host\n",
       "a..b", "[::1", "x" * 254]


@pytest.mark.parametrize("host", GOOD)
def test_both_sides_accept_the_same_hosts(host):
    assert valid_host(host)
    server = {"task": "run_ut", "run_ut": {"host": host, "port": 5000}}
    assert parse_server_config(server).host == host
    agent = {"task": "tensor", "tensor": {"online_run_ut": True, "host": host, "port": 5000}}
    assert parse_config(agent).endpoints[0].host == host


@pytest.mark.parametrize("host", BAD)
def test_both_sides_refuse_the_same_hosts(host):
    assert not valid_host(host)
    with pytest.raises(ServerConfigError, match="run_ut.host"):
        parse_server_config({"task": "run_ut", "run_ut": {"host": host, "port": 5000}})
    with pytest.raises(ConfigError, match="tensor.host"):
        parse_config({"task": "tensor", "tensor": {"online_run_ut": True, "host": host, "port": 5000}})


def test_unknown_keys_name_the_closest_key():
    errors: list[str] = []
    unknown_keys("run_ut.", ["hots", "zzz", "port"], {"host", "port"}, errors)
    assert errors == ["run_ut.hots: unknown key; did you mean 'host'?", "run_ut.zzz: unknown key; allowed: host, port"]


def test_read_json_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match="--config: .* is not a readable file"):
        read_json(str(tmp_path / "missing.json"), "--config", ValueError)
    bad = tmp_path / "bad.json"
    bad.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="is not valid JSON"):
        read_json(str(bad), "--config", ValueError)
    good = tmp_path / "good.json"
    good.write_text('{"a": 1}', encoding="utf-8")
    assert read_json(str(good), "--config", ValueError) == {"a": 1}
