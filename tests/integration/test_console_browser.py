"""The web console in a real browser: Playwright driving Debian's chromium against the real stack.

Playwright cannot download its own browsers here: the tests launch the system's chromium
(`MILPA_CHROMIUM`, else `chromium` on the PATH). Screenshots of the inbox and of a session page are
saved under `test-artifacts/` (`MILPA_TEST_ARTIFACTS`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from deploy.harness import REPO, wait_for
from producers.store import deadline_in
from projections.redis_store import RedisProjectionStore
from session_model.policy import signature_question
from session_model.session import Question
from tests.integration.console_support import ConsoleStack

pytestmark = pytest.mark.integration

ARTIFACTS = Path(os.environ.get("MILPA_TEST_ARTIFACTS", REPO / "test-artifacts"))


def _chromium() -> str:
    found = os.environ.get("MILPA_CHROMIUM") or shutil.which("chromium")
    if not found:
        pytest.fail("chromium not found: apt-get install chromium (or set MILPA_CHROMIUM)")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        yield b
        b.close()


def _sign_in(page: Page, stack: ConsoleStack) -> None:
    page.goto(f"{stack.url}/inbox")
    expect(page).to_have_url(f"{stack.url}/login?next=%2Finbox")
    page.fill("#username", stack.username)
    page.fill("#password", stack.password)
    page.click("#sign-in")
    expect(page).to_have_url(f"{stack.url}/inbox")


def _ask(stack: ConsoleStack, question: Question | None = None) -> str:
    sid = f"b-{uuid.uuid4().hex[:8]}"
    stack.agent.start(sid, "rename the billing tables")
    deadline = deadline_in(datetime.now(UTC), 600)
    q = question or Question(
        "q1", "May I drop the old table?", ("yes", "no"), "cleanup", deadline, "permission"
    )
    stack.agent.ask(sid, q)
    return sid


def test_a_question_appears_live_is_answered_and_leaves_the_inbox(
    console_stack: ConsoleStack, browser: Browser
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    _sign_in(page, console_stack)
    expect(page.locator("#live-status")).to_have_attribute("data-state", "live", timeout=15_000)
    page.evaluate("window.__notReloaded = true")
    sid = _ask(console_stack)
    row = page.locator(f'li.question[data-session="{sid}"]')
    expect(row).to_be_visible(timeout=15_000)  # pushed by SSE: the page was not reloaded
    assert page.evaluate("window.__notReloaded") is True
    expect(row.locator(".badge.reason")).to_have_text("permission")
    expect(row.locator(".countdown")).not_to_be_empty()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "inbox.png"), full_page=True)

    # A second operator's tab keeps the inbox open: it sees the question leave, live.
    watcher = context.new_page()
    watcher.goto(f"{console_stack.url}/inbox")
    expect(watcher.locator(f'li.question[data-session="{sid}"]')).to_be_visible()
    expect(watcher.locator("#live-status")).to_have_attribute("data-state", "live", timeout=15_000)

    # Two clicks: the question, then the answer.
    row.locator("a.question-text").click()
    expect(page.locator("#session-status")).to_have_text("waiting")
    expect(page.locator("#open-question")).to_have_attribute("data-question", "q1")
    page.screenshot(path=str(ARTIFACTS / "session.png"), full_page=True)
    page.locator('button.answer-option[value="yes"]').click()
    expect(page.locator("#flash")).to_be_visible()

    expect(watcher.locator(f'li.question[data-session="{sid}"]')).to_have_count(0, timeout=15_000)
    wait_for(lambda: (s := console_stack.agent.find(sid)) is not None and s.is_runnable(), 60)
    page.reload()
    expect(page.locator("#session-status")).to_have_text("running")
    expect(page.locator("#decisions")).to_contain_text("operator:alice")
    page.goto(f"{console_stack.url}/")  # the fleet overview: its counts and charts render
    expect(page.locator("#fleet-totals")).to_be_visible()
    expect(page.locator("svg#pauses-chart")).to_be_visible()
    expect(page.locator("svg#tta-chart")).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "overview.png"), full_page=True)
    session = console_stack.agent.load(sid)
    by = session.decisions[-1].by
    assert by is not None and (by.id, by.verified) == ("operator:alice", True)
    context.close()


def test_a_signature_question_needs_a_deliberate_confirmation(
    console_stack: ConsoleStack, browser: Browser
) -> None:
    deadline = deadline_in(datetime.now(UTC), 600)
    call = signature_question("deploy", {"service": "billing", "replicas": 3}, deadline)
    sid = _ask(console_stack, call)
    wait_for(
        lambda: (s := console_stack.agent.find(sid)) is not None and s.question is not None, 60
    )
    context = browser.new_context(viewport={"width": 390, "height": 844})  # a phone
    page = context.new_page()
    _sign_in(page, console_stack)
    page.goto(f"{console_stack.url}/sessions/{sid}")
    expect(page.locator("#signed-operation")).to_have_text("deploy")
    expect(page.locator("#signed-call")).to_contain_text('"replicas":3')
    page.screenshot(path=str(ARTIFACTS / "session-signature-phone.png"), full_page=True)
    expect(page.locator("#sign-and-answer")).to_be_disabled()  # until the operation is typed
    page.fill("#confirm-operation", "deplo")
    expect(page.locator("#sign-and-answer")).to_be_disabled()
    assert console_stack.agent.load(sid).question is not None
    page.fill("#confirm-operation", "deploy")
    expect(page.locator("#sign-and-answer")).to_be_enabled()
    page.click("#sign-and-answer")
    wait_for(lambda: (s := console_stack.agent.find(sid)) is not None and s.question is None, 60)
    session = console_stack.agent.load(sid)
    assert session.approval_for(*call.signed_call()) is not None  # the call itself is approved
    context.close()


def test_an_entry_that_cannot_be_read_is_named_and_the_inbox_never_says_nothing_waits(
    console_stack: ConsoleStack, browser: Browser
) -> None:
    damaged, fine = _ask(console_stack), _ask(console_stack)
    wait_for(lambda: all(console_stack.agent.find(s) is not None for s in (damaged, fine)), 60)
    projections = console_stack.agent.projections
    assert isinstance(projections, RedisProjectionStore)
    cards = projections.keys.waiting_cards(projections.keys.partition_of(damaged))
    wait_for(lambda: projections.client.hexists(cards, damaged), 60)
    projections.client.hset(cards, damaged, b"{damaged")
    context = browser.new_context()
    page = context.new_page()
    _sign_in(page, console_stack)
    notice = page.locator("#inbox-unreadable")
    expect(notice).to_be_visible()
    expect(notice.locator(f'a[href="/sessions/{damaged}"]')).to_have_text(damaged)
    expect(page.locator(f'li.question[data-session="{fine}"]')).to_be_visible()
    expect(page.locator("#inbox-empty")).to_be_hidden()
    expect(page.locator("#live-status")).to_have_attribute("data-state", "live", timeout=15_000)
    console_stack.agent.end(fine, "done")  # its question leaves the inbox, live
    expect(page.locator(f'li.question[data-session="{fine}"]')).to_have_count(0, timeout=15_000)
    expect(page.locator("#inbox-empty")).to_be_hidden()  # the notice still names one
    context.close()
