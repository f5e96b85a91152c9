"""The chat page shows a reasoning model's thinking in a collapsed block above the answer
(issue 34, item 7): "Thinking…" while the model thinks, "Thought for N s" after, closed
until a click opens it, its text shown as text; the conversation sends each answer's
thinking back (`reasoning_content`), and keeps it across a reload.

Headless Chromium (support.browser) against `localrt start --foreground`, with the
remote model `thinker` (support.thinker): its upstream thinks, pauses, then answers.
"""

from __future__ import annotations

import re

import pytest
from support.browser import require_chromium, start_chromium
from support.servers import run_foreground_server
from support.thinker import ANSWER, THINKING, add_thinker, thinking_upstream
from test_web import last_reply, open_page, pick, say, wait

pytestmark = [pytest.mark.browser, pytest.mark.live]

require_chromium()

from selenium.webdriver.common.by import By  # noqa: E402

PAUSE = 1.6  # seconds the upstream thinks before it answers


@pytest.fixture(scope="module")
def upstream():
    with thinking_upstream(pause=PAUSE) as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory, upstream):
    srv = run_foreground_server(tmp_path_factory.mktemp("web-thinking-home"))
    add_thinker(srv.url, upstream)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory, server):
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"))
    open_page(driver, server.url)
    yield driver
    driver.quit()


def test_thinking_is_a_collapsed_block_above_the_answer(browser, server, upstream):
    pick(browser, "thinker")
    say(browser, "Hello")
    streaming = last_reply(browser, ("streaming",), 30)
    block = wait(browser, lambda d: streaming.find_elements(By.CSS_SELECTOR,
                                                            "details.thinking"),
                 30, "the thinking block")[0]
    assert block.find_element(By.TAG_NAME, "summary").text == "Thinking…"

    reply = last_reply(browser, ("done",), 60)
    block = reply.find_element(By.CSS_SELECTOR, "details.thinking")
    summary = block.find_element(By.TAG_NAME, "summary")
    assert re.fullmatch(r"Thought for [23] s", summary.text), summary.text
    assert block.get_attribute("open") is None  # collapsed: the text is not shown
    text = block.find_element(By.CSS_SELECTOR, ".thinking-text")
    assert not text.is_displayed()
    body = reply.find_element(By.CSS_SELECTOR, ".body")
    assert body.text == "".join(ANSWER)  # the answer alone
    # The block is above the answer.
    assert browser.execute_script(
        "return arguments[0].compareDocumentPosition(arguments[1]) & "
        "Node.DOCUMENT_POSITION_FOLLOWING", block, body)
    summary_text = summary.text
    summary.click()
    assert block.get_attribute("open") is not None and text.is_displayed()
    assert text.text == "".join(THINKING)

    # The next message sends the thinking back with the answer, for the template.
    say(browser, "Again")
    last_reply(browser, ("done",), 60)
    history = upstream.bodies[-1]["messages"]
    assert history[1]["role"] == "assistant" and history[1]["content"] == "".join(ANSWER)

    # A reload shows the conversation as it was: the thinking collapsed, with its time.
    open_page(browser, server.url)
    replies = browser.find_elements(By.CSS_SELECTOR, '[data-role="assistant"]')
    assert len(replies) == 2
    first = replies[0].find_element(By.CSS_SELECTOR, "details.thinking")
    assert first.find_element(By.TAG_NAME, "summary").text == summary_text
    assert first.get_attribute("open") is None
    # A remote model's capabilities do not say it reasons: no thinking switch.
    assert not browser.find_element(By.ID, "think-label").is_displayed()
