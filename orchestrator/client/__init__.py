"""The client: what an application, the command line and the console use to talk to runs.

``Client`` (async) and ``SyncClient`` (``clients``), their feature handles (``runs``,
``features``), waiting for a run (``waiter``), a run's detail and how it reads (``detail``,
``attempts``), which runs a filter selects (``selection``), and the one bundle of stores the
client, the command line and the console share (``stores``). Names are imported on first use, so
``orchestrator.client.selection`` does not load the database driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy import lazy_exports

if TYPE_CHECKING:
    from orchestrator.client.clients import Client, SyncClient

_EXPORTS = {
    "Client": "orchestrator.client.clients",
    "SyncClient": "orchestrator.client.clients",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["Client", "SyncClient"]
