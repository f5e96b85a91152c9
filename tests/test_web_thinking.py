"""The chat page shows a reasoning model's thinking in a collapsed block above the answer
(issue 34, item 7): "Thinking…" while the model thinks, "Thought for N s" after, closed
until a click opens it, its text shown as text; the conversation sends each answer's
thinking back (`reasoning_content`), and keeps it across a reload.

Headless Chromium (support.browser) against `localrt start --foreground`, with the
remote model `thinker` (support.thinker): its upstream thinks, pauses, then answers;
and a local scripted model with QwQ's template, `qwq`, for the page's thinking switch.
"""

from __future__ import annotations

import re

import pytest
from support.browser import require_chromium, start_chromium
from support.servers import run_foreground_server
from support.models import add_model
from support.thinker import ANSWER, THINKING, add_thinker, thinking_upstream, write_qwq
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
    qwq = write_qwq(tmp_path_factory.mktemp("qwq") / "qwq.gguf")
    add_model(srv.url, qwq, "qwq", stored={"temperature": 0, "cpu_threads": 1,
                                           "max_tokens": 16})
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


def test_the_thinking_switch_of_a_model_that_reasons(browser, server):
    find = browser.find_element
    browser.find_element(By.ID, "new-chat").click()
    pick(browser, "qwq")
    switch = find(By.ID, "think")
    assert find(By.ID, "think-label").is_displayed() and switch.is_selected()
    say(browser, "Which is larger, 7 or 9?")
    reply = last_reply(browser, ("done",), 60)
    block = reply.find_element(By.CSS_SELECTOR, "details.thinking")
    block.find_element(By.TAG_NAME, "summary").click()
    assert block.find_element(By.CSS_SELECTOR, ".thinking-text").text == "so we"
    assert reply.find_element(By.CSS_SELECTOR, ".body").text == "ok"

    switch.click()  # off: the template's own switch, no thinking
    assert not switch.is_selected()
    say(browser, "And 3 or 2?")
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR,
                                                '[data-role="assistant"]')) == 2,
         30, "a second reply")
    reply = last_reply(browser, ("done",), 60)
    assert not reply.find_elements(By.CSS_SELECTOR, "details.thinking")
    assert reply.find_element(By.CSS_SELECTOR, ".body").text == "ok"
    # The conversation keeps the switch: a reload shows it off.
    open_page(browser, server.url)
    assert not find(By.ID, "think").is_selected()
