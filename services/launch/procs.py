"""Child processes that never outlive their parent, and free ports for them."""
from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path


def orphan_guard() -> list[str]:
    """Command prefix that makes a child get SIGTERM when its parent dies (Linux), so a killed
    supervisor leaves no orphan services behind: util-linux's `setpriv --pdeathsig`, which sets
    the flag and execs the command (same pid). [] where setpriv is missing (the child then
    outlives a killed parent, nothing else changes).

    Not a `preexec_fn`: that runs Python between fork and exec, which makes CPython call the
    at-fork handlers, and gRPC's handler, in a parent with live gRPC threads, can abort the
    child ("epoll_wait error: Bad file descriptor", seen in the test suite). Without preexec_fn
    the child is spawned with vfork/exec and no handler runs in it."""
    if not sys.platform.startswith("linux"):
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on `host`:`port` now (bound as gRPC binds: SO_REUSEADDR,
    so a port left in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
        except OSError:
            return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a dead child not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True
