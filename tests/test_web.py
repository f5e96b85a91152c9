"""The chat page (GET /, localrt/web/) in a real browser: headless Chromium driven by
Selenium (support.browser), against `localrt start --foreground` with real generated
models, so every reply really streams from llama.cpp.

The models: `guide` and `xss` are scripted (ggufgen's `script`): they always answer the
same text, Markdown for `guide`, markup and script links for `xss`. `slow` is a random
model, quantized, that answers greedily with hundreds of tokens a second and no end of
its own for thousands: a reply that is still streaming when the test stops it.
"""

from __future__ import annotations

import json
import time
import urllib.request

import gguf
import pytest
from emulators.ggufgen import write_gguf
from support.browser import require_chromium, start_chromium
from support.models import NO_DRAFTS
from support.servers import run_foreground_server, send
from support.waiting import wait_for

from localrt import settings as settings_mod
from localrt import web

pytestmark = [pytest.mark.browser, pytest.mark.live]

require_chromium()

from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

USER = gguf.TokenType.USER_DEFINED
# What `guide` answers, a token a part: Markdown with a table, code and a link.
GUIDE = ["The sky looks blue because air scatters **short wavelengths** of sunlight ",
         "more than long ones: *Rayleigh scattering*.\n\n",
         "| Colour | Wavelength |\n|:--|--:|\n| blue | ~450 nm |\n| red | ~700 nm |\n\n",
         "```python\ndef scattering(wavelength):\n    return 1 / wavelength ** 4\n```\n\n",
         "- shorter waves scatter more\n- so the sky is blue, and sunsets red\n\n",
         "See [Rayleigh scattering](https://en.wikipedia.org/wiki/Rayleigh_scattering)."]
IMG = "<img src=x onerror=\"document.title='pwned'\">"
XSS = [IMG, "\n\n", "[click me](javascript:document.title='pwned')",
       " and <a href=\"javascript:alert('pwned')\">this</a> ",
       "<script>alert('pwned')</script>", " <javascript:alert('pwned')>"]
HOSTILE_ID = "\"><svg onload=alert('pwned')>"
TITLE = "localrt"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, slow_gguf):
    root = tmp_path_factory.mktemp("web-models")
    return {
        "guide": write_gguf(root / "guide.gguf", name="guide", vocab_size=400,
                            context_length=1024, added_tokens=[(t, USER) for t in GUIDE],
                            script=GUIDE),
        "xss": write_gguf(root / "xss.gguf", name="xss", vocab_size=400, context_length=1024,
                          added_tokens=[(t, USER) for t in XSS], script=XSS),
        "slow": slow_gguf,
    }


def start_server(home, ggufs, **rc):
    """A real server in a fresh home with the models imported (one CPU thread each, and
    one slot for `slow`) and the settings `rc`."""
    settings_mod.load(environ={"HOME": str(home)}).update(rc)
    srv = run_foreground_server(home)
    headers = {"Authorization": f"Bearer {rc['apiKeys'][0]}"} if rc.get("apiKeys") else {}
    for model_id, path in ggufs.items():
        body = {"path": str(path), "id": model_id}
        assert request(srv.url, "POST", "/v1/models/import", body, headers)[0] == 200
        params = {"cpu_threads": 1, "ctx_len": 4096, "n_parallel": 1, **NO_DRAFTS}
        assert request(srv.url, "PATCH", f"/v1/models/{model_id}", params, headers)[0] == 200
    return srv


def request(url, method, path, body=None, headers=None):
    """One JSON request with headers: (status, decoded reply)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory, ggufs, module_hub):
    """The server the page comes from, pulling from the hub emulator: org/pulled."""
    module_hub.add_repo("org/pulled", {"pulled.gguf": ggufs["guide"]})
    srv = start_server(tmp_path_factory.mktemp("web-home"), ggufs, modelHubUrl=module_hub.url)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"), logs=True)
    yield driver
    driver.quit()


@pytest.fixture
def browser(chromium, server):
    """The browser with this server's page open and nothing stored from earlier tests."""
    chromium.get(server.url + "/web/icon.svg")  # same origin: its storage can be cleared
    chromium.execute_script("localStorage.clear(); sessionStorage.clear();")
    chromium.get_log("browser")
    open_page(chromium, server.url)
    return chromium


def open_page(driver, url):
    driver.get(url + "/")
    wait(driver, lambda d: d.execute_script("return document.body.dataset.ready"), 30,
         "the page loads its models")


def wait(driver, condition, timeout=30, what="condition"):
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(condition, what)


def find(driver, css):
    return driver.find_element(By.CSS_SELECTOR, css)


def labelled(driver, label):
    return find(driver, f'[aria-label="{label}"]')


def pick(driver, model_id):
    """Choose a model as a person does; it starts if it is not running."""
    select = labelled(driver, "Model")
    if select.get_attribute("value") == model_id:  # choosing it again changes nothing
        driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", select)
    else:
        Select(select).select_by_value(model_id)
    wait(driver, lambda d: d.execute_script(
        "const o = [...document.querySelectorAll('#model option')]"
        ".find(o => o.value === arguments[0]); return o && o.textContent.includes('running')",
        model_id), 60, f"{model_id} runs")


def settings_of(driver, temperature=None, max_tokens=None, system=None):
    """Fill the conversation's settings, as a person does (Tab leaves each field)."""
    toggle = find(driver, "#settings-toggle")
    if toggle.get_attribute("aria-expanded") != "true":
        toggle.click()
    for label, value in (("Temperature", temperature), ("Max tokens", max_tokens),
                         ("System prompt", system)):
        if value is not None:
            field = labelled(driver, label)
            field.clear()
            field.send_keys(str(value), Keys.TAB)


def say(driver, text):
    box = labelled(driver, "Message")
    box.send_keys(text, Keys.ENTER)


def last_reply(driver, states=("done",), timeout=60):
    """The last assistant message once its state is one of `states`."""
    def done(d):
        items = d.find_elements(By.CSS_SELECTOR, '[data-role="assistant"]')
        return items[-1] if items and items[-1].get_attribute("data-state") in states else None
    return wait(driver, done, timeout, f"a reply in state {states}")


def requests_of(url, model_id):
    status, body = send(url, "GET", "/v1/models/status")
    return {row["id"]: row["requests"] for row in body["data"]}.get(model_id, 0)


# Records, in the page, each text the last assistant message has shown and each text
# of the model's status: MutationObservers see every change, however fast.
RECORD = """
window.seen = {reply: [], state: []};
const state = document.getElementById('model-state');
new MutationObserver(() => window.seen.state.push(state.textContent))
  .observe(state, {childList: true, characterData: true, subtree: true});
new MutationObserver(() => {
  const all = document.querySelectorAll('[data-role="assistant"] .body');
  if (all.length) window.seen.reply.push(all[all.length - 1].textContent);
}).observe(document.getElementById('messages'),
           {childList: true, characterData: true, subtree: true});
"""


# --- the page's files, through the app in process -------------------------------------


def test_every_file_of_the_page_has_the_security_headers(api):
    names = web.names()
    assert {"index.html", "app.js", "api.js", "markdown.js", "store.js", "style.css",
            "icon.svg"} <= set(names)
    for path in ["/"] + [f"/web/{name}" for name in names]:
        r = api("GET", path)
        assert r.status == 200, path
        assert r.headers["content-security-policy"] == web.CSP
        assert "script-src 'self';" in web.CSP and "unsafe" not in web.CSP
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["referrer-policy"] == "no-referrer"
    assert api("GET", "/").headers["content-type"] == "text/html; charset=utf-8"
    assert api("GET", "/web/app.js").headers["content-type"] == "text/javascript; charset=utf-8"
    total = sum(len(api("GET", f"/web/{name}").body) for name in names)
    print(f"the page is {len(names)} files, {total} bytes")
    assert total < 150 * 1024


def test_no_inline_script_and_no_other_origin_in_the_files(api):
    for name in web.names():
        text = api("GET", f"/web/{name}").body.decode()
        assert "innerHTML" not in text and "eval(" not in text and "new Function" not in text
        assert "insertAdjacentHTML" not in text and "document.write" not in text, name
    html = api("GET", "/").body.decode()
    assert '<script type="module" src="/web/app.js"></script>' in html
    assert html.count("<script") == 1 and "style=" not in html and " onclick" not in html
    assert "//" not in html  # every URL is this server's own path


def test_files_that_are_not_the_pages_are_404(api):
    for path in ("/web/__init__.py", "/web/..", "/web/%2e%2e", "/web/nothing.js", "/web/",
                 "/index.html"):
        r = api("GET", path)
        assert r.status == 404, path
        assert r.json["error"]["code"] == "not_found"


def test_web_ui_false_makes_the_page_a_404(settings, app, api):
    settings.update({"webUi": False})
    for path in ("/", "/web/app.js"):
        r = api("GET", path)
        assert r.status == 404 and "webUi" in r.json["message"], path
    assert api("GET", "/v1/models").status == 200  # the API is still there
    settings.update({"webUi": True})
    assert api("GET", "/").status == 200


def test_the_page_needs_no_key_but_the_api_does(settings, app, api):
    settings.update({"apiKeys": ["sesame-key"]})
    assert api("GET", "/").status == 200 and api("GET", "/web/app.js").status == 200
    assert api("GET", "/v1/models").status == 401
    assert api("GET", "/web/x/../../v1/models").status == 401  # not a file of the page
    assert api("GET", "/v1/models", headers={"Authorization": "Bearer sesame-key"}).status == 200


# --- in the browser -----------------------------------------------------------------


def test_pick_send_and_see_the_reply_grow(browser, server, tmp_path):
    browser.execute_script(RECORD)
    options = browser.execute_script(
        "return [...document.querySelectorAll('#model option')].map(o => o.value)")
    assert set(options) == {"guide", "xss", "slow"}
    pick(browser, "slow")
    states = browser.execute_script("return window.seen.state")
    assert "starting slow…" in states, states  # the page said it was starting
    # running models come first, marked
    first = find(browser, "#model optgroup")
    assert first.get_attribute("label") == "Running"
    assert first.find_element(By.TAG_NAME, "option").text == "● slow (running)"
    # no "vision" in its capabilities: no attach button
    assert not find(browser, '[aria-label="Attach image"]').is_displayed()

    settings_of(browser, temperature=0, max_tokens=300)
    box = labelled(browser, "Message")
    box.send_keys("Hello", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "there")
    assert box.get_attribute("value") == "Hello\nthere"  # Shift+Enter: a new line
    assert not find(browser, '[aria-label="Stop"]').is_displayed()
    box.send_keys(Keys.ENTER)
    reply = last_reply(browser, ("streaming",), 10)
    assert find(browser, '[aria-label="Stop"]').is_displayed()
    reply = last_reply(browser, ("done",), 60)
    user = browser.find_elements(By.CSS_SELECTOR, '[data-role="user"]')
    assert [u.text for u in user] == ["Hello\nthere"]
    assert box.get_attribute("value") == ""
    shown = [t for t in browser.execute_script("return window.seen.reply") if t]
    lengths = sorted(set(len(t) for t in shown))
    # The reply grew in steps as tokens came, each text the start of the next.
    assert len(lengths) >= 3, lengths
    assert all(shown[k + 1].startswith(shown[k]) for k in range(len(shown) - 1))
    assert reply.find_element(By.CSS_SELECTOR, ".body").text.strip()
    assert find(browser, '[aria-label="Send"]').is_displayed()
    assert not find(browser, '[aria-label="Stop"]').is_displayed()
    browser.save_screenshot(str(tmp_path / "streamed.png"))


def test_a_finished_conversation_renders_markdown(browser, server, tmp_path):
    pick(browser, "guide")
    say(browser, "Why is the sky blue?")
    body = last_reply(browser).find_element(By.CSS_SELECTOR, ".body")
    assert body.find_element(By.TAG_NAME, "strong").text == "short wavelengths"
    assert body.find_element(By.TAG_NAME, "em").text == "Rayleigh scattering"
    cells = [c.text for c in body.find_elements(By.CSS_SELECTOR, "td")]
    assert cells == ["blue", "~450 nm", "red", "~700 nm"]
    code = body.find_element(By.CSS_SELECTOR, "pre code")
    assert code.text.startswith("def scattering(wavelength):")
    assert body.find_element(By.CSS_SELECTOR, '[aria-label="Copy code"]').is_displayed()
    assert len(body.find_elements(By.CSS_SELECTOR, "ul li")) == 2
    link = body.find_element(By.TAG_NAME, "a")
    assert link.get_attribute("href") == "https://en.wikipedia.org/wiki/Rayleigh_scattering"
    assert link.get_attribute("rel") == "noopener noreferrer"
    shot = tmp_path / "page.png"
    browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10000


def test_stop_mid_reply_frees_the_slot(browser, server):
    pick(browser, "slow")
    settings_of(browser, temperature=0, max_tokens=3000)
    say(browser, "Tell me a long story")
    wait(browser, lambda d: len(last_reply(d, ("streaming",)).text) > 40, 30,
         "the reply streams")
    assert requests_of(server.url, "slow") == 1  # its one slot is taken
    stop = labelled(browser, "Stop")
    stop.click()
    stopped = last_reply(browser, ("stopped",), 10)
    assert "stopped" in stopped.text
    assert not stop.is_displayed() and labelled(browser, "Send").is_displayed()
    # The server saw the hang-up and freed the slot: the next request gets it at once,
    # where the rest of the 3000-token reply would have taken tens of seconds.
    freed = wait_for(lambda: requests_of(server.url, "slow") == 0, 3, "the slot is held")
    started = time.monotonic()
    status, reply = send(server.url, "POST", "/v1/chat/completions", {
        "model": "slow", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
        "logit_bias": {"2": -100}}, timeout=60)
    answered = time.monotonic() - started
    print(f"freed after {freed:.2f} s; the next reply took {answered:.2f} s")
    assert status == 200 and reply["usage"]["completion_tokens"] == 8
    assert answered < 5
    # The stopped reply is kept, marked, with what came before Stop.
    browser.refresh()
    open_page(browser, server.url)
    replies = browser.find_elements(By.CSS_SELECTOR, '[data-role="assistant"]')
    assert replies[-1].find_element(By.CSS_SELECTOR, ".note").text == "stopped"


def test_conversations_stay_across_a_reload(browser, server):
    pick(browser, "guide")
    say(browser, "First question")
    last_reply(browser)
    find(browser, "#new-chat").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#messages li") == []
    settings_of(browser, system="Answer briefly.", temperature=0.5, max_tokens=64)
    say(browser, "Second question")
    last_reply(browser)
    titles = [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#conversations .title")]
    assert titles == ["Second question", "First question"]
    # rename the first, from the keyboard
    first = browser.find_elements(By.CSS_SELECTOR, "#conversations li")[1]
    first.find_element(By.CSS_SELECTOR, '[aria-label="Rename conversation"]').send_keys(
        Keys.ENTER)
    title = labelled(browser, "Conversation title")
    title.send_keys(Keys.CONTROL, "a")
    title.send_keys("Sky <b>talk</b>", Keys.ENTER)

    browser.refresh()
    open_page(browser, server.url)
    titles = [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#conversations .title")]
    assert titles == ["Second question", "Sky <b>talk</b>"]  # a title is text, never HTML
    assert [u.text for u in browser.find_elements(By.CSS_SELECTOR, '[data-role="user"]')] \
        == ["Second question"]
    # its settings came back with it
    assert labelled(browser, "System prompt").get_attribute("value") == "Answer briefly."
    assert labelled(browser, "Temperature").get_attribute("value") == "0.5"
    assert labelled(browser, "Max tokens").get_attribute("value") == "64"
    find(browser, "#conversations li:nth-child(2) .title").click()
    assert [u.text for u in browser.find_elements(By.CSS_SELECTOR, '[data-role="user"]')] \
        == ["First question"]
    assert len(browser.find_elements(By.CSS_SELECTOR, '[data-role="assistant"]')) == 1
    assert labelled(browser, "System prompt").get_attribute("value") == ""
    # delete the other one; a reload keeps it gone
    find(browser, '#conversations li:nth-child(1) [aria-label="Delete conversation"]').click()
    browser.refresh()
    open_page(browser, server.url)
    titles = [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#conversations .title")]
    assert titles == ["Sky <b>talk</b>"]


def test_the_csp_header_and_no_request_to_another_origin(browser, server):
    with urllib.request.urlopen(server.url + "/") as resp:
        csp = resp.headers["Content-Security-Policy"]
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert resp.headers["Referrer-Policy"] == "no-referrer"
    for part in ("default-src 'self'", "script-src 'self'", "style-src 'self'",
                 "img-src 'self' data: blob:", "media-src 'self' blob:", "connect-src 'self'",
                 "frame-ancestors 'none'", "base-uri 'none'", "form-action 'none'"):
        assert part in csp
    browser.get_log("performance")
    open_page(browser, server.url)
    pick(browser, "guide")
    say(browser, "Hello")
    last_reply(browser)
    entries = browser.execute_script(
        "return performance.getEntries().map(e => [e.entryType, e.name])")
    urls = [name for kind, name in entries if kind in ("navigation", "resource")]
    assert any(u.endswith("/v1/chat/completions") for u in urls), urls
    assert all(u.startswith(server.url + "/") for u in urls), urls
    sent = [json.loads(e["message"])["message"] for e in browser.get_log("performance")]
    sent = [m["params"]["request"]["url"] for m in sent
            if m["method"] == "Network.requestWillBeSent"]
    assert sent and all(u.startswith(server.url + "/") for u in sent), sent
    problems = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert problems == [], problems  # no CSP violation, no failed load, no script error


def test_a_reply_with_markup_and_script_links_runs_nothing(browser, server):
    browser.execute_script("window.alert = window.confirm = window.prompt = "
                           "() => { document.title = 'dialog'; };")
    pick(browser, "xss")
    say(browser, "<script>document.title='pwned'</script> **hi**")
    body = last_reply(browser).find_element(By.CSS_SELECTOR, ".body")
    # The same broken image, loaded after the reply: once its error has fired, an
    # onerror in the reply would have fired too.
    browser.execute_script("const probe = new Image();"
                           "probe.onerror = () => { window.probeFailed = true; };"
                           "probe.src = 'x';")
    wait(browser, lambda d: d.execute_script("return window.probeFailed === true"), 30,
         "a broken image's error")
    assert browser.title == TITLE
    text = body.text
    for part in (IMG, "[click me](javascript:document.title='pwned')",
                 "<a href=\"javascript:alert('pwned')\">this</a>",
                 "<script>alert('pwned')</script>", "<javascript:alert('pwned')>"):
        assert part in text, (part, text)
    assert body.find_elements(By.CSS_SELECTOR, "img, script, svg, iframe, a") == []
    user = browser.find_elements(By.CSS_SELECTOR, '[data-role="user"]')[-1]
    assert user.text == "<script>document.title='pwned'</script> **hi**"  # as typed
    assert browser.find_elements(By.CSS_SELECTOR, "#messages script") == []
    try:
        browser.switch_to.alert
        opened = True
    except NoAlertPresentException:
        opened = False
    assert not opened


def test_the_renderer_makes_links_only_of_http_urls(browser):
    cases = ["[a](javascript:alert(1))", "[a](JavaScript:alert(1))", "[a]( javascript:x)",
             "[a](data:text/html,<script>alert(1)</script>)", "[a](vbscript:x)",
             "<javascript:alert(1)>", "[a](/relative)", "![a](x onerror=alert(1))",
             "<a href='https://ok.example'>x</a>", "[ok](https://ok.example/p?q=1)",
             "<http://ok.example>", "see https://ok.example/x.", "`<b>code</b>`",
             "```html\n<img src=x onerror=alert(1)>\n```", "| <i>a</i> |\n|-|\n| <svg> |"]
    out = browser.execute_async_script("""
        const [cases, done] = arguments;
        import('/web/markdown.js').then(md => done(cases.map(text => {
          const box = document.createElement('div');
          box.append(md.render(text));
          return {tags: [...box.querySelectorAll('*')].map(e => e.tagName.toLowerCase()),
                  hrefs: [...box.querySelectorAll('a')].map(a => [a.href, a.rel]),
                  attrs: [...box.querySelectorAll('*')].flatMap(e => e.getAttributeNames())};
        }))).catch(e => done(String(e)));
    """, cases)
    assert isinstance(out, list), out
    allowed = {"p", "a", "code", "pre", "div", "span", "button", "table", "thead", "tbody",
               "tr", "th", "td", "br", "strong", "em"}
    for text, got in zip(cases, out):
        assert set(got["tags"]) <= allowed, (text, got)
        assert set(got["attrs"]) <= {"href", "rel", "target", "class", "type", "aria-label",
                                     "data-lang"}, (text, got)
        for href, rel in got["hrefs"]:
            assert href.startswith("https://ok.example") or href == "http://ok.example/", text
            assert rel == "noopener noreferrer"
    links = [len(got["hrefs"]) for got in out]
    # raw HTML stays text; only the https URL inside it is a link
    assert links == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0]


def test_a_model_id_with_markup_is_shown_as_text(browser, server, ggufs):
    status, body = send(server.url, "POST", "/v1/models/import",
                        {"path": str(ggufs["guide"]), "id": HOSTILE_ID})
    assert status == 200, body
    try:
        open_page(browser, server.url)
        options = "return [...document.querySelectorAll('#model option')].map(o => o.textContent)"
        wait(browser, lambda d: HOSTILE_ID in d.execute_script(options), 30,
             "the hostile id among the models")
        assert browser.execute_script(  # none but the page's own paperclip and microphone
            "return [...document.querySelectorAll('svg')]"
            ".filter(s => !s.closest('#attach, #mic')).length") == 0
        assert browser.title == TITLE
    finally:
        send(server.url, "DELETE", "/v1/models/" + urllib.request.quote(HOSTILE_ID, safe=""))


def test_a_keyed_server_asks_for_the_key_once(tmp_path_factory, chromium, ggufs):
    keyed = start_server(tmp_path_factory.mktemp("keyed-home"), {"guide": ggufs["guide"]},
                         apiKeys=["right-key-4321"])
    try:
        chromium.get(keyed.url + "/")  # the page itself needs no key
        key = wait(chromium, lambda d: labelled(d, "API key").is_displayed() and
                   labelled(d, "API key"), 30, "the page asks for a key")
        assert "An API key is required" in find(chromium, "#key-message").text
        key.send_keys("wrong-key", Keys.ENTER)
        wait(chromium, lambda d: "not accepted" in find(d, "#key-message").text and
             labelled(d, "API key").is_displayed(), 30, "the page asks again")
        labelled(chromium, "API key").send_keys("right-key-4321", Keys.ENTER)
        wait(chromium, lambda d: d.execute_script("return document.body.dataset.ready"), 30,
             "the models load with the key")
        assert not labelled(chromium, "API key").is_displayed()
        assert chromium.execute_script("return sessionStorage.getItem('localrt.apiKey')") \
            == "right-key-4321"
        pick(chromium, "guide")
        say(chromium, "Hello")
        assert "Rayleigh" in last_reply(chromium).text
        # kept for the tab's session: a reload does not ask again
        open_page(chromium, keyed.url)
        assert not labelled(chromium, "API key").is_displayed()
        assert find(chromium, "#error").get_attribute("hidden") is not None
    finally:
        chromium.execute_script("sessionStorage.clear(); localStorage.clear();")
        keyed.stop()


def test_pull_a_model_with_its_progress_and_its_errors(browser, server, module_hub, ggufs):
    hub = module_hub
    hub.max_bytes_per_second = ggufs["guide"].stat().st_size  # about a second
    browser.execute_script("""
        window.progress = [];
        const bar = document.getElementById('pull-progress');
        new MutationObserver(() => window.progress.push(bar.value))
          .observe(bar, {attributes: true});""")
    try:
        labelled(browser, "Model id to pull").send_keys("org/pulled", Keys.ENTER)
        wait(browser, lambda d: find(d, "#pull-progress").get_attribute("data-state") == "done",
             60, "the pull ends")
    finally:
        hub.max_bytes_per_second = None
    assert find(browser, "#pull-status").text == "Pulled org:pulled:pulled.gguf"
    progress = browser.execute_script("return window.progress")
    assert any(0 < p < 1 for p in progress) and progress[-1] == 1, progress
    wait(browser, lambda d: "org:pulled:pulled.gguf" in d.execute_script(
        "return [...document.querySelectorAll('#model option')].map(o => o.value)"), 10,
        "the pulled model is listed")
    # a pull the hub refuses: its message, in plain words
    field = labelled(browser, "Model id to pull")
    field.clear()
    field.send_keys("org/nothing-here", Keys.ENTER)
    wait(browser, lambda d: find(d, "#pull-progress").get_attribute("data-state") == "error",
         30, "the pull fails")
    status, reply = send(server.url, "POST", "/v1/models/pull", {"model": "org/nothing-here"})
    assert status >= 400 and find(browser, "#pull-status").text == reply["message"]
    send(server.url, "DELETE", "/v1/models/org:pulled:pulled.gguf")


def test_a_hundred_messages_render(browser, server):
    """Not a timed test: it prints how long a 100-message conversation takes to show."""
    text = "\n\n".join(GUIDE)
    messages = [{"role": "user" if k % 2 == 0 else "assistant",
                 "content": f"Question {k}?" if k % 2 == 0 else text} for k in range(100)]
    browser.execute_script("""
        localStorage.setItem('localrt.conversations', JSON.stringify([{id: 'long',
          title: 'A long one', model: 'guide', system: '', temperature: null,
          maxTokens: null, messages: arguments[0], updated: Date.now()}]));
        localStorage.setItem('localrt.current', 'long');""", messages)
    times = []
    for _ in range(5):
        open_page(browser, server.url)
        assert len(browser.find_elements(By.CSS_SELECTOR, "#messages > li")) == 100
        times.append(browser.execute_script(
            "return performance.getEntriesByName('render-conversation')[0].duration"))
    print(f"100 messages render in {min(times):.1f} ms (best of 5; all: "
          f"{', '.join(f'{t:.1f}' for t in times)})")
    assert len(browser.find_elements(By.CSS_SELECTOR, '[data-role="assistant"] table')) == 50


def prompt_tokens_of(url, model_id) -> float:
    """localrt_prompt_tokens_total for a model, from GET /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f'localrt_prompt_tokens_total{{model="{model_id}"}} '):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_vision_model_takes_an_attached_image(browser, server, tmp_path):
    """The attach button shows for a model whose capabilities include vision; the image
    shows in the message and reaches the model (its 36 tokens are in the prompt)."""
    from support.vision import IMAGE_TOKENS, png, write_vision_pair

    model, mmproj = write_vision_pair(tmp_path / "pair")
    status, body = request(server.url, "POST", "/v1/models/import",
                           {"path": str(model), "mmproj": str(mmproj), "id": "eye"})
    assert status == 200, body
    request(server.url, "PATCH", "/v1/models/eye", {"cpu_threads": 1, "n_parallel": 1})
    open_page(browser, server.url)
    pick(browser, "guide")
    assert not labelled(browser, "Attach image").is_displayed()  # no projector
    pick(browser, "eye")
    assert labelled(browser, "Attach image").is_displayed()
    settings_of(browser, temperature=0, max_tokens=4)
    picture = tmp_path / "picture.png"
    picture.write_bytes(png(64, 64, 8))
    chooser = find(browser, "#attach-file")
    browser.execute_script("arguments[0].hidden = false; arguments[0].style.display = 'block'",
                           chooser)
    chooser.send_keys(str(picture))
    wait(browser, lambda d: find(d, "#attached").is_displayed(), 10, "the image attached")
    before = prompt_tokens_of(server.url, "eye")
    say(browser, "What is this?")
    last_reply(browser)
    shown = browser.find_elements(By.CSS_SELECTOR, '[data-role="user"] img')
    assert shown and shown[-1].get_attribute("src").startswith("data:image/png;base64,")
    assert prompt_tokens_of(server.url, "eye") - before > IMAGE_TOKENS
    browser.save_screenshot(str(tmp_path / "vision.png"))
