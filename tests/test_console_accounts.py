"""The console in accounts mode: people sign in as themselves (OpenID Connect through a real
provider on loopback, a personal token, or a trusted proxy's header) and their role decides what
they see and may do; every decision records the signed-in principal, in the timeline and the
audit trail. A real console process, real Chromium, a real PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from playwright.async_api import BrowserContext, expect

from orchestrator.access import PrincipalKind, Role
from orchestrator.db.access import AccessStore
from orchestrator.db.audit import AuditStore
from orchestrator.db.store import RunStore
from orchestrator.effect_model import EffectStatus
from orchestrator.effects.store import EffectStore
from support import cli
from support.oidc_provider import OidcProvider
from test_console import awaiting_approval, browser, console  # noqa: F401
from test_effects_proxy import free_port

pytestmark = pytest.mark.slow
PAYLOAD = {"order": "o-9", "amount": 120, "note": "refund-visible-to-approvers"}
SECRET = "console-oidc-secret-5b8e"


async def people(pool: asyncpg.Pool) -> dict[str, str]:
    """A viewer, an approver, an operator and a service, each with a token: name → token."""
    access = AccessStore(pool)
    tokens = {}
    for name, role, kind in (
        ("victor", Role.VIEWER, PrincipalKind.PERSON),
        ("alice@example.com", Role.APPROVER, PrincipalKind.PERSON),
        ("olga", Role.OPERATOR, PrincipalKind.PERSON),
        ("ops-bot", Role.OPERATOR, PrincipalKind.SERVICE),
    ):
        await access.set_principal(name, kind=kind, role=role)
        tokens[name] = (await access.create_token(name, expires_in=3600)).secret
    return tokens


async def parked(store: RunStore, pool: asyncpg.Pool) -> str:
    """A run with an effect the dispatcher parked (a vendor that never answered)."""
    run_id = await awaiting_approval(store, pool, {"order": "o-10", "amount": 5})
    await pool.execute(
        "UPDATE effects SET status = 'parked', requires_approval = false WHERE run_id = $1",
        run_id,
    )
    return run_id


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def status_of(pool: asyncpg.Pool, run_id: str) -> EffectStatus:
    return (await EffectStore(pool).get(run_id, "refund")).status


async def test_each_role_may_do_only_what_it_grants_through_the_api(
    database_url: str, tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    tokens = await people(pool)
    approval = await awaiting_approval(store, pool, PAYLOAD)
    stuck = await parked(store, pool)
    sha = (await EffectStore(pool).get(approval, "refund")).payload_sha256
    assert sha is not None
    async with (
        console(database_url, tmp_path, "--accounts") as running,
        httpx.AsyncClient(base_url=running.url, timeout=10) as http,
    ):
        approve = f"/runs/{approval}/effects/refund/approve"
        resolve = f"/runs/{stuck}/effects/refund/resolve"
        form = {"payload_sha256": sha}

        # Nobody signed in reads nothing: a browser is sent to sign in, a program gets 401.
        anonymous = await http.get("/attention")
        assert anonymous.status_code == 303 and anonymous.headers["location"].startswith(
            "/signin?next=/attention"
        )
        wrong = await http.get("/attention", headers=bearer("orc_aaaaaaaaaaaa_nope"))
        assert wrong.status_code == 401 and "token" in wrong.json()["error"]

        # A viewer reads sizes only and may not decide.
        page = await http.get("/attention", headers=bearer(tokens["victor"]))
        assert page.status_code == 200 and "refund-visible-to-approvers" not in page.text
        assert "hidden (" in page.text
        refused = await http.post(approve, data=form, headers=bearer(tokens["victor"]))
        assert refused.status_code == 403 and "may not approve" in refused.json()["error"]

        # An operator resolves but may not approve; an approver the other way round.
        refused = await http.post(approve, data=form, headers=bearer(tokens["olga"]))
        assert refused.status_code == 403
        refused = await http.post(
            resolve, data={"decision": "sent"}, headers=bearer(tokens["alice@example.com"])
        )
        assert refused.status_code == 403 and "may not resolve" in refused.json()["error"]
        assert await status_of(pool, approval) is EffectStatus.AWAITING_APPROVAL
        assert await status_of(pool, stuck) is EffectStatus.PARKED

        # The approver sees the payload awaiting their decision, and decides as themselves.
        page = await http.get("/attention", headers=bearer(tokens["alice@example.com"]))
        assert "refund-visible-to-approvers" in page.text
        typed = {**form, "by": "somebody else"}  # a typed name is not who decided
        decided = await http.post(approve, data=typed, headers=bearer(tokens["alice@example.com"]))
        assert decided.status_code == 200, decided.text
        done = await http.post(resolve, data={"decision": "sent"}, headers=bearer(tokens["olga"]))
        assert done.status_code == 200, done.text

        # A revoked token stops at once.
        await AccessStore(pool).revoke_token((await AccessStore(pool).tokens("olga"))[0].token_id)
        gone = await http.get("/attention", headers=bearer(tokens["olga"]))
        assert gone.status_code == 401

    granted = [e for e in await store.events(approval) if e.kind == "approval_granted"]
    assert [(e.details["by"], e.details["via"]) for e in granted] == [
        ("alice@example.com", "token")
    ]
    resolved = [e for e in await store.events(stuck) if e.kind == "effect_resolved"]
    assert [(e.details["by"], e.details["via"]) for e in resolved] == [("olga", "token")]
    audited = await AuditStore(pool).entries(action="approve")
    assert [(e.principal, e.via, e.run_id) for e in audited] == [
        ("alice@example.com", "token", approval)
    ]


async def test_sign_in_through_openid_connect_in_the_browser_and_approve_as_yourself(
    database_url: str,
    tmp_path: Path,
    store: RunStore,
    pool: asyncpg.Pool,
    browser: BrowserContext,  # noqa: F811
) -> None:
    await people(pool)
    approval = await awaiting_approval(store, pool, PAYLOAD)
    users: dict[str, dict[str, Any]] = {
        "alice@example.com": {"name": "Alice", "groups": ["approvers"]},
        "mallory@example.com": {"name": "Mallory", "groups": []},
    }
    with OidcProvider(users=users) as provider:
        args = ("--oidc-issuer", provider.issuer, "--oidc-client-id", "console")
        env = {"ORCHESTRATOR_OIDC_CLIENT_SECRET": SECRET}
        async with console(database_url, tmp_path, *args, env=env) as running:
            callback = f"{running.url}/signin/oidc/callback"
            provider.add_client("console", SECRET, [callback])
            page = await browser.new_page()
            await page.goto(f"{running.url}/attention")
            await expect(page).to_have_url(f"{running.url}/signin?next=/attention")
            await page.locator("#signin-oidc").click()
            await page.locator(OidcProvider.login_selector("alice@example.com")).click()
            await expect(page).to_have_url(f"{running.url}/attention")
            await expect(page.locator("#mode")).to_contain_text("alice@example.com (approver)")
            row = page.locator(f"tr.effect:has(a:text('{approval}'))")
            await expect(row).to_contain_text("refund-visible-to-approvers")
            assert await row.locator("input[name=by]").count() == 0  # no name to type
            await row.locator(".approve-form").get_by_role("button", name="approve").click()
            await expect(page.locator("#flash")).to_contain_text("approved refund")

            # Someone the provider knows but this console does not: refused, nothing changes.
            await page.locator("header").get_by_role("button", name="sign out").click()
            await page.goto(f"{running.url}/signin/oidc")
            await page.locator(OidcProvider.login_selector("mallory@example.com")).click()
            await expect(page.locator("main")).to_contain_text(
                "mallory@example.com is not a person allowed on this console"
            )
            await page.goto(f"{running.url}/attention")
            await expect(page).to_have_url(f"{running.url}/signin?next=/attention")
        assert provider.last_authorization_request["code_challenge_method"] == "S256"

    assert await status_of(pool, approval) is EffectStatus.ACCEPTED
    granted = [e for e in await store.events(approval) if e.kind == "approval_granted"]
    assert [(e.details["by"], e.details["via"]) for e in granted] == [("alice@example.com", "oidc")]
    rows = await AuditStore(pool).entries(principal="alice@example.com")
    assert [(e.action, e.via) for e in rows] == [("sign_in", "oidc"), ("approve", "oidc")]
    assert await AuditStore(pool).entries(principal="mallory@example.com") == []


async def test_a_personal_token_signs_in_and_its_revocation_ends_the_session(
    database_url: str,
    tmp_path: Path,
    store: RunStore,
    pool: asyncpg.Pool,
    browser: BrowserContext,  # noqa: F811
) -> None:
    tokens = await people(pool)
    approval = await awaiting_approval(store, pool, PAYLOAD)
    async with console(database_url, tmp_path, "--accounts") as running:
        page = await browser.new_page()
        await page.goto(f"{running.url}/runs")
        await page.fill("input[name=token]", tokens["ops-bot"])  # a service: refused
        await page.get_by_role("button", name="sign in").click()
        await expect(page.locator("main")).to_contain_text("a service's token cannot sign in")
        await page.goto(f"{running.url}/signin?next=/cluster")
        await page.fill("input[name=token]", tokens["victor"])
        await page.get_by_role("button", name="sign in").click()
        await expect(page).to_have_url(f"{running.url}/cluster")
        await expect(page.locator("#mode")).to_contain_text("victor (viewer)")
        await page.goto(f"{running.url}/attention")  # a viewer sees what waits, sizes only
        row = page.locator(f"tr.effect:has(a:text('{approval}'))")
        await expect(row).to_contain_text("your role may not act on this")
        await expect(row).not_to_contain_text("refund-visible-to-approvers")
        assert await row.get_by_role("button", name="approve").count() == 0
        cookies = "".join(str(cookie) for cookie in await browser.cookies())
        assert tokens["victor"] not in cookies
        revoked = cli(database_url, "users", "token", "revoke", _token_id(tokens["victor"]))
        assert revoked.returncode == 0, revoked.stderr
        await page.goto(f"{running.url}/runs")
        await expect(page).to_have_url(f"{running.url}/signin?next=/runs")


async def test_a_proxy_header_is_believed_only_from_a_trusted_address(
    database_url: str, tmp_path: Path, store: RunStore, pool: asyncpg.Pool
) -> None:
    await people(pool)
    approval = await awaiting_approval(store, pool, PAYLOAD)
    sha = (await EffectStore(pool).get(approval, "refund")).payload_sha256
    approve = f"/runs/{approval}/effects/refund/approve"
    as_alice = {"X-Forwarded-Email": "alice@example.com"}
    async with (
        console(database_url, tmp_path, "--trusted-proxy", "10.9.9.9/32") as untrusted,
        httpx.AsyncClient(base_url=untrusted.url, timeout=10) as http,
    ):
        page = await http.get("/attention", headers=as_alice)
        assert page.status_code == 403 and "not a --trusted-proxy" in page.text
        origin = {**as_alice, "Origin": untrusted.url}
        refused = await http.post(approve, data={"payload_sha256": sha}, headers=origin)
        assert refused.status_code == 403
        # The held-out spoof: a request from 127.0.0.1 naming the trusted proxy as the address
        # it was forwarded for. Only the peer that connected counts, whatever a header says.
        for spoof in (
            {"X-Forwarded-For": "10.9.9.9"},
            {"X-Forwarded-For": "10.9.9.9, 10.9.9.9", "X-Real-IP": "10.9.9.9"},
            {"Forwarded": "for=10.9.9.9;proto=https"},
        ):
            page = await http.get("/attention", headers={**as_alice, **spoof})
            assert page.status_code == 403 and "from 127.0.0.1" in page.text, spoof
            refused = await http.post(
                approve, data={"payload_sha256": sha}, headers={**origin, **spoof}
            )
            assert refused.status_code == 403, spoof
    assert await status_of(pool, approval) is EffectStatus.AWAITING_APPROVAL

    async with (
        console(database_url, tmp_path, "--trusted-proxy", "127.0.0.1") as trusted,
        httpx.AsyncClient(base_url=trusted.url, timeout=10) as http,
    ):
        stranger = await http.get("/attention", headers={"X-Forwarded-Email": "eve"})
        assert stranger.status_code == 403 and "eve is not a person" in stranger.text
        huge = await http.get("/attention", headers={"X-Forwarded-Email": "a" * 5000})
        assert huge.status_code == 403 and "must name one person" in huge.text
        page = await http.get("/attention", headers=as_alice)
        assert page.status_code == 200 and "alice@example.com (approver)" in page.text
        # A proxy on this host adds the address it forwarded for: still believed, since the
        # proxy is what connected.
        forwarded = {**as_alice, "X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"}
        page = await http.get("/attention", headers=forwarded)
        assert page.status_code == 200 and "alice@example.com (approver)" in page.text
        # A proxy that appends its header after the client's would leave the client's first.
        twice = [("X-Forwarded-Email", "olga"), ("X-Forwarded-Email", "alice@example.com")]
        page = await http.get("/attention", headers=twice)
        assert page.status_code == 403 and "must come once" in page.text
        # The header rides on every request the browser makes, so a form needs our Origin.
        forged = await http.post(approve, data={"payload_sha256": sha}, headers=as_alice)
        assert forged.status_code == 403 and "Origin" in forged.text
        origin = {**as_alice, "Origin": trusted.url}
        decided = await http.post(approve, data={"payload_sha256": sha}, headers=origin)
        assert decided.status_code == 303, decided.text
    granted = [e for e in await store.events(approval) if e.kind == "approval_granted"]
    assert [(e.details["by"], e.details["via"]) for e in granted] == [
        ("alice@example.com", "proxy-header")
    ]


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (("--accounts",), {"ORCHESTRATOR_CONSOLE_TOKEN": "x" * 20}, "choose one"),
        (("--trusted-proxy", "not-an-address"), {}, "--trusted-proxy takes an address"),
        (("--oidc-client-id", "c"), {}, "need --oidc-issuer"),
        (("--oidc-issuer", "ftp://x", "--oidc-client-id", "c"), {}, "http(s) URL"),
        (("--oidc-issuer", "http://127.0.0.1:1"), {}, "needs --oidc-client-id"),
        (("--oidc-group", "ops=operator"), {}, "need --oidc-issuer"),
        (
            ("--oidc-issuer", "http://127.0.0.1:1", "--oidc-group", "ops=root"),
            {"ORCHESTRATOR_OIDC_CLIENT_SECRET": "s"},
            "GROUP=ROLE",
        ),
    ],
)
def test_bad_accounts_options_are_one_line_errors(
    database_url: str, args: tuple[str, ...], env: dict[str, str], says: str
) -> None:
    result = cli(database_url, "console", "--listen", f"127.0.0.1:{free_port()}", *args, env=env)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: ") and says in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


def _token_id(token: str) -> str:
    return token.split("_")[1]


async def sign_in_through(http: httpx.AsyncClient, console_url: str, email: str) -> httpx.Response:
    """The authorization code flow as a browser follows it: to the provider's login page, its
    button for ``email``, and back to the console's callback."""
    login = await http.get(f"{console_url}/signin/oidc", follow_redirects=True)
    assert login.status_code == 200 and email in login.text, login.text
    return await http.post(str(login.url), data={"user": email}, follow_redirects=True)


async def test_the_providers_groups_decide_the_role_when_mapped(
    database_url: str, tmp_path: Path, pool: asyncpg.Pool
) -> None:
    access = AccessStore(pool)
    await access.set_principal("dana@example.com", kind=PrincipalKind.PERSON, role=Role.ADMIN)
    await access.disable("dana@example.com")
    users: dict[str, dict[str, Any]] = {
        "gina@example.com": {"name": "Gina", "groups": ["staff", "approvers"]},
        "olga@example.com": {"name": "Olga", "groups": ["approvers", "ops"]},
        "hank@example.com": {"name": "Hank", "groups": ["contractors"]},
        "dana@example.com": {"name": "Dana", "groups": ["ops"]},
    }
    with OidcProvider(users=users) as provider:
        args = (
            *("--oidc-issuer", provider.issuer, "--oidc-client-id", "console"),
            *("--oidc-group", "ops=operator", "--oidc-group", "approvers=approver"),
        )
        env = {"ORCHESTRATOR_OIDC_CLIENT_SECRET": SECRET}
        async with console(database_url, tmp_path, *args, env=env) as running:
            provider.add_client("console", SECRET, [f"{running.url}/signin/oidc/callback"])
            seen = {}
            for email in users:
                async with httpx.AsyncClient(timeout=10) as http:
                    seen[email] = await sign_in_through(http, running.url, email)
        assert "groups" in provider.last_authorization_request["scope"].split()
    assert "gina@example.com (approver)" in seen["gina@example.com"].text
    assert "olga@example.com (operator)" in seen["olga@example.com"].text  # the first listed
    assert seen["hank@example.com"].status_code == 403
    assert "none of the groups" in seen["hank@example.com"].text
    assert seen["dana@example.com"].status_code == 403  # disabled stays out, whatever the groups
    roles = {entry.principal.name: entry.principal.role for entry in await access.principals()}
    assert roles == {
        "gina@example.com": Role.APPROVER,
        "olga@example.com": Role.OPERATOR,
        "dana@example.com": Role.ADMIN,
    }
    added = await AuditStore(pool).entries(action="principal_added")
    assert {(row.principal, row.via) for row in added} >= {
        ("gina@example.com", "oidc"),
        ("olga@example.com", "oidc"),
    }


@pytest.mark.parametrize("secure", [False, True])
async def test_the_session_cookie_is_http_only_and_secure_when_asked(
    database_url: str, tmp_path: Path, pool: asyncpg.Pool, secure: bool
) -> None:
    tokens = await people(pool)
    args = ("--accounts", "--secure-cookies") if secure else ("--accounts",)
    async with (
        console(database_url, tmp_path, *args) as running,
        httpx.AsyncClient(base_url=running.url, timeout=10) as http,
    ):
        form = {"token": tokens["victor"], "next": "/runs"}
        signed = await http.post("/signin", data=form, headers={"Origin": running.url})
    assert signed.status_code == 303 and signed.headers["location"] == "/runs"
    cookie = signed.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=lax" in cookie
    assert ("secure" in cookie.split("; ")) is secure
    assert tokens["victor"].lower() not in cookie
