"""One server of a ``ReplicatedPostgres`` pair, and the process handling a failover needs.

A node is an ``EmbeddedPostgres`` home pinned to one loopback port (its slot's), so a killed
primary's slot can take a fresh standby at the same address. Killing is done as a machine dies:
SIGKILL to the postmaster and every process it forked, then its System V shared memory
segment (a killed postmaster cannot remove it, and each one left would stay until reboot).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from orchestrator.db.embedded import DATABASE, EmbeddedPostgres
from orchestrator.errors import EmbeddedPostgresError

IPC_RMID = 0


class ReplicationError(EmbeddedPostgresError):
    """The pair could not reach the state asked for (named, with the log to read)."""


def until(what: str, condition: Callable[[], bool], *, within: float, step: float = 0.05) -> None:
    """Poll ``condition`` at most ``within / step`` times; raise naming ``what`` if it never
    held."""
    for _ in range(max(1, round(within / step))):
        if condition():
            return
        time.sleep(step)
    if not condition():
        raise ReplicationError(f"{what}: not within {within:g}s")


def refuses(port: int) -> bool:
    """Whether nothing accepts connections on the loopback ``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            return True
        return False


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), if it exists."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie does not (a killed postmaster is reparented to PID 1,
    which in a container may never reap it, so ``kill(pid, 0)`` alone would say it runs)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (a postmaster's backends and helpers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


class PairNode(EmbeddedPostgres):
    """One server of the pair: an ``EmbeddedPostgres`` home pinned to its slot's port."""

    def __init__(self, home: Path, port: int, settings: Mapping[str, str]) -> None:
        super().__init__(home, server_settings=settings)
        self.port = port

    def dsn(self, database: str = DATABASE) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def prepare(self) -> None:
        """An empty data directory the server user owns (``initdb`` and ``pg_basebackup``
        refuse anything else)."""
        self.home.mkdir(parents=True, exist_ok=True)
        if self._as_root:
            self._prepare_for_server_user()
        else:
            self.data_dir.mkdir(mode=0o700, exist_ok=True)

    def initdb(self, extra_conf: str) -> None:
        self.prepare()
        self._initdb()
        # The command-line settings written here too: a reload then finds nothing to complain of.
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write(extra_conf)
            for key, value in self.server_settings.items():
                conf.write(f"{key} = '{value}'\n")

    def start(self) -> None:
        """Start on the slot's port (``pg_ctl -w``: until it takes connections)."""
        self._start(port=self.port)
        running = self.running()
        if running is None:
            raise ReplicationError(
                f"PostgreSQL in {self.data_dir} did not start: {self.log_tail()}"
            )
        if running.port != self.port:
            self.kill()
            raise ReplicationError(
                f"port {self.port} was taken while its server was down: the pair cannot keep "
                "its addresses"
            )

    def postmaster(self) -> int | None:
        """The postmaster's pid, if it runs (ready or not)."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0].strip()
        except OSError:
            return None
        return int(first) if first.isdigit() and alive(int(first)) else None

    def kill(self) -> None:
        """SIGKILL the postmaster and its children; remove its shared memory segment."""
        pid = self.postmaster()
        if pid is None:
            return
        segment = self._segment()
        for each in (pid, *children(pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, signal.SIGKILL)
        until(f"PostgreSQL {pid} dying of SIGKILL", lambda: not alive(pid), within=10)
        if segment is not None:
            # Marked for removal: the kernel frees it when the last dying process detaches.
            ctypes.CDLL(None, use_errno=True).shmctl(segment, IPC_RMID, None)

    def _segment(self) -> int | None:
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return None
        fields = lines[6].split() if len(lines) > 6 else []
        return int(fields[1]) if len(fields) == 2 and fields[1].isdigit() else None

    def sql(self, query: str, *, database: str = "postgres", timeout: float = 30) -> str:
        """``query``'s output through ``psql`` (unaligned, tuples only), stripped."""
        argv = ["psql", "-X", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"]
        argv += ["-d", database, "-v", "ON_ERROR_STOP=1", "-tAc", query]
        return self.run(argv, timeout=timeout).strip()

    def run(self, argv: list[str], *, timeout: float = 120) -> str:
        """A client binary as the server user; its output. Never for ``pg_ctl start``: the
        server it forks would hold the pipes (``EmbeddedPostgres._start`` uses files)."""
        try:
            done: subprocess.CompletedProcess[bytes] = subprocess.run(
                [str(self._bin / argv[0]), *argv[1:]],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                **self._as_server_user(),
            )
        except subprocess.TimeoutExpired:
            raise ReplicationError(
                f"`{argv[0]}` on port {self.port} did not finish in {timeout:g}s"
            ) from None
        if done.returncode != 0:
            output = (done.stdout + done.stderr).decode(errors="replace").strip()
            raise ReplicationError(
                f"`{argv[0]}` on port {self.port} failed ({done.returncode}): {output[-500:]}"
            )
        return done.stdout.decode(errors="replace")

    def log_tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"no log at {self.log_file}"
