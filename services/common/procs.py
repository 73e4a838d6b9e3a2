"""Child processes that never outlive their parent, and free ports for them."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """preexec_fn for subprocess.Popen: on Linux the child gets SIGTERM when its parent dies,
    so a killed supervisor leaves no orphan services behind."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
