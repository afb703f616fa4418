"""Host names both sides judge the same way: is a host loopback (plaintext there needs no warning)."""
from __future__ import annotations

import ipaddress

__all__ = ["is_loopback", "strip_brackets"]


def strip_brackets(host: str) -> str:
    """``[::1]`` -> ``::1``: the bare address inside an IPv6 literal's brackets (other hosts unchanged, stripped)."""
    host = host.strip()
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """True for 'localhost' (any case) and loopback IP addresses, bracketed IPv6 included; False for anything else,
    names that merely resolve to a loopback address included (no DNS lookup here)."""
    name = strip_brackets(host)
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
