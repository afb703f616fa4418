"""The small toolkit both config loaders use (npu_agent/config.py, gpu_server/config.py), so that the training side
and the server accept the same hosts and word their messages the same way (docs/design.md §3).

Every check appends a message to `errors` that names the key, the value and what is allowed; the loaders report all
of them at once.
"""
from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
from typing import Any, Iterable

_HOSTNAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z", re.ASCII)


def valid_host(host: str) -> bool:
    """An IPv4 or IPv6 address (brackets allowed around IPv6), or an RFC 1123 host name."""
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
        return True
    except ValueError:
        return bool(_HOSTNAME.fullmatch(host))


def unknown_keys(section: str, keys: Iterable[str], known: Iterable[str], errors: list[str]) -> None:
    """One message per key that is not in `known`, with the closest known key as a hint."""
    allowed = sorted(known)
    for key in keys:
        if key not in allowed:
            hint = difflib.get_close_matches(key, allowed, n=1)
            errors.append(f"{section}{key}: unknown key" + (f"; did you mean {hint[0]!r}?" if hint else
                                                             f"; allowed: {', '.join(allowed)}"))


def read_json(path: Any, label: str, error: type[Exception]) -> Any:
    """The parsed JSON of the file at `path`, or `error` naming `label` and what is wrong with it."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise error(f"{label}: {path!r} is not a readable file")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise error(f"{label}: {path} is not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{label}: {path} cannot be read: {exc}") from None
