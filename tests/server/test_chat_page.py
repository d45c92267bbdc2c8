"""The chat page driven in headless Chromium (Debian's package) by Playwright: a message in, a streamed reply
out; thinking folded away; a reply stopped; the API key asked for and sent; tool calls shown."""

import json
import shutil

import pytest

from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import load

from .conftest import API_KEY, LiveServer, create_app, settled
from .toolmodel import QUESTION, THOUGHT, WEATHER

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium on PATH (.ci/run installs Debian's chromium package)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])  # playwright gives it a fresh profile
        yield browser
        browser.close()


def open_page(browser, url: str, model: str | None):
    page = browser.new_page()
    page.goto(url + "/")
    if model is not None:
        sync_api.expect(page.locator("#model")).to_have_text(model, timeout=10_000)
    return page


def send(page, text: str, think: bool = True, max_tokens: str = "200"):
    page.fill("#temperature", "0")
    page.fill("#max-tokens", max_tokens)
    page.set_checked("#think", think)
    page.fill("#input", text)
    page.click("#send")


def wait_done(page, timeout=60_000):
    page.wait_for_function("!document.querySelector('#send').disabled", timeout=timeout)


def test_send_a_message_and_see_the_reply_stream_in(server, browser, tmp_path):
    page = open_page(browser, server.url, "tiny")
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    send(page, "Hello, who are you?", think=False)
    page.wait_for_function("document.querySelector('.msg.assistant .content')?.textContent.length > 0", timeout=30_000)
    wait_done(page)
    assert page.locator(".msg.user").inner_text() == "Hello, who are you?"
    assert page.locator(".msg.assistant .content").inner_text().strip()
    assert page.locator(".error").count() == 0 and not page.locator("details.thinking").is_visible()
    page.screenshot(path=str(tmp_path / "chat.png"))
    assert all(u.startswith(server.url) for u in requests), "the page loads nothing from outside"
    page.close()


def test_thinking_is_folded_away(server, browser):
    """The tiny model thinks for the whole reply (it never closes <think>): all of it lands in the fold."""
    page = open_page(browser, server.url, "tiny")
    send(page, "Hello?")
    wait_done(page)
    fold = page.locator(".msg.assistant details.thinking")
    assert fold.is_visible() and fold.get_attribute("open") is None
    assert page.locator(".msg.assistant .reasoning").text_content().strip()
    assert not page.locator(".msg.assistant .reasoning").is_visible()  # folded
    fold.locator("summary").click()
    assert page.locator(".msg.assistant .reasoning").is_visible()
    page.close()


@pytest.fixture
def long_engine(tiny_gguf):
    """The tiny model with a context of 16k tokens and no end-of-sequence token: a reply to its end takes seconds,
    not the fraction of one that the shared engine's 512 take on a fast machine (a Stop clicked then finds the reply
    already done). Its greedy reply to "Hello?" ends with <|im_end|> after 644 tokens, half a second here, which
    a Stop clicked at once missed in 2 of 3 runs: without an end the reply runs to the context's."""
    model, tokenizer = load(tiny_gguf)
    tokenizer.eos_token_ids = set()
    eng = Engine(model, tokenizer, n_slots=1, max_len=16384, prefill_chunk=64, model_name="tiny")
    yield eng
    eng.close()


def test_stop_ends_the_reply_and_frees_the_slot(long_engine, browser):
    server = LiveServer(create_app(long_engine))
    page = open_page(browser, server.url, "tiny")
    send(page, "Hello?", think=False, max_tokens="")  # greedy, it would write to the context's end
    page.click("#stop")  # shown while the reply runs
    wait_done(page, timeout=10_000)
    assert not page.locator("#stop").is_visible() and page.locator(".error").count() == 0
    assert settled(long_engine, 20)  # the server saw the client leave and cancelled the request
    assert long_engine.metrics.generated_tokens_total < 16000
    page.close()
    server.stop()


def test_the_page_asks_for_the_api_key_and_sends_it(secured_server, browser):
    page = open_page(browser, secured_server.url, None)
    page.wait_for_selector("#keyform.shown", timeout=10_000)
    page.fill("#key", API_KEY)
    page.click("#keysave")
    sync_api.expect(page.locator("#model")).to_have_text("tiny", timeout=10_000)
    send(page, "Hi", think=False)
    wait_done(page)
    assert page.locator(".error").count() == 0 and not page.locator("#keyform").is_visible()
    page.close()


def test_tool_calls_are_shown(tool_server, browser):
    page = open_page(browser, tool_server.url, "tool")
    page.click("#settings summary")
    page.fill("#tools", json.dumps([WEATHER]))
    send(page, QUESTION)
    wait_done(page)
    assert page.locator(".tool-call").inner_text() == 'tool call: get_weather({"city": "Paris", "days": 3})'
    assert page.locator(".msg.assistant .reasoning").text_content() == THOUGHT
    assert page.locator(".error").count() == 0
    page.close()
