"""The chat page driven in headless Chromium (Debian's package) by Playwright: a message in, a streamed reply out."""

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium on PATH (.ci/run installs Debian's chromium package)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


def test_send_a_message_and_see_the_reply_stream_in(server, tmp_path):
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])  # playwright gives it a fresh profile
        try:
            page = browser.new_page()
            requests = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto(server.url + "/")
            assert page.locator("#model").inner_text(timeout=10_000) == "tiny"
            page.fill("#temperature", "0")
            page.fill("#input", "Hello, who are you?")
            page.click("#send")
            reply = page.locator(".msg.assistant").first
            page.wait_for_function("document.querySelector('.msg.assistant')?.textContent.length > 0", timeout=30_000)
            page.wait_for_function("!document.querySelector('#send').disabled", timeout=60_000)
            assert reply.inner_text().strip()
            assert page.locator(".msg.user").inner_text() == "Hello, who are you?"
            assert page.locator(".error").count() == 0
            page.screenshot(path=str(tmp_path / "chat.png"))
            assert all(u.startswith(server.url) for u in requests), "the page loads nothing from outside"
        finally:
            browser.close()
