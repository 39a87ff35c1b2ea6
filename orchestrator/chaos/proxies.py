"""A member's way to PostgreSQL: one ``FaultProxy`` per database server, faulted together.

On one server a member has one proxy. On a replicated pair it has one per server and a
multi-host DSN through them (``target_session_attrs=primary``), so after a failover its client
finds the promoted server through the same proxies, as it would through a real network: a
partition cuts the member off from both servers at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from orchestrator.testing.loopback import FaultProxy


class MemberProxy:
    """Several ``FaultProxy`` that act as one: one mode, summed counters, one DSN."""

    def __init__(self, proxies: Sequence[FaultProxy]) -> None:
        if not proxies:
            raise ValueError("a member needs at least one proxy")
        self.proxies = tuple(proxies)

    @property
    def mode(self) -> str:
        return self.proxies[0].mode

    @mode.setter
    def mode(self, mode: str) -> None:
        for proxy in self.proxies:
            proxy.mode = mode

    @property
    def held(self) -> int:
        return sum(proxy.held for proxy in self.proxies)

    @property
    def dropped(self) -> int:
        return sum(proxy.dropped for proxy in self.proxies)

    @property
    def delayed(self) -> int:
        return sum(proxy.delayed for proxy in self.proxies)

    def dsn_for(self, dsn: str) -> str:
        """``dsn`` (its user, database and query kept) with its hosts replaced by the proxies,
        in the order the proxies were given (the servers' order)."""
        parts = urlsplit(dsn)
        userinfo, at, _ = parts.netloc.rpartition("@")
        hosts = ",".join(f"127.0.0.1:{proxy.port}" for proxy in self.proxies)
        return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{hosts}"))
