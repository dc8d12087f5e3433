"""Network helpers shared by every part that binds a port: one `free_port`, one `node_address`."""

from __future__ import annotations

import socket
import sys

LOOPBACK = "127.0.0.1"

# proxy settings of the environment (either case): slime's servers (engines, adapters, the router)
# are the run's own, on its nodes, and are never reached through a proxy
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy")


def without_proxies(environ: dict[str, str]) -> dict[str, str]:
    """`environ` without its proxy settings, for a process that talks only to the run's servers."""
    return {k: v for k, v in environ.items() if k.lower() not in PROXY_VARIABLES}


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on `host` right now (the OS picks it; the caller binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_socket(host: str, backlog: int = 128) -> socket.socket:
    """A socket listening on `host` at a port the OS picks: hand its file descriptor to the server
    that uses it (no window in which another process could take the port)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(backlog)
    return s


def node_address() -> str:
    """The address this process binds and hands out: its Ray node's IP inside a Ray process (a
    local run's Ray node is 127.0.0.1; on a cluster, the node's own address), loopback elsewhere
    (a process that has not started or joined Ray, such as an engine server)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return LOOPBACK


def cluster_addresses() -> list[str]:
    """The addresses of the alive nodes of this process's Ray cluster ([node_address()] outside Ray)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
    return [node_address()]
