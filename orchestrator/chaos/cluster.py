"""The campaign's processes: ``serve`` workers and ``effects dispatch`` dispatchers, each an OS
process talking to PostgreSQL through its own ``FaultProxy`` (one per server on a replicated
pair), restartable after a kill, and a worker replaceable by one running newer agent code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from orchestrator.chaos.agents import VERSION_ENV
from orchestrator.chaos.grants import GRANTS_DIR_ENV, MEMBER_ENV
from orchestrator.chaos.proxies import MemberProxy


@dataclass(frozen=True)
class Timing:
    """The leases the cluster runs with; faults are sized from them."""

    lease_seconds: float = 2.0
    dispatch_lease_seconds: float = 4.0
    poll_seconds: float = 0.2


@dataclass
class Member:
    """One worker or dispatcher slot: its proxy stays, its process is replaced after a kill."""

    role: str
    """``worker`` or ``dispatcher``."""
    index: int
    proxy: MemberProxy
    log_dir: Path
    generation: int = 0
    process: subprocess.Popen[bytes] | None = None
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    """Held by the fault acting on this member: one fault per process at a time."""

    @property
    def name(self) -> str:
        return f"chaos-{self.role[0]}{self.index}.g{self.generation}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stopped(self) -> bool:
        """Whether the kernel shows the process stopped (SIGSTOP took effect)."""
        if not self.alive:
            return False
        assert self.process is not None
        try:
            stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


@dataclass(kw_only=True, eq=False)
class Cluster:
    """Starts, kills and restarts the members. ``command`` is how a member is launched (a
    deliberately broken build may be launched another way); ``env`` is added to each."""

    database_dsn: str
    effects_config: Path
    work_dir: Path
    timing: Timing
    model_env: dict[str, str]
    command: Sequence[str] = (sys.executable, "-m", "orchestrator.cli")
    env: dict[str, str] = field(default_factory=dict)
    worker_concurrency: int = 20
    grants_dir: Path | None = None
    """Where each worker process's agents record the (run, fence) they ran under."""
    members: list[Member] = field(default_factory=list, init=False)
    restarts: int = field(default=0, init=False)
    exits: list[tuple[str, int | None]] = field(default_factory=list, init=False)
    """Processes that exited on their own (name, status), restarted by ``supervise``."""
    version: int = field(default=1, init=False)
    """The version of the chaos agents' code a worker started now runs (``deploy`` raises it)."""
    served: dict[str, str] = field(default_factory=dict, init=False)
    """The version each worker process ran, by its worker id: the checker's evidence."""
    retiring: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)
    """Workers a newer version replaced, running until ``retire`` stops them."""

    def add(self, role: str, proxy: MemberProxy) -> Member:
        index = sum(1 for member in self.members if member.role == role) + 1
        member = Member(role, index, proxy, self.work_dir)
        self.members.append(member)
        return member

    def of(self, role: str) -> list[Member]:
        return [member for member in self.members if member.role == role]

    def by_name(self, name: str) -> Member | None:
        return next((member for member in self.members if member.name == name), None)

    def start(self, member: Member) -> None:
        member.generation += 1
        timing = self.timing
        if member.role == "worker":
            arguments = [
                "serve",
                "--agents",
                "orchestrator.chaos.agents",
                "--no-dispatch",
                "--worker-id",
                member.name,
                "--concurrency",
                str(self.worker_concurrency),
                "--claim-batch",
                "5",
                "--lease-seconds",
                str(timing.lease_seconds),
                "--heartbeat-seconds",
                str(timing.lease_seconds / 4),
                "--poll-seconds",
                str(timing.poll_seconds),
                "--reap-seconds",
                "0.5",
                "--grace-seconds",
                "1",
                "--status-seconds",
                "5",
                "--log-json",
            ]
        else:
            arguments = [
                "effects",
                "dispatch",
                "--effects-config",
                str(self.effects_config),
                "--dispatcher-id",
                member.name,
                "--lease-seconds",
                str(timing.dispatch_lease_seconds),
                "--poll-seconds",
                str(timing.poll_seconds),
                "--log-json",
            ]
        if member.role == "worker":
            self.served[member.name] = str(self.version)
        log = open(member.log_dir / f"{member.name}.log", "wb")  # noqa: SIM115 - the child's
        try:
            member.process = subprocess.Popen(
                [*self.command, *arguments],
                env={
                    **os.environ,
                    **self.model_env,
                    **self.env,
                    "ORCHESTRATOR_DATABASE_URL": member.proxy.dsn_for(self.database_dsn),
                    MEMBER_ENV: member.name,
                    VERSION_ENV: str(self.version),
                    **({GRANTS_DIR_ENV: str(self.grants_dir)} if self.grants_dir else {}),
                },
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,  # a terminal's Ctrl-C reaches the campaign, not them
            )
        finally:
            log.close()

    def kill(self, member: Member) -> int | None:
        """SIGKILL and reap; the exit status (``-9`` when the kill took it)."""
        if member.process is None:
            return None
        if member.process.poll() is None:
            member.process.send_signal(signal.SIGKILL)
        return member.process.wait(10)

    def restart(self, member: Member) -> None:
        self.kill(member)
        self.restarts += 1
        self.start(member)

    async def supervise(self) -> None:
        """Restart a process that exited on its own, as systemd's ``Restart=on-failure`` would
        (``serve`` and ``effects dispatch`` exit 1 when PostgreSQL is unreachable at start)."""
        while True:
            await anyio.sleep(0.5)
            for member in self.members:
                if member.process is not None and not member.alive and not member.lock.locked():
                    self.exits.append((member.name, member.process.returncode))
                    self.restart(member)

    def heal(self) -> None:
        """Every proxy forwarding, every process running and not stopped."""
        for member in self.members:
            member.proxy.mode = "forward"
            if member.alive:
                assert member.process is not None
                member.process.send_signal(signal.SIGCONT)
            else:
                self.restart(member)

    def replace(self, member: Member) -> subprocess.Popen[bytes] | None:
        """Start a process of the current version in ``member``'s slot, leaving the one it ran
        running (returned, ``None`` if it had ended) until ``retire`` stops it."""
        old = member.process if member.alive else None
        if old is not None:
            self.retiring.append(old)
        self.start(member)
        return old

    def retire(self, processes: Sequence[subprocess.Popen[bytes]], timeout: float = 15) -> None:
        """Stop processes ``replace`` left running, as a deploy stops old code: SIGTERM."""
        _terminate(processes, timeout)
        self.retiring = [process for process in self.retiring if process not in processes]

    def stop_all(self, timeout: float = 15) -> None:
        running = [member.process for member in self.members if member.process is not None]
        self.retire([*self.retiring, *running], timeout)


def _terminate(processes: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """SIGTERM (after a SIGCONT: a stopped process cannot drain), then SIGKILL what is left."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
