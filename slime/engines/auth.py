"""Who may talk to the servers slime starts (docs/security.md).

Every engine server of a run (the native engine, the vLLM adapter; SGLang and sglang-router with
their own `--api-key`) shares one per-run secret, `--engine-api-key` (generated when not given).
slime hands it to its processes in `SLIME_ENGINE_API_KEY` (never on a command line of its own
servers), its clients send it as `Authorization: Bearer <key>`, and custom code finds it as
`context().api_key`.

`guard(...)` is the aiohttp middleware of slime's own servers. It refuses, before any handler runs:
- a request without the key (401), except `GET /health`;
- a `Host` header that is not the server's own address (403: DNS rebinding);
- any `Origin` header but the server's own (403: a web page's request);
- a body whose `Content-Type` is not `application/json` (or `application/octet-stream`, which only
  the tensor weight route reads): the types a web page can send without asking (text/plain,
  forms) are 415.

Two routes also check what they are told to touch: `/update_weights_from_disk` loads only from
under the run's weight directories (`check_weight_path`), and `/init_weights_update_group` joins a
group only at an address of the run's cluster (`check_master_address`).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from slime.engines.protocol import ProtocolError
from slime.utils.run_dirs import shm_or_tmp

API_KEY_ENV = "SLIME_ENGINE_API_KEY"
OPEN_PATHS = frozenset({"/health"})
BODY_TYPES = frozenset({"application/json", "application/octet-stream"})


def env_api_key() -> str | None:
    """The run's engine key as slime's processes receive it (None outside a run)."""
    return os.environ.get(API_KEY_ENV) or None


def bearer(api_key: str | None) -> dict[str, str]:
    """The request header that carries `api_key` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def run_weights_dir(api_key: str) -> str:
    """The run's own directory for `--update-weights-mode disk` buckets, in /dev/shm when it is
    writable (Linux), else the temp dir: its name derives from the run's secret, so no other user
    can create it first."""
    return os.path.join(shm_or_tmp(), "slime-weights-" + hashlib.sha256(api_key.encode()).hexdigest()[:20])


def run_weight_dirs(args) -> list[str]:
    """Where the run's engines may load weights from: its disk-transport directory, its output
    directory and its checkpoints."""
    return [d for d in (run_weights_dir(args.engine_api_key), args.output_dir, args.save) if d]


@dataclass(frozen=True)
class Access:
    """What a server slime starts admits: its own address (Host and Origin checks), the run's key,
    the directories `/update_weights_from_disk` may load from, the addresses a weight-sync group
    may be joined at."""

    host: str
    port: int
    api_key: str | None = None
    weight_dirs: tuple[str, ...] = ()
    master_addresses: tuple[str, ...] = ()

    def check_weight_path(self, path: str) -> None:
        check_weight_path(path, self.weight_dirs)

    def check_master_address(self, address: str) -> None:
        check_master_address(address, self.master_addresses)


ACCESS_KEY = web.AppKey("access", Access)


def check_weight_path(path: str, allowed: tuple[str, ...] | list[str]) -> None:
    """`path` resolves (symlinks followed) to a directory under one of `allowed`; else a ProtocolError."""
    real = Path(os.path.realpath(path))
    for root in allowed:
        if real == Path(os.path.realpath(root)) or Path(os.path.realpath(root)) in real.parents:
            return
    raise ProtocolError("model_path", f"{path!r} is outside the directories this engine loads weights from "
                                      "(the run's output, save and weight directories)")


def check_master_address(address: str, allowed: tuple[str, ...] | list[str]) -> None:
    """A weight-sync group may only be joined at an address of the run's cluster."""
    if address not in allowed:
        raise ProtocolError("master_address", f"{address!r} is not an address of this run's cluster "
                                              f"({', '.join(allowed)})")


def add_access_flags(p: argparse.ArgumentParser) -> None:
    """Who may call a server slime starts (the native engine, the vLLM adapter): slime.engines.auth."""
    p.add_argument("--api-key", default=None,
                   help=f"requests need 'Authorization: Bearer KEY' (all but GET /health); default: ${API_KEY_ENV}")
    p.add_argument("--weight-dirs", nargs="*", default=[],
                   help="/update_weights_from_disk loads only from under these directories (and --model-path)")
    p.add_argument("--allowed-master-addresses", nargs="*", default=[],
                   help="/init_weights_update_group joins groups only at these addresses (and --host)")


def access_of(args) -> Access:
    """The `Access` a server built from these flags enforces."""
    return Access(args.host, args.port, api_key=args.api_key or env_api_key(),
                  weight_dirs=(args.model_path, *args.weight_dirs),
                  master_addresses=(args.host, *args.allowed_master_addresses))


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The `Host` headers a server bound to host:port answers (`localhost` too when on loopback)."""
    hosts = {f"{host}:{port}"}
    try:
        if ipaddress.ip_address(host).is_loopback:
            hosts.add(f"localhost:{port}")
    except ValueError:
        pass
    return frozenset(hosts)


def guard(access: Access):
    """The middleware described in the module docstring. Without a key only the Host, Origin and
    content-type checks apply (a server started by hand without --api-key)."""
    hosts = allowed_hosts(access.host, access.port)
    origins = frozenset(f"http://{h}" for h in hosts)
    expected = f"Bearer {access.api_key}".encode() if access.api_key else None

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.host not in hosts:
            return _refuse(403, f"Host {request.host!r} is not this server's address")
        origin = request.headers.get("Origin")
        if origin is not None and origin not in origins:
            return _refuse(403, f"requests from Origin {origin!r} are not accepted")
        if request.path in OPEN_PATHS and request.method == "GET":
            return await handler(request)
        if expected is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _refuse(401, "missing or wrong API key (Authorization: Bearer <--engine-api-key>)")
        if request.can_read_body and request.content_type not in BODY_TYPES:
            return _refuse(415, f"Content-Type {request.content_type!r}: send application/json")
        return await handler(request)

    return middleware


def check_request(request: web.Request, *, weight_path: str | None = None, master_address: str | None = None) -> None:
    """The route-level checks of the server's `Access` (none for an app built without one)."""
    access = request.app.get(ACCESS_KEY)
    if access is None:
        return
    if weight_path is not None:
        access.check_weight_path(weight_path)
    if master_address is not None:
        access.check_master_address(master_address)


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)
