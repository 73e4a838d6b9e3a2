"""The local stack: `specmesh up` / `specmesh down`.

`up` prepares the models once, starts a private redis-server (unless --redis-url), then the
verifier and drafter (which load models), the router and the gateway, each a `specmesh serve
ROLE` child process, and waits for each to answer grpc.health.v1. It then watches them: a child
that dies is restarted with backoff (`supervisor.py`) while the others carry on; Ctrl-C or
SIGTERM (what `down` sends) stops everything. Children get a parent-death signal, so even a
killed `up` leaves no orphans. `--detach` runs the same supervisor in the
background and returns once the stack is healthy.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh_services.common import cores, security
from specmesh_services.common.config import Settings, SettingsError
from specmesh_services.launch.procs import free_port, orphan_guard, pid_alive, port_free
from specmesh_services.launch.supervisor import supervise

CLI_MODULE = "specmesh_services.launch.cli"  # children run `python -m CLI_MODULE ...`
START_TIMEOUT_S = 300.0
# what a child logs when a port chosen for it was taken before it bound it; its start stage
# then gets new ports, at most PORT_RETRIES times
PORT_TAKEN = ("Address already in use", "cannot listen on")
PORT_RETRIES = 3
STOP_TIMEOUT_S = 45.0  # the supervisor's own stop: the children's drain (drain_s + 5) + redis


def state_path(settings: Settings) -> Path:
    return settings.stack_dir / "stack.json"


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings as SPECMESH_* variables (complex values as JSON, which pydantic-settings
    parses), so children see exactly this configuration (secrets included: they are masked only
    where shown)."""
    env = {}
    dumped = settings.model_dump(mode="json")
    if settings.gateway.api_keys is not None:
        dumped["gateway"]["api_keys"] = settings.gateway.api_keys.get_secret_value()
    for name, value in dumped.items():
        if value is not None:
            env[f"SPECMESH_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


class PortTaken(RuntimeError):
    """A child exited at start because a port chosen for it was taken meanwhile."""


@dataclass
class Child:
    role: str
    port: int
    log: Path
    process: subprocess.Popen
    metrics_port: int  # its Prometheus metrics: http://127.0.0.1:PORT/metrics
    name: str = ""  # the role, or "verifier-2" for a second replica (its log file's name)
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.name = self.name or self.role

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _addresses(ports: list[int]) -> str:
    return ",".join(f"127.0.0.1:{port}" for port in ports)


def _replica(role: str, i: int) -> str:
    """The name of a role's i-th replica: verifier, verifier-2, ..."""
    return role if i == 0 else f"{role}-{i + 1}"


@dataclass
class Stack:
    settings: Settings
    gateway_port: int
    log_dir: Path
    secure: bool = False  # TLS (mutual) everywhere, an API key, Redis with a password over TLS
    verifiers: int = 1  # replicas, consumers of the same pool
    routers: int = 1  # replicas; the gateway spreads requests over them and resumes on another
    drafting: int = 1  # replicas of the drafter and of the datastore; a request sticks to one
    children: list[Child] = field(default_factory=list)
    redis: object | None = None  # RedisServer when we started one
    http_port: int | None = None  # the gateway's OpenAI-compatible HTTP API (None: off)
    gpus: tuple[int, ...] = ()  # GPUs given out to the model processes in turn (empty: inherit)

    def start(self) -> None:
        from specmesh_services.common import models  # torch: not in `up --detach`'s own process

        self.log_dir.mkdir(parents=True, exist_ok=True)
        settings = models.served(self.settings)  # every child serves the same resolved source
        prepare(settings)
        pki = None
        if self.secure:
            pki = security.local_pki(self.secure_dir)
            settings = settings.with_overrides(**{
                "tls.cert_file": pki.cert, "tls.key_file": pki.key, "tls.ca_file": pki.ca,
                "tls.mutual": True, "gateway.api_keys_file": self.api_key_file()})
        if settings.redis_url is None:
            from specmesh_services.launch.redis_server import RedisServer

            self.redis = RedisServer(log_path=self.log_dir / "redis.log", tls=pki,
                                     password=secrets.token_urlsafe(24) if pki else None)
            self.redis.start()
            settings = settings.with_overrides(redis_url=self.redis.url)
        self.start_children(settings)

    def start_children(self, settings: Settings) -> None:
        """The pool's consumers and the draft sources (a drafter times its forwards as it
        starts: nothing else starts beside them), then the routers (which ask the drafting
        services for their models) together with the gateway (which asks nothing at start),
        each stage healthy before the next; a port chosen here and taken before its child bound
        it is chosen again (the stage restarts)."""
        from specmesh_services.common.drafts import serves_drafter

        replicas = {"verifier": self.verifiers, "router": self.routers,
                    "drafter": self.drafting, "datastore": self.drafting, "gateway": 1}
        ports = {role: [self.gateway_port] if role == "gateway" else
                 [free_port() for _ in range(n)] for role, n in replicas.items()}
        chose_http = settings.gateway.http_port == 0
        self.http_port = free_port() if chose_http else settings.gateway.http_port
        source = settings.speculation.source
        drafting = tuple(role for role, used in (("drafter", serves_drafter(settings)),
                                                 ("datastore", source != "model")) if used)
        for roles in (("verifier", *drafting), ("router", "gateway")):
            for attempt in range(PORT_RETRIES + 1):
                self.settings = settings.with_overrides(  # what the children run with
                    **{"gateway.http_port": self.http_port},
                    router_address=_addresses(ports["router"]),
                    drafter_address=_addresses(ports["drafter"]),
                    datastore_address=_addresses(ports["datastore"]))
                stage = [self.spawn(role, port, self.settings, name=_replica(role, i))
                         for role in roles for i, port in enumerate(ports[role])]
                try:
                    self.wait_all(stage)
                    break
                except PortTaken:
                    if attempt == PORT_RETRIES:
                        raise
                    self.drop(stage)
                    ports.update({role: [free_port() for _ in ports[role]]
                                  for role in roles if role != "gateway"})
                    if chose_http and "gateway" in roles:
                        self.http_port = free_port()

    def drop(self, children: list[Child]) -> None:
        """Kills `children` (a stage that failed to start) and forgets them."""
        for child in children:
            if child.alive():
                child.process.kill()
            child.process.wait()
            self.children.remove(child)

    def device_env(self, role: str, name: str) -> dict[str, str]:
        """With `gpus`: each verifier and drafter replica its own GPU in turn (one per process
        while there are enough; `CUDA_VISIBLE_DEVICES`), the other roles none."""
        if not self.gpus:
            return {}
        holders = [_replica(r, i) for r, n in (("verifier", self.verifiers),
                                               ("drafter", self.drafting)) for i in range(n)]
        if role not in ("verifier", "drafter") or name not in holders:
            return {"CUDA_VISIBLE_DEVICES": ""}
        gpu = self.gpus[holders.index(name) % len(self.gpus)]
        return {"CUDA_VISIBLE_DEVICES": str(gpu), "SPECMESH_DEVICE": "cuda"}

    def wait_all(self, children: list[Child]) -> None:
        for child in children:
            self.wait_healthy(child)

    def spawn(self, role: str, port: int, settings: Settings, metrics_port: int | None = None,
              append: bool = False, name: str = "") -> Child:
        metrics_port = metrics_port or free_port()
        env = {**os.environ, **settings_env(settings.with_overrides(port=port,
                                                                    metrics_port=metrics_port))}
        if "OMP_NUM_THREADS" not in os.environ:
            placement = cores.plan(settings.cores, settings.drafter_cores)
            env["OMP_NUM_THREADS"] = str(placement.threads(role))
        env.update(self.device_env(role, name or role))
        log = self.log_dir / f"{name or role}.log"
        out = open(log, "a" if append else "w")
        command = [*orphan_guard(), sys.executable, "-m", CLI_MODULE, "serve", role]
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env)
        out.close()
        child = Child(role, port, log, process, metrics_port, name)
        self.children.append(child)
        return child

    def restart(self, dead: Child, stopping: list | None = None) -> Child:
        """`dead`'s role again on the same ports, in its place (its log goes on in the same
        file); returns the new child once it answers health checks (or at once when `stopping`
        is set meanwhile)."""
        with open(dead.log, "a") as log:
            log.write(f"--- exited with code {dead.process.returncode}; restarted ---\n")
        index = self.children.index(dead)
        child = self.spawn(dead.role, dead.port, self.settings, dead.metrics_port, append=True,
                           name=dead.name)
        self.children.remove(child)
        self.children[index] = child
        self.wait_healthy(child, stopping)
        return child

    @property
    def secure_dir(self) -> Path:
        """The local CA, the services' certificate and the API key of a secure stack."""
        return self.settings.stack_dir / "tls"

    def api_key_file(self) -> Path:
        """The secure stack's API key (made once, 0600): clients send it, it is never printed."""
        path = self.secure_dir / "api_key"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32) + "\n")
        return path

    def wait_healthy(self, child: Child, stopping: list | None = None) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        credentials = security.channel_credentials(self.settings.tls)
        address = f"127.0.0.1:{child.port}"
        with (grpc.secure_channel(address, credentials) if credentials is not None
              else grpc.insecure_channel(address)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and not stopping:
                if not child.alive():
                    tail = child.log_tail()
                    error = PortTaken if any(m in tail for m in PORT_TAKEN) else RuntimeError
                    raise error(f"{child.role} exited with code {child.process.returncode}:\n{tail}")
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.3)
        if stopping:
            return
        raise RuntimeError(f"{child.role} did not become healthy in {START_TIMEOUT_S:.0f} s:\n"
                           f"{child.log_tail()}")

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.alive():
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_s + 5  # they drain, then exit
        for child in reversed(self.children):
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        if self.redis is not None:
            self.redis.stop()

    @property
    def http_url(self) -> str | None:
        """Base URL of the OpenAI-compatible API (what `openai.OpenAI(base_url=...)` takes)."""
        scheme = "https" if self.settings.tls.enabled else "http"
        return f"{scheme}://127.0.0.1:{self.http_port}/v1" if self.http_port is not None else None

    def describe(self) -> dict:
        return {"pid": os.getpid(), "gateway": f"127.0.0.1:{self.gateway_port}",
                "http": self.http_url, "secure": str(self.secure_dir) if self.secure else None,
                "redis_url": _redacted(self.settings.redis_url), "log_dir": str(self.log_dir),
                "children": {c.name: {"pid": c.process.pid, "port": c.port,
                                      "metrics": f"http://127.0.0.1:{c.metrics_port}/metrics"}
                             for c in self.children}}


def prepare(settings: Settings) -> None:
    """Converts the target and the drafts it serves with once, here, with a progress bar (not 2x
    in children), and builds the default datastore where the datastore drafts. A device the
    models cannot run on is refused first (`SettingsError`)."""
    from specmesh_services.common import models
    from specmesh_services.common.device import check as check_device
    from specmesh_services.common.drafts import model_specs
    from specmesh_services.drafter.spec import DraftSpec

    check_device(settings)
    settings = models.served(settings)
    names = [settings.model]
    if settings.speculation.source != "datastore":
        try:
            drafts = [DraftSpec.parse(s) for s in model_specs(settings)]
        except ValueError as err:  # a bad --draft: one line, not a traceback
            raise SettingsError(str(err)) from None
        names += [d.base for d in drafts if d.layers is None]
    for name in names:
        models.resolve(name, settings.cache_dir)
    prepare_datastore(settings)


def prepare_datastore(settings: Settings) -> None:
    """Builds the default datastore of the target's tokenizer (ShareGPT, once) when the served
    source uses the datastore and no datastore path was given."""
    from specmesh_services.common import models

    settings = models.served(settings)
    if settings.speculation.source != "model" and settings.datastore.path is None:
        from specmesh_services.datastore import build

        tokenizer = build.target_tokenizer(settings)
        if not (build.output_dir(settings, "sharegpt", tokenizer) / "meta.json").is_file():
            print("building the default datastore (ShareGPT, once)...", file=sys.stderr)
            build.build(settings, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------
# commands


def up(settings: Settings, port: int, detach: bool, secure: bool = False,
       verifiers: int = 1, routers: int = 1, drafting: int = 1,
       gpus: tuple[int, ...] = ()) -> int:
    state = state_path(settings)
    running = _read_state(state)
    if running and pid_alive(running["pid"]):
        print(f"a stack is already running (pid {running['pid']}, gateway {running['gateway']}): "
              f"`specmesh down` first", file=sys.stderr)
        return 1
    port = port or free_port()  # 0: any free port, chosen here so a detached stack reports it
    taken = [f"{what} port {p}" for what, p in (("gateway", port),
                                                ("HTTP", settings.gateway.http_port))
             if p and not port_free(settings.host, p)]
    if taken:  # refused before any process starts, not after the models have loaded
        print(f"error: {' and '.join(taken)} on {settings.host} in use: stop what listens there "
              f"(`specmesh down` for a stack) or choose another (--port, --http-port; 0 picks a "
              f"free one)", file=sys.stderr)
        return 1
    if detach:
        return _up_detached(settings, port, state, secure, verifiers, routers, drafting, gpus)
    log_dir = settings.stack_dir / "logs"  # Stack.start creates it
    stack = Stack(settings, port, log_dir, secure=secure, verifiers=verifiers, routers=routers,
                  drafting=drafting, gpus=gpus)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        print(f"starting specmesh ({settings.model}); logs in {log_dir}", flush=True)
        stack.start()
        state.write_text(json.dumps(stack.describe(), indent=1))
        print("Prometheus metrics: " + ", ".join(f"{c.name} http://127.0.0.1:{c.metrics_port}"
                                                 "/metrics" for c in stack.children), flush=True)
        print(f"specmesh is up: gateway on 127.0.0.1:{port}{_http_note(stack.http_url)}. "
              + (secure_note(stack.secure_dir) if secure else
                 f"Try: specmesh generate \"Hello\" --address 127.0.0.1:{port}")
              + ". Ctrl-C or `specmesh down` stops it.", flush=True)
        # Ctrl-C reaches the whole foreground process group: the children stop on it too, so a
        # child found dead right after it is part of the stop, not a failure. Once up, Ctrl-C
        # sets a flag (not KeyboardInterrupt) so the loop below can tell the two apart.
        signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
        supervise(stack, stopping, lambda: state.write_text(json.dumps(stack.describe(), indent=1)))
        return 0
    except KeyboardInterrupt:
        return 0
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        print("stopping specmesh...", flush=True)
        began = time.monotonic()
        stack.stop()
        print(f"stopped in {time.monotonic() - began:.1f} s", flush=True)
        with contextlib.suppress(FileNotFoundError):
            state.unlink()


def _up_detached(settings: Settings, port: int, state: Path, secure: bool,
                 verifiers: int, routers: int, drafting: int, gpus: tuple[int, ...]) -> int:
    state.parent.mkdir(parents=True, exist_ok=True)
    log = state.parent / "up.log"
    env = {**os.environ, **settings_env(settings)}
    with open(log, "w") as out:
        command = [sys.executable, "-m", CLI_MODULE, "up", "--port", str(port),
                   "--verifiers", str(verifiers), "--routers", str(routers),
                   "--drafting", str(drafting),
                   *(["--secure"] if secure else []),
                   *(["--gpus", ",".join(map(str, gpus))] if gpus else [])]
        process = subprocess.Popen(command,
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            print(f"specmesh up failed (code {process.returncode}), see {log}:\n"
                  f"{log.read_text()[-2000:]}", file=sys.stderr)
            return 1
        running = _read_state(state)
        if running and running["pid"] == process.pid:
            print(f"specmesh is up: gateway on {running['gateway']}"
                  f"{_http_note(running.get('http'))} (supervisor pid {process.pid}, log {log}). "
                  + (secure_note(running["secure"]) + ". " if running.get("secure") else "")
                  + "`specmesh down` stops it.")
            return 0
        time.sleep(0.5)
    process.terminate()
    print(f"specmesh up timed out, see {log}", file=sys.stderr)
    return 1


def _redacted(url: str | None) -> str | None:
    """A Redis URL without its password."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def secure_note(folder: str | Path) -> str:
    """How a client reaches a secure stack (the key stays in its file)."""
    d = Path(folder)
    return (f"TLS (mutual) with the CA {d / 'ca.pem'} and the client certificate "
            f"{d / 'service.pem'} / {d / 'service-key.pem'}; API key in {d / 'api_key'}. Try: "
            f"specmesh generate \"Hello\" --tls-dir {d}")


def _http_note(url: str | None) -> str:
    return f", OpenAI-compatible API on {url}" if url else ""


def down(settings: Settings) -> int:
    """SIGTERM to the supervisor (which stops its children in order), SIGKILL to whatever is
    left after STOP_TIMEOUT_S, and returns only once every process of the stack is gone. Only
    processes still running specmesh are signalled: a stale state file's pid may be reused."""
    state = state_path(settings)
    running = _read_state(state)
    if not running:
        print("no specmesh stack is running")
        return 0
    pids = {"supervisor": running["pid"],
            **{role: info["pid"] for role, info in running["children"].items()}}
    pids = {role: pid for role, pid in pids.items() if _is_specmesh(pid)}
    supervisor = pids.get("supervisor")
    if supervisor is not None:
        os.kill(supervisor, signal.SIGTERM)
        _wait_gone([supervisor], STOP_TIMEOUT_S)
    left = {role: pid for role, pid in pids.items() if pid_alive(pid)}
    if left:
        print(f"still running after {STOP_TIMEOUT_S:.0f} s: {', '.join(left)}; killing",
              file=sys.stderr)
        for pid in left.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        survivors = _wait_gone(list(left.values()), 10.0)
        if survivors:
            print(f"could not stop pids {survivors}", file=sys.stderr)
            return 1
    with contextlib.suppress(FileNotFoundError):
        state.unlink()
    print("specmesh stopped")
    return 0


def _is_specmesh(pid: int) -> bool:
    try:
        return pid_alive(pid) and CLI_MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid_alive(pid)  # no /proc (not Linux): trust the state file


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if pid_alive(p)]


def _read_state(state: Path) -> dict | None:
    try:
        return json.loads(state.read_text())
    except (OSError, ValueError):
        return None
