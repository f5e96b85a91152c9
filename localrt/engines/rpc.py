"""llama.cpp RPC: one gguf-cpp model split across hosts that run llama.cpp's rpc-server.

A model started with `rpc_servers` ("host:port,host:port", as llama.cpp's --rpc) puts
its layers on the devices those servers lend (a server's CPU, or its GPUs). llama.cpp
counts them as GPUs, so `ngl` says how many layers go there (all by default); they
are split by the memory each server has free, and the token embeddings stay here.
It needs a gguf-cpp build with the RPC backend (GGML_RPC=ON): the variants named
`<variant>+rpc` (localrt.engines.catalog), which localrt.engines.builds compiles from the sdist when
the package index has no wheel of them.

Trust (`untrusted_host`): rpc-server has no authentication. Whoever reaches its port
can make it allocate memory, write and read tensors in it and compute graphs, and a
client that speaks to a server it does not own hands that server its prompts and the
model. So a model is split only across loopback hosts and those the rc setting
`rpcTrustedHosts` names (host names, addresses or CIDR ranges); a host name counts as
trusted when it is listed, or when every address it resolves to is.

Connecting (`preflight`): ggml's RPC client aborts the whole process when a server
cannot be reached, refuses the handshake (another RPC protocol version) or breaks
mid-run. So before a model loads, a child process (`python -m localrt.engines.rpc ENGINE_DIR
ENDPOINT...`, this module's `main`) connects to each server and lists its devices. A
server that fails there is a 502 naming it, and one that gives no answer in
PREFLIGHT_TIMEOUT seconds is busy: rpc-server serves one client at a time. A server
that goes away while a model uses it still ends the localrt server (llama.cpp
aborts; ggml's abort callback logs why first).

Devices (`Client`): each server's devices come from `ggml_backend_rpc_add_server`,
reached through the RPC backend's proc address as llama.cpp's common/arg.cpp does,
and go to that one model in llama_model_params.devices. Unlike --rpc they are never
registered globally, so models started without rpc_servers never use them.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable

import localrt
from localrt.engines.ggmllib import DEVICE_GPU, DEVICE_IGPU, libggml
from localrt.errors import UpstreamError

log = logging.getLogger(__name__)

PREFLIGHT_TIMEOUT = 20.0  # seconds for the child to reach every server


class RpcServerError(UpstreamError):
    """An rpc-server could not be used: unreachable, busy, or speaking another version."""

    code = "rpc_server_error"


# --- the option and the trust rule ------------------------------------------------------


def parse_servers(text: str) -> list[tuple[str, int]]:
    """(host, port) of each "host:port" in `text`; ValueError saying what is wrong."""
    servers = []
    for part in text.split(","):
        endpoint = part.strip()
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{endpoint!r} is not host:port")
        if ":" in host or host.startswith("["):
            # ggml splits an endpoint at its first colon: no IPv6 literals.
            raise ValueError(f"{endpoint!r}: llama.cpp's RPC client takes a host name or "
                             f"an IPv4 address, not an IPv6 one")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{endpoint!r}: the port must be a number from 1 to 65535")
        if (host, int(port)) in servers:
            raise ValueError(f"{endpoint} is named twice")
        servers.append((host, int(port)))
    return servers


def endpoints(servers: Iterable[tuple[str, int]]) -> list[str]:
    """The "host:port" strings ggml takes."""
    return [f"{host}:{port}" for host, port in servers]


def untrusted_host(servers: Iterable[tuple[str, int]], trusted: Iterable[str],
                   resolve: Callable[[str], list[str]] | None = None) -> tuple[str, str] | None:
    """(host, why) of the first server that is neither loopback nor trusted; None if all are.

    A listed name or address is trusted as written; an address, or a name all of whose
    addresses are loopback or inside a listed CIDR range, is trusted too.
    """
    resolve = resolve or _addresses
    names = {t.lower().rstrip(".") for t in trusted if "/" not in t}
    networks = [ipaddress.ip_network(t, strict=False) for t in trusted if "/" in t]
    for host, _ in servers:
        if host.lower().rstrip(".") in names:
            continue
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                addresses = [ipaddress.ip_address(a) for a in resolve(host)]
            except OSError as exc:
                return host, f"the host {host} cannot be resolved ({exc.strerror or exc})"
        outside = [a for a in addresses
                   if not a.is_loopback and not any(a in n for n in networks)]
        if outside or not addresses:
            return host, (f"{host} is not loopback and not in rpcTrustedHosts; rpc-server "
                          f"has no authentication, so localrt splits a model only across "
                          f"hosts you trust: add {host} (or its network, as a CIDR range) "
                          f"to rpcTrustedHosts in the settings file")
    return None


def _addresses(host: str) -> list[str]:
    """Every address `host` resolves to (getaddrinfo's)."""
    return sorted({str(info[4][0]).split("%")[0]  # fe80::1%eth0: the scope is no address
                   for info in socket.getaddrinfo(host, None)})


# --- the preflight child ---------------------------------------------------------------


def preflight(targets: list[str], engine_dir: str | None,
              timeout: float = PREFLIGHT_TIMEOUT) -> list[dict]:
    """Each server's devices, learned by a child process that connects to it:
    [{"endpoint", "devices": [{"name", "description", "free", "total"}]}].

    Raises RpcServerError naming the first server that failed, and why. A child that
    times out is left to finish: rpc-server dies of SIGPIPE when the client whose
    handshake it finally reads has gone, so killing the child would kill a busy server
    once it is free. It ends by itself when its turn comes (or its server ends).
    """
    cmd = [sys.executable, "-m", "localrt.engines.rpc", engine_dir or "", *targets]
    env = dict(os.environ)
    # (the folder that holds the localrt package, however deep this module sits in it)
    localrt_root = str(Path(localrt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [localrt_root, env.get("PYTHONPATH")]))
    # Files, not pipes: a child left running writes on without anyone reading.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        out.seek(0)
        err.seek(0)
        said, stderr = out.read().decode("utf-8", "replace"), err.read().decode("utf-8",
                                                                                  "replace")
    found = []
    for line in said.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            pass
    if code == 0 and len(found) == len(targets):
        return found
    failed = targets[min(len(found), len(targets) - 1)]
    if code is None:
        why = (f"it did not answer within {timeout:g} s: an rpc-server serves one client "
               f"at a time, so another client (a llama-server, another localrt) may be "
               f"using it")
    else:
        last = (stderr.strip().splitlines() or [f"the check ended with exit status {code}"])
        why = _ggml_reason(stderr) or last[-1]
    raise RpcServerError(f"Cannot use the rpc-server {failed}: {why}", param="rpc_servers")


def _ggml_reason(stderr: str) -> str | None:
    """What ggml said before it aborted (the child's abort callback writes it as
    "abort: FILE:LINE: message"), with a version mismatch it logged before that."""
    aborted = [line[len("abort: "):] for line in stderr.splitlines()
               if line.startswith("abort: ")]
    if not aborted:
        return None
    reason = re.sub(r"^\S+:\d+: ", "", aborted[-1]).strip()
    mismatch = re.search(r"RPC server version mismatch: [\d.]+", stderr)
    if mismatch:
        reason += (f" ({mismatch.group(0)}; build rpc-server from the same llama.cpp as "
                   f"this engine)")
    return reason


@ctypes.CFUNCTYPE(None, ctypes.c_char_p)
def _print_abort(message: bytes) -> None:
    """The child's abort callback: one line for the parent, instead of ggml's backtrace."""
    print("abort: " + _text(message), file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """The child: ENGINE_DIR (or "") and endpoints; one JSON line per server reached."""
    if argv and argv[0]:
        sys.path.insert(0, argv[0])
    import llama_cpp

    if not llama_cpp.llama_supports_rpc():
        print("this llama.cpp build has no RPC backend", file=sys.stderr)
        return 2
    ggml = libggml()
    ggml.ggml_set_abort_callback(ctypes.cast(_print_abort, ctypes.c_void_p))
    for target in argv[1:]:
        reg = _add_server(ggml, target)  # aborts the child when the server fails
        if not reg:
            print(f"ggml-rpc: the rpc-server {target} lends no device", file=sys.stderr)
            return 1
        devices = []
        for dev in _reg_devices(ggml, reg):
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            devices.append({"name": _text(ggml.ggml_backend_dev_name(dev)),
                            "description": _text(ggml.ggml_backend_dev_description(dev)),
                            "free": free.value, "total": total.value})
        print(json.dumps({"endpoint": target, "devices": devices}), flush=True)
    return 0


# --- ggml, through ctypes -----------------------------------------------------------------


_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)


def _add_server(ggml, target: str):
    """ggml_backend_rpc_add_server(target): the server's backend reg (NULL: no devices)."""
    rpc = ggml.ggml_backend_reg_by_name(b"RPC")
    address = ggml.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_add_server")
    if not rpc or not address:
        raise RuntimeError("this llama.cpp build has no RPC backend")
    return _ADD_SERVER(address)(target.encode())


def _reg_devices(ggml, reg) -> list:
    return [ggml.ggml_backend_reg_dev_get(reg, i)
            for i in range(ggml.ggml_backend_reg_dev_count(reg))]


def _text(value: bytes | None) -> str:
    return (value or b"").decode("utf-8", "replace")


@ctypes.CFUNCTYPE(None, ctypes.c_char_p)
def _log_abort(message: bytes) -> None:
    """ggml's abort callback: say in the log why the server ends, before abort() does."""
    log.critical("llama.cpp aborts the server: %s", _text(message))
    for handler in logging.getLogger().handlers:
        handler.flush()


def local_gpu(llama_cpp) -> bool:
    """Whether llama.cpp has a GPU of this machine to offload layers to (its own
    llama_supports_gpu_offload also says yes for an RPC backend with no GPU at all)."""
    if not llama_cpp.llama_supports_gpu_offload():
        return False
    if not llama_cpp.llama_supports_rpc():
        return True
    ggml = libggml()
    return bool(ggml.ggml_backend_dev_by_type(DEVICE_GPU)
                or ggml.ggml_backend_dev_by_type(DEVICE_IGPU))


class Client:
    """This process's use of rpc-servers: the endpoints loaded models hold.

    A server a model holds serves no second client, so it is not preflighted again
    (ggml shares the model's connection with a second model on it). `_lock` guards
    `_holders` (endpoint -> how many loaded models use it).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._holders: dict[str, int] = {}

    def devices(self, targets: list[str], engine_dir: str | None):
        """The servers' devices as llama_model_params.devices takes them (a NULL-ended
        array; keep it until the model has loaded), and `targets` held until `release`.

        Raises RpcServerError for a server that cannot be used (see `preflight`).
        """
        with self._lock:
            fresh = [t for t in targets if not self._holders.get(t)]
        if fresh:
            preflight(fresh, engine_dir)
        ggml = libggml()
        ggml.ggml_set_abort_callback(ctypes.cast(_log_abort, ctypes.c_void_p))
        found = []
        for target in targets:
            reg = _add_server(ggml, target)
            if not reg:
                raise RpcServerError(f"Cannot use the rpc-server {target}: it lends no "
                                     f"device", param="rpc_servers")
            found += _reg_devices(ggml, reg)
        with self._lock:
            for target in targets:
                self._holders[target] = self._holders.get(target, 0) + 1
        return (ctypes.c_void_p * (len(found) + 1))(*found, None)

    def release(self, targets: list[str]) -> None:
        """A model that held `targets` is unloaded."""
        with self._lock:
            for target in targets:
                left = self._holders.get(target, 0) - 1
                if left > 0:
                    self._holders[target] = left
                else:
                    self._holders.pop(target, None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
