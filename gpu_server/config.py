"""The benchmark host's config.json: msprobe's run_ut layout, validated key by key (docs/design.md §6.1)."""
from __future__ import annotations

import dataclasses
import os

from protos.config_checks import read_json, unknown_keys, valid_host
from protos.limits import API_NAME


class ServerConfigError(ValueError):
    """The server config is invalid; one line per bad key."""


_RUN_UT_KEYS = {"white_list", "black_list", "error_data_path", "is_online", "nfs_path", "host", "port", "rank_list",
                "tls_path", "precision", "extensions"}
_TOP_KEYS = {"task", "run_ut", "dump_path", "rank", "step", "level", "framework"}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    white_list: frozenset[str] = frozenset()
    black_list: frozenset[str] = frozenset()
    error_data_path: str = "./"
    nfs_path: str = ""
    host: str = "127.0.0.1"
    port: int = 50051
    rank_list: frozenset[int] = frozenset()   # empty = every rank (msprobe's [] checked nothing)
    tls_path: str = ""
    extensions: str = ""   # the extension file (docs/extensions.md); `--extensions` wins

    def wants(self, api: str) -> bool:
        """msprobe's filters on the bare API name; the black list wins."""
        if api in self.black_list:
            return False
        return not self.white_list or api in self.white_list

    def wants_rank(self, rank: int) -> bool:
        return not self.rank_list or rank in self.rank_list

    @property
    def bind_target(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_server_config(raw) -> ServerConfig:
    errors: list[str] = []
    if not isinstance(raw, dict):
        raise ServerConfigError("config: the top level must be a JSON object")
    if raw.get("task", "run_ut") != "run_ut":
        errors.append(f"task: {raw.get('task')!r}; the server's config uses task 'run_ut'")
    ru = raw.get("run_ut")
    if not isinstance(ru, dict):
        raise ServerConfigError("run_ut: missing or not an object; expected {\"task\": \"run_ut\", \"run_ut\": {...}}")
    unknown_keys("run_ut.", ru, _RUN_UT_KEYS, errors)

    def names(key: str) -> frozenset[str]:
        value = ru.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and API_NAME.match(v) for v in value):
            errors.append(f"run_ut.{key}: {value!r}; allowed: a list of bare API names such as ['linear', 'add']")
            return frozenset()
        return frozenset(value)

    white, black = names("white_list"), names("black_list")
    if ru.get("is_online", True) is not True:
        errors.append(f"run_ut.is_online: {ru.get('is_online')!r}; gpu-server is the online check: it must be true")
    error_data_path = ru.get("error_data_path", "./")
    if not isinstance(error_data_path, str):
        errors.append(f"run_ut.error_data_path: {error_data_path!r} is not a string path")
    nfs_path = ru.get("nfs_path", "")
    if not isinstance(nfs_path, str):
        errors.append(f"run_ut.nfs_path: {nfs_path!r} is not a string path")
        nfs_path = ""
    elif nfs_path and not os.path.isdir(nfs_path):
        errors.append(f"run_ut.nfs_path: {nfs_path!r} is not an existing directory")
    host = ru.get("host", "127.0.0.1")
    port = ru.get("port", 50051)
    if not nfs_path:
        if not isinstance(host, str) or not host or not valid_host(host):
            errors.append(f"run_ut.host: {host!r} is not an address or host name to bind (0.0.0.0 or :: for all)")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            errors.append(f"run_ut.port: {port!r} is not an integer port in 1-65535")
    ranks = ru.get("rank_list", [])
    if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                              for r in ranks):
        errors.append(f"run_ut.rank_list: {ranks!r}; allowed: a list of non-negative integers, [] for every rank")
        ranks = []
    tls_path = ru.get("tls_path", "")
    if not isinstance(tls_path, str):
        errors.append(f"run_ut.tls_path: {tls_path!r} is not a string path")
        tls_path = ""
    elif tls_path and not nfs_path:
        if not os.path.isdir(tls_path):
            errors.append(f"run_ut.tls_path: {tls_path!r} is not an existing directory")
        else:
            for name in ("server.key", "server.crt", "ca.crt"):
                if not os.path.isfile(os.path.join(tls_path, name)):
                    errors.append(f"run_ut.tls_path: {tls_path!r} has no {name} (needs server.key, server.crt, ca.crt; "
                                  "crl.pem optional; see certs/README.md)")
    extensions = ru.get("extensions", "")
    if not isinstance(extensions, str):
        errors.append(f"run_ut.extensions: {extensions!r} is not a string path (the extension file, "
                      "docs/extensions.md)")
        extensions = ""
    if errors:
        raise ServerConfigError("invalid server config:\n  " + "\n  ".join(errors))
    return ServerConfig(white_list=white, black_list=black, error_data_path=error_data_path, nfs_path=nfs_path,
                        host=host, port=port, rank_list=frozenset(ranks), tls_path=tls_path if not nfs_path else "",
                        extensions=extensions)


def load_server_config(path: str) -> ServerConfig:
    """The config in `path`; a relative run_ut.extensions is taken in the config file's folder."""
    config = parse_server_config(read_json(path, "--config", ServerConfigError))
    if config.extensions and not os.path.isabs(config.extensions):
        config = dataclasses.replace(config, extensions=os.path.join(os.path.dirname(os.path.abspath(path)),
                                                                     config.extensions))
    return config
