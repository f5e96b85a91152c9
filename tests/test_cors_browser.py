"""CORS in a real browser: headless Chromium, driven by Selenium through Debian's chromedriver.

A page served from another loopback origin (another port) calls fetch() against a
real localrt server. The browser, not this test, decides whether the page may read
the answer: it must when the origin is allowed, and must block it when the origin
is not allowed or when cors is off.

The browser is support.browser's: skipped without Chromium, but under CI.
"""

from __future__ import annotations

import http.server
import threading

import pytest
from support.browser import require_chromium, start_chromium
from support.servers import send

pytestmark = [pytest.mark.browser, pytest.mark.live]

require_chromium()

PAGE = b"<!doctype html><title>elsewhere</title><p>a page on another origin</p>"

# Runs in the page: fetch and report what the page could see.
FETCH = """
const [url, method, body, done] = arguments;
const init = {method: method};
if (body !== null) {
  init.body = body;
  init.headers = {"Content-Type": "application/json"};
}
fetch(url, init)
  .then(r => r.text().then(t => done({status: r.status, body: t})))
  .catch(e => done({blocked: String(e)}));
"""


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def page():
    """An HTML page on http://127.0.0.1:<another port>: the foreign origin."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


def fetch_from(browser, page, url, method="GET", body=None) -> dict:
    """Open the page afresh and fetch from it."""
    browser.get(page + "/")
    return fetch_again(browser, url, method, body)


def fetch_again(browser, url, method="GET", body=None) -> dict:
    """Fetch from the page the browser has open now."""
    return browser.execute_async_script(FETCH, url, method, body)


# A blocked fetch looks the same to the page as any network failure ("TypeError: Failed
# to fetch"). So each blocked case is followed, in the same page, by the same fetch once
# the server lets the page's origin in: it must then get through.


def test_an_allowed_origin_reads_the_answer(browser, page, live_server):
    send(live_server.url, "PATCH", "/v1/configs", {"cors": True, "allowed_origins": [page]})
    got = fetch_from(browser, page, live_server.url + "/v1/models")
    assert got.get("status") == 200, got
    assert '"object": "list"' in got["body"]  # the page could read it
    # A JSON POST is not a "simple" request: the browser sends a preflight first.
    got = fetch_from(browser, page, live_server.url + "/v1/models/pull", "POST",
                     '{"model": "../escape"}')
    assert got.get("status") == 400 and "invalid_field" in got["body"], got


def test_an_origin_not_allowed_is_blocked_by_the_browser(browser, page, live_server):
    send(live_server.url, "PATCH", "/v1/configs",
         {"cors": True, "allowed_origins": ["http://127.0.0.1:1"]})
    got = fetch_from(browser, page, live_server.url + "/v1/models")
    assert "blocked" in got and "status" not in got, got
    got = fetch_again(browser, live_server.url + "/v1/configs", "PATCH", '{"cors": false}')
    assert "blocked" in got, got
    status, config = send(live_server.url, "GET", "/v1/configs")
    assert config["cors"] is True  # the blocked preflight kept the PATCH from being sent

    send(live_server.url, "PATCH", "/v1/configs", {"allowed_origins": [page]})
    got = fetch_again(browser, live_server.url + "/v1/models")
    assert got.get("status") == 200, got
    got = fetch_again(browser, live_server.url + "/v1/configs", "PATCH", '{"cors": false}')
    assert got.get("status") == 200, got
    assert send(live_server.url, "GET", "/v1/configs")[1]["cors"] is False


def test_with_cors_off_the_browser_blocks_every_origin(browser, page, live_server):
    send(live_server.url, "PATCH", "/v1/configs", {"allowed_origins": [page], "cors": False})
    got = fetch_from(browser, page, live_server.url + "/v1/models")
    assert "blocked" in got and "status" not in got, got

    send(live_server.url, "PATCH", "/v1/configs", {"cors": True})
    got = fetch_again(browser, live_server.url + "/v1/models")
    assert got.get("status") == 200, got
