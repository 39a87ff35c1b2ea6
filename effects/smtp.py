"""The ``smtp`` vendor: email through a real SMTP server (``SmtpAdapter``)."""

from __future__ import annotations

import smtplib
from email.message import EmailMessage

import anyio

from orchestrator.effect_model import EffectRecord
from orchestrator.effects.adapters import (
    Confirmed,
    Failed,
    Park,
    ReconcileOutcome,
    Retry,
    SendOutcome,
    Uncertain,
    secret_from,
)


class SmtpAdapter:
    """Email through a real SMTP server. The Message-ID is derived from the idempotency key, so
    a receiving system can drop a duplicate; but SMTP offers no lookup, so an uncertain send is
    parked for a person, never resent. Payload: ``{"to", "subject", "body"}``."""

    def __init__(
        self,
        kind: str,
        *,
        host: str,
        port: int = 25,
        sender: str,
        username: str | None = None,
        password_env: str | None = None,
        starttls: bool = False,
        timeout_seconds: float = 10.0,
    ) -> None:
        self.kind = kind
        self.host = host
        self.port = port
        self.sender = sender
        self.username = username
        self.password = secret_from(None, password_env)
        self.starttls = starttls
        self.timeout = timeout_seconds

    def message(self, effect: EffectRecord) -> EmailMessage:
        payload = effect.payload if isinstance(effect.payload, dict) else {}
        message = EmailMessage()
        message["From"] = self.sender
        message["To"] = str(payload.get("to", ""))
        message["Subject"] = str(payload.get("subject", ""))
        message["Message-ID"] = f"<{effect.idempotency_key}@orchestrator>"
        message.set_content(str(payload.get("body", "")))
        return message

    async def send(self, effect: EffectRecord) -> SendOutcome:
        message = self.message(effect)
        if not message["To"]:
            return Failed("payload has no 'to' address")
        return await anyio.to_thread.run_sync(self._send, message, abandon_on_cancel=True)

    def _send(self, message: EmailMessage) -> SendOutcome:
        try:
            client = smtplib.SMTP(self.host, self.port, timeout=self.timeout)
        except (OSError, smtplib.SMTPException) as error:
            return Retry(f"could not connect: {error}")
        with client:
            try:
                client.ehlo()
                if self.starttls:
                    client.starttls()
                if self.username and self.password:
                    client.login(self.username, self.password)
                code, reply = client.mail(self.sender)
                if code >= 400:
                    return _refused(code, reply)
                code, reply = client.rcpt(message["To"])
                if code >= 400:
                    return _refused(code, reply)
            except (OSError, smtplib.SMTPException) as error:
                return Retry(f"refused before any data was sent: {error}")
            try:
                # From here on the server may have the message: any failure is uncertain.
                code, reply = client.data(message.as_bytes())
            except smtplib.SMTPResponseException as error:
                if 400 <= error.smtp_code < 600:
                    return _refused(error.smtp_code, error.smtp_error)
                return Uncertain(str(error))
            except (OSError, smtplib.SMTPException) as error:
                return Uncertain(f"connection lost during DATA: {error}")
        return Confirmed(message["Message-ID"], {"smtp_reply": f"{code} {reply!r}"})

    async def reconcile(self, effect: EffectRecord) -> ReconcileOutcome:
        return Park("SMTP cannot be looked up: a person must check whether the email went out")

    async def aclose(self) -> None:
        """Each send uses its own SMTP session: nothing to release."""


def _refused(code: int, reply: bytes | str) -> SendOutcome:
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else reply
    if 400 <= code < 500:
        return Retry(f"SMTP {code}: {text}")
    return Failed(f"SMTP {code}: {text}")
