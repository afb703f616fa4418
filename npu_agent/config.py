"""The training side's config.json: msprobe's layout, validated key by key (docs/design.md §3).

Every bad value is named with the key, the value and what is allowed; all problems are reported at once.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any

from protos.config_checks import read_json, unknown_keys, valid_host
from protos.net import is_loopback

log = logging.getLogger("npu_agent")

POLICIES = ("block", "drop")

# msprobe keys that mean nothing to the online check but appear in users' configs: accepted and ignored.
_MSPROBE_TOP_KEYS = {"task", "dump_path", "rank", "step", "level", "enable_dataloader", "async_dump", "framework",
                     "is_deterministic", "acl_config", "seed", "statistics", "tensor", "overflow_check",
                     "free_benchmark", "run_ut", "grad_probe", "structure", "exception_dump"}
_MSPROBE_TENSOR_KEYS = {"scope", "list", "data_mode", "file_format", "summary_mode", "backward_input", "bench_path",
                        "online_run_ut", "nfs_path", "host", "port", "tls_path", "online_run_ut_recompute"}
# Our own keys (all optional): see README "Agent keys".
_OWN_TENSOR_KEYS = {"online_memory_mb", "online_policy", "online_close_timeout_s", "online_connect_timeout_s",
                    "online_max_retry_s", "online_sample_steps", "online_sample_ranks", "online_coverage_steps",
                    "online_overhead_budget", "online_keep_freed_memory"}


class ConfigError(ValueError):
    """config.json is invalid. The message has one line per bad key."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def target(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.host)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    dump_path: str = "./dump"
    ranks: frozenset[int] = frozenset()      # empty = all
    steps: frozenset[int] = frozenset()      # empty = all
    scope: tuple[str, ...] = ()              # () or (first, last)
    api_list: tuple[str, ...] = ()
    online_run_ut: bool = False
    nfs_path: str = ""
    endpoints: tuple[Endpoint, ...] = ()
    tls_path: str = ""
    recompute: bool = False
    memory_bytes: int = 1 << 30
    policy: str = "block"
    close_timeout_s: float = 600.0
    connect_timeout_s: float = 30.0
    max_retry_s: float = 10.0
    sample_steps: int = 1                    # sampling policies (npu_agent.sampling)
    sample_ranks: int = 1
    coverage_steps: int = 0
    overhead_budget: float = 0.0
    keep_freed_memory: bool = True           # npu_agent.freed_memory

    def endpoint_for(self, rank: int) -> Endpoint:
        """Each rank always talks to the same server: ranks are spread over the endpoints round-robin."""
        return self.endpoints[rank % len(self.endpoints)]

    def server_index_for_collective(self, ranks: tuple[int, ...]) -> int | None:
        """A collective's records must all reach one server: the one of its lowest member rank (p2p: of the lower of
        source and destination). None when there is nothing to route (the folder, or a single server)."""
        if self.nfs_path or len(self.endpoints) < 2 or not ranks:
            return None
        return min(ranks) % len(self.endpoints)


_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def _numbers(key: str, value: Any, errors: list[str]) -> frozenset[int]:
    allowed = "a list of non-negative integers or 'a-b' ranges, [] for all"
    if not isinstance(value, list):
        errors.append(f"{key}: {value!r} is not a list; allowed: {allowed}")
        return frozenset()
    out: set[int] = set()
    for item in value:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            out.add(item)
            continue
        m = _RANGE.match(item) if isinstance(item, str) else None
        if m and int(m.group(1)) <= int(m.group(2)):
            out.update(range(int(m.group(1)), int(m.group(2)) + 1))
            continue
        errors.append(f"{key}: entry {item!r} is invalid; allowed: {allowed}")
    return frozenset(out)


def _endpoints(host: Any, port: Any, errors: list[str]) -> tuple[Endpoint, ...]:
    """`host` is a name / IPv4 / IPv6 with `port`, or a list of "host:port" endpoints."""
    if isinstance(host, list):
        if not host:
            errors.append("tensor.host: [] names no server; give a host name or address, or a list of 'host:port'")
        eps = []
        for item in host:
            m = re.match(r"^\[?([^\[\]]+?)\]?:(\d{1,5})$", item) if isinstance(item, str) else None
            if not m or not valid_host(m.group(1)) or not 0 < int(m.group(2)) <= 65535:
                errors.append(f"tensor.host: entry {item!r} is not 'host:port' (IPv6 as '[addr]:port', port 1-65535)")
                continue
            eps.append(Endpoint(m.group(1), int(m.group(2))))
        return tuple(eps)
    ok = True
    if not isinstance(host, str) or not host or not valid_host(host):
        errors.append(f"tensor.host: {host!r} is not a host name, IPv4 or IPv6 address (or a list of 'host:port')")
        ok = False
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
        errors.append(f"tensor.port: {port!r} is not an integer port in 1-65535")
        ok = False
    return (Endpoint(host, port),) if ok else ()


def _check_dir(key: str, path: Any, errors: list[str], files: tuple[str, ...] = (), writable: bool = False) -> str:
    if not isinstance(path, str):
        errors.append(f"{key}: {path!r} is not a string path")
        return ""
    if not path:
        return ""
    if not os.path.isdir(path):
        errors.append(f"{key}: {path!r} is not an existing directory")
        return path
    if writable and not os.access(path, os.W_OK):
        errors.append(f"{key}: directory {path!r} is not writable by this process")
    for name in files:
        if not os.path.isfile(os.path.join(path, name)):
            errors.append(f"{key}: {path!r} has no {name} (needs {', '.join(files)}; crl.pem optional)")
    return path


def _bool(key: str, value: Any, errors: list[str]) -> bool:
    if not isinstance(value, bool):
        errors.append(f"{key}: {value!r} is not true or false")
        return False
    return value


def _positive(key: str, value: Any, errors: list[str], default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        errors.append(f"{key}: {value!r} is not a positive number")
        return default
    return float(value)


def _int_at_least(key: str, value: Any, errors: list[str], default: int, least: int, meaning: str) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        errors.append(f"{key}: {value!r} is not an integer >= {least}; {meaning}")
        return default
    return value


def _fraction(key: str, value: Any, errors: list[str]) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        errors.append(f"{key}: {value!r} is not a number in [0, 1]; it is the most the checker may add to the "
                      "step time, as a fraction (0.05 = 5 %; 0 = no budget)")
        return 0.0
    return float(value)


def parse_config(raw: dict[str, Any]) -> AgentConfig:
    errors: list[str] = []
    if not isinstance(raw, dict):
        raise ConfigError(f"config: the top level must be a JSON object, not {type(raw).__name__}")
    for key in raw:
        if key not in _MSPROBE_TOP_KEYS:
            log.warning("config key %r is not an msprobe key and is ignored", key)
    if raw.get("task", "tensor") != "tensor":
        errors.append(f"task: {raw.get('task')!r}; the online check runs under task 'tensor'")
    if raw.get("level", "L1") != "L1":
        errors.append(f"level: {raw.get('level')!r}; the online check captures API calls: level must be 'L1'")
    dump_path = raw.get("dump_path", "./dump")
    if not isinstance(dump_path, str):
        errors.append(f"dump_path: {dump_path!r} is not a string path")
    ranks = _numbers("rank", raw.get("rank", []), errors)
    steps = _numbers("step", raw.get("step", []), errors)
    tensor = raw.get("tensor", {})
    if not isinstance(tensor, dict):
        errors.append(f"tensor: {type(tensor).__name__} is not an object with the online keys")
        tensor = {}
    unknown_keys("tensor.", tensor, _MSPROBE_TENSOR_KEYS | _OWN_TENSOR_KEYS, errors)

    scope = tensor.get("scope", [])
    if not (isinstance(scope, list) and len(scope) in (0, 2) and all(isinstance(s, str) and s for s in scope)):
        errors.append(f"tensor.scope: {scope!r}; allowed: [] or [first, last] full API names "
                      "such as ['Functional.linear.0', 'Tensor.add.3']")
        scope = []
    api_list = tensor.get("list", [])
    if not (isinstance(api_list, list) and all(isinstance(s, str) and s for s in api_list)):
        errors.append(f"tensor.list: {api_list!r}; allowed: a list of API names ('linear', 'Functional.linear', "
                      "'Functional.linear.0')")
        api_list = []
    online = _bool("tensor.online_run_ut", tensor.get("online_run_ut", False), errors)
    recompute = _bool("tensor.online_run_ut_recompute", tensor.get("online_run_ut_recompute", False), errors)
    nfs_path = tensor.get("nfs_path", "")
    endpoints: tuple[Endpoint, ...] = ()
    tls_path = ""
    if online and nfs_path:
        nfs_path = _check_dir("tensor.nfs_path", nfs_path, errors, writable=True)
    elif not isinstance(nfs_path, str):
        errors.append(f"tensor.nfs_path: {nfs_path!r} is not a string path")
    elif online:
        endpoints = _endpoints(tensor.get("host", "127.0.0.1"), tensor.get("port", 50051), errors)
        tls_path = _check_dir("tensor.tls_path", tensor.get("tls_path", ""), errors,
                              files=("client.key", "client.crt", "ca.crt"))
    policy = tensor.get("online_policy", "block")
    if policy not in POLICIES:
        errors.append(f"tensor.online_policy: {policy!r}; allowed: 'block' (wait, lose nothing) or 'drop' "
                      "(drop the newest record and count it)")
        policy = "block"
    memory_mb = _positive("tensor.online_memory_mb", tensor.get("online_memory_mb"), errors, 1024)
    close_s = _positive("tensor.online_close_timeout_s", tensor.get("online_close_timeout_s"), errors, 600.0)
    connect_s = _positive("tensor.online_connect_timeout_s", tensor.get("online_connect_timeout_s"), errors, 30.0)
    retry_s = _positive("tensor.online_max_retry_s", tensor.get("online_max_retry_s"), errors, 10.0)
    sample_steps = _int_at_least("tensor.online_sample_steps", tensor.get("online_sample_steps"), errors, 1, 1,
                                 "capture every Nth step (1 = every step)")
    sample_ranks = _int_at_least("tensor.online_sample_ranks", tensor.get("online_sample_ranks"), errors, 1, 1,
                                 "ranks take sampled steps in turn, 1/M of them at a time (1 = all ranks)")
    coverage = _int_at_least("tensor.online_coverage_steps", tensor.get("online_coverage_steps"), errors, 0, 0,
                             "each call site is captured once every K steps, repeats skipped (0 = off)")
    budget = _fraction("tensor.online_overhead_budget", tensor.get("online_overhead_budget"), errors)
    keep_freed = _bool("tensor.online_keep_freed_memory", tensor.get("online_keep_freed_memory", True), errors)
    if errors:
        raise ConfigError("invalid config.json:\n  " + "\n  ".join(errors))
    return AgentConfig(
        dump_path=dump_path, ranks=ranks, steps=steps, scope=tuple(scope), api_list=tuple(api_list),
        online_run_ut=online, nfs_path=nfs_path if online else "", endpoints=endpoints, tls_path=tls_path,
        recompute=recompute, memory_bytes=int(memory_mb * (1 << 20)), policy=policy,
        close_timeout_s=close_s, connect_timeout_s=connect_s, max_retry_s=retry_s,
        sample_steps=sample_steps, sample_ranks=sample_ranks, coverage_steps=coverage, overhead_budget=budget,
        keep_freed_memory=keep_freed,
    )


def load_config(path: str) -> AgentConfig:
    return parse_config(read_json(path, "config_path", ConfigError))
