"""A web application's handlers: start a refund run, list what awaits approval, record a person's
decision. Standard library only (``http.server``) with ``orchestrator.SyncClient``; the same
calls fit any framework (``Client`` for an async one).

    ORCHESTRATOR_DATABASE_URL=postgresql://... python examples/refund_desk.py --port 8080

    POST /refunds             {"request_id": "...", "message": "Refund order o-17"}  -> 202
    GET  /runs/RUN_ID         the run's state and result
    GET  /approvals           what awaits a decision: payload, its sha256, the run's fence
    POST /approvals/RUN/KEY   {"decision": "approve" | "deny", "payload_sha256": "...",
                               "fence": N, "note": "..."}

Who decides comes from the ``X-User`` header, standing in for your application's own
authentication: put this behind it. The audit log records the decision under the database role
the desk connects as (its principal); the ``X-User`` name is kept beside it as ``typed_by``.
A decision carries the payload hash and fence the person was shown, so approving a payload that
changed since (a replayed turn asked for another amount) or a run another attempt owns now is
refused (409), never applied to something nobody saw.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from orchestrator import (
    DecisionRefused,
    OrchestratorError,
    RunNotFound,
    SyncClient,
)
from orchestrator.jsontext import jsonable


def make_handler(client: SyncClient, agent: str) -> type[BaseHTTPRequestHandler]:
    class RefundDesk(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            parts = self.path.strip("/").split("/")
            body = self._body()
            if body is None:
                return
            if parts == ["refunds"]:
                # The request id makes a retried POST (a double click, a proxy retry) one run.
                run = client.submit(
                    agent,
                    {"message": str(body.get("message", ""))},
                    idempotency_key=f"refund-desk:{body.get('request_id')}",
                )
                self._send(HTTPStatus.ACCEPTED, {"run_id": run.run_id, "state": run.state})
            elif len(parts) == 3 and parts[0] == "approvals":
                self._decide(parts[1], parts[2], body)
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no route POST {self.path}"})

        def do_GET(self) -> None:
            parts = self.path.strip("/").split("/")
            if parts == ["approvals"]:
                pending = client.approvals()
                shown = [
                    {
                        "run_id": e.run_id,
                        "effect_key": e.effect_key,
                        "payload": e.payload,
                        "payload_sha256": e.payload_sha256,
                        "fence": client.get(e.run_id).fence,
                        "expires_at": e.approval_expires_at,
                    }
                    for e in pending
                ]
                self._send(HTTPStatus.OK, shown)
            elif len(parts) == 2 and parts[0] == "runs":
                self._guarded(lambda: self._send(HTTPStatus.OK, client.get(parts[1])))
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no route GET {self.path}"})

        def _decide(self, run_id: str, effect_key: str, body: dict[str, Any]) -> None:
            user = self.headers.get("X-User")
            if not user:
                self._send(HTTPStatus.UNAUTHORIZED, {"error": "who decides? (X-User)"})
                return
            decision = body.get("decision")
            options = {
                "by": user,
                "note": body.get("note"),
                "payload_sha256": body.get("payload_sha256"),
                "run_fence": body.get("fence"),
            }
            if decision == "approve" and not options["payload_sha256"]:
                self._send(HTTPStatus.BAD_REQUEST, {"error": "approve names the payload_sha256"})
                return
            if decision not in ("approve", "deny"):
                self._send(HTTPStatus.BAD_REQUEST, {"error": "decision is approve or deny"})
                return
            decide = client.approve if decision == "approve" else client.deny
            self._guarded(lambda: self._send(HTTPStatus.OK, decide(run_id, effect_key, **options)))

        def _guarded(self, action: Any) -> None:
            try:
                action()
            except DecisionRefused as refused:  # the person must look again
                self._send(HTTPStatus.CONFLICT, {"error": str(refused)})
            except RunNotFound as missing:
                self._send(HTTPStatus.NOT_FOUND, {"error": str(missing)})
            except OrchestratorError as error:
                self._send(HTTPStatus.BAD_REQUEST, {"error": str(error)})

        def _body(self) -> dict[str, Any] | None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError:
                body = None
            if not isinstance(body, dict):
                self._send(HTTPStatus.BAD_REQUEST, {"error": "the body must be a JSON object"})
                return None
            return body

        def _send(self, status: HTTPStatus, document: Any) -> None:
            data = json.dumps(jsonable(document)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet by default
            return

    return RefundDesk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--agent", default="refunds", help="The agent that handles refunds.")
    args = parser.parse_args()
    with SyncClient() as client:
        server = ThreadingHTTPServer((args.host, args.port), make_handler(client, args.agent))
        print(f"refund desk on http://{args.host}:{server.server_port}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()


if __name__ == "__main__":
    main()
