"""The web page of `rag serve`, driven in a real browser: Playwright with the system's Chromium (Debian's `chromium`
package; Playwright's own browser download is never used). The page asks a question and draws the answer, the prior /
posterior bars and the RAG-Token heatmap; the swap panel refuses without the admin token and swaps with it while
questions keep being answered; a knowledge base whose passages carry markup shows it as text and runs none of it.

Without a browser these tests skip with one line saying how to install it (`bash install.sh dev` does). The page's
headers (Content-Security-Policy) are checked without a browser.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
from serve_support import API_KEY, TOKEN, XSS_TEXT, XSS_TITLE

from rag.serve.app import ServeLimits, background_server, create_app
from rag.serve.page import CSP

INSTALL = ("no browser for the page tests: install Chromium and Playwright with `apt-get install -y chromium` and "
           "`pip install 'playwright>=1.45,<2'` (`bash install.sh dev` does both), or set RAG_CHROMIUM to a Chromium binary")
QUESTIONS = ["what is the atomic number of iron?", "who discovered oxygen?", "which element has the symbol W?",
             "what is the lightest element?", "when was neon discovered?"]


def chromium_path() -> str | None:
    """The system Chromium (RAG_CHROMIUM, else `chromium` / `chromium-browser` on PATH), or None."""
    given = os.environ.get("RAG_CHROMIUM")
    if given:
        return given if os.access(given, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    exe = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        exe = None
    if exe is None:
        pytest.skip(INSTALL)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True)  # as root Playwright adds --no-sandbox itself
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    pg = context.new_page()
    pg.errors = []  # uncaught exceptions and dialogs: an injected script would show up here
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("dialog", lambda d: (pg.errors.append(f"dialog: {d.message}"), d.dismiss()))
    pg.set_default_timeout(60_000)
    yield pg
    context.close()


@pytest.fixture(scope="module")
def site(serve_layout):
    """A server of the tiny RAG model over kb_a, swaps allowed under the layout's root."""
    import rag

    app = create_app(rag.load(serve_layout["model"]), kb_roots=[serve_layout["root"]], admin_token=TOKEN, model_name="tiny-rag",
                     limits=ServeLimits(request_timeout=None))
    with background_server(app) as url:
        yield url, app


@pytest.fixture()
def served(site, serve_layout):
    """The shared server, serving kb_a before and after each test."""
    url, app = site
    a = serve_layout["kbs"]["kb_a"].version
    assert app.state.slot.version == a
    yield url, app
    while app.state.slot.version != a and app.state.slot.history:
        app.state.slot.swap_back()
    assert app.state.slot.version == a


MIN_TOKENS = "4"  # the tiny random model's first token is often EOS: an empty answer has no heatmap to draw


def _answer(url: str, question: str, **options) -> dict:
    r = httpx.post(f"{url}/generate", json={"questions": [question], "max_new_tokens": 16, "min_new_tokens": int(MIN_TOKENS),
                                            "marginalization": "token", **options}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["answers"][0]


def _ask(page, question: str) -> None:
    """Ask as `_answer` does: RAG-Token (for the heatmap), 16 to MIN_TOKENS new tokens, chosen in the page's options
    (as it loads, the page sets none: the model's stored settings apply)."""
    if page.locator("#min-new-tokens").input_value() != MIN_TOKENS:
        if not page.locator("#min-new-tokens").is_visible():
            page.click("#options summary")
        page.fill("#min-new-tokens", MIN_TOKENS)
        page.fill("#max-new-tokens", "16")
        page.select_option("#marginalization", "token")
    page.fill("#question", question)
    # Cleared first: two answers can print the same status ("answered in 0.42 s"), so waiting for a change could hang.
    page.evaluate("() => { document.getElementById('ask-status').textContent = ''; }")
    page.click("#ask")
    page.wait_for_function("() => { const t = document.getElementById('ask-status').textContent; "
                           "return t !== '' && !t.startsWith('asking'); }")


def _version(page) -> str:
    return page.locator("#kb-version").text_content()


def test_page_answers_with_bars_and_heatmap(page, served, serve_layout, tmp_path):
    url, _ = served
    question = QUESTIONS[1]
    want = _answer(url, question)
    assert want["tokens"]
    page.goto(url)
    page.wait_for_function("v => document.getElementById('kb-version').textContent === v",
                           arg=serve_layout["kbs"]["kb_a"].version)
    _ask(page, question)
    assert page.locator("#ask-status").text_content().startswith("answered"), page.locator("#ask-status").text_content()
    assert page.locator("#answer").text_content() == (want["text"] or "(empty answer)")
    assert want["kb_version"] in page.locator("#answer-meta").text_content()
    passages = want["passages"]
    assert page.locator("#passages > li").count() == len(passages) == 3
    for kind in ("prior", "posterior"):  # one bar per passage, as wide as its probability
        widths = page.locator(f"#passages .bar.{kind} .fill").evaluate_all("els => els.map(e => e.style.width)")
        assert widths == [f"{100 * p[kind]:.1f}%" for p in passages]
    assert [t.strip() for t in page.locator("#passages .passage-text").all_text_contents()] == [p["text"] for p in passages]
    # Figure 2: one row per passage, one column per generated token, the cell's shade its posterior
    grid = want["token_doc_posterior"]
    assert page.locator("#heatmap table.heatmap th.token").count() == len(want["tokens"]) == len(grid)
    cells = page.locator("#heatmap td.cell").all_text_contents()
    assert cells == [f"{grid[t][k]:.2f}" for k in range(len(passages)) for t in range(len(grid))]
    shots = [tmp_path / "serve-page.png"] + ([Path(os.environ["RAG_PAGE_SCREENSHOT"])] if os.environ.get("RAG_PAGE_SCREENSHOT")
                                             else [])
    for shot in shots:
        page.screenshot(path=str(shot), full_page=True)
    assert shots[0].stat().st_size > 10_000
    assert page.errors == []


def test_page_shows_the_answers_citations_as_markers_linked_to_their_passages(page, served):
    """The [n] markers after the answer are the server's citations in number order, each a link to its passage, whose
    entry in the list carries the same [n]; passages not cited carry none (RAG-Token: numbered by first use)."""
    url, _ = served
    question = QUESTIONS[2]
    want = _answer(url, question)
    cites = want["citations"]
    assert cites and want["cited_text"].endswith("".join(f"[{c['number']}]" for c in cites))
    page.goto(url)
    page.wait_for_function("() => document.getElementById('kb-version').textContent.length > 3")
    _ask(page, question)
    assert page.locator("#answer").text_content() == (want["text"] or "(empty answer)")
    assert page.locator("#answer-markers").text_content() == "".join(f"[{c['number']}]" for c in cites)
    hrefs = page.locator("#answer-markers a.cite").evaluate_all("els => els.map(e => e.getAttribute('href'))")
    assert hrefs == [f"#passage-{c['passage']}" for c in cites]
    badges = page.locator("#passages > li").evaluate_all(
        "els => els.map(e => { const b = e.querySelector('.cite-badge'); return b ? b.textContent : null; })")
    by_passage = {c["passage"]: f"[{c['number']}]" for c in cites}
    assert badges == [by_passage.get(k) for k in range(len(want["passages"]))]
    page.click("#answer-markers a.cite >> nth=0")  # the link scrolls to its passage
    assert page.evaluate("() => location.hash") == f"#passage-{cites[0]['passage']}"
    assert page.errors == []


def test_swap_panel_needs_the_token_and_swaps_while_answering(page, served, serve_layout):
    url, _ = served
    a, b = serve_layout["kbs"]["kb_a"].version, serve_layout["kbs"]["kb_b"].version
    page.goto(url)
    page.wait_for_function("v => document.getElementById('kb-version').textContent === v", arg=a)
    status = page.locator("#swap-status")
    page.fill("#swap-path", "kb_b")
    for token, code in (("", "401"), ("not-the-token", "403")):
        page.fill("#admin-token", token)
        page.click("#swap")
        page.wait_for_function("() => document.getElementById('swap-status').textContent.startsWith('error')")
        assert code in status.text_content()
        page.evaluate("() => { document.getElementById('swap-status').textContent = ''; }")
    assert _version(page) == a
    _ask(page, QUESTIONS[0])
    assert a in page.locator("#answer-meta").text_content()
    page.fill("#admin-token", TOKEN)
    page.click("#swap")
    page.wait_for_function("v => document.getElementById('kb-version').textContent === v", arg=b)
    assert status.text_content().startswith(f"swap: {a} → {b}")
    _ask(page, QUESTIONS[0])  # the next question is answered from B
    assert b in page.locator("#answer-meta").text_content()
    assert all(t.startswith("[B]") for t in page.locator("#passages .passage-text").all_text_contents())
    page.click("#swap-back")
    page.wait_for_function("v => document.getElementById('kb-version').textContent === v", arg=a)
    assert status.text_content().startswith(f"swap_back: {b} → {a}")
    assert page.locator("#admin-token").input_value() == TOKEN  # kept in the page, nowhere else
    assert page.evaluate("() => [localStorage.length, sessionStorage.length, document.cookie]") == [0, 0, ""]
    assert page.errors == []


def test_injected_markup_in_passages_stays_text(page, served, serve_layout):
    url, _ = served
    x = serve_layout["kbs"]["kb_xss"].version
    page.goto(url)
    page.fill("#admin-token", TOKEN)
    page.fill("#swap-path", "kb_xss")
    page.click("#swap")
    page.wait_for_function("v => document.getElementById('kb-version').textContent === v", arg=x)
    if not page.locator("#n-docs").is_visible():
        page.click("#options summary")
    page.fill("#n-docs", "12")  # every passage of the knowledge base, the marked-up one included
    _ask(page, "the atomic number of iron")
    assert page.locator("#passages > li").count() == 12
    titles = page.locator("#passages .passage-title").all_text_contents()
    texts = page.locator("#passages .passage-text").all_text_contents()
    assert XSS_TITLE in titles and XSS_TEXT in texts  # shown as the characters it holds
    heads = page.locator("#heatmap th.doc")
    assert XSS_TITLE in "".join(heads.all_text_contents()) or not heads.count()
    page.hover("#passages .passage-text >> nth=0")
    assert page.evaluate("() => window.__xss") is None
    assert page.evaluate("() => document.querySelectorAll('img, script:not([src]), [onerror], [onmouseover]').length") == 0
    assert page.errors == []


def test_page_with_an_api_key(page, serve_layout):
    import rag

    app = create_app(rag.load(serve_layout["model"]), api_key=API_KEY, model_name="tiny-rag")
    with background_server(app) as url:
        page.goto(url)  # the page itself needs no key
        page.wait_for_function("() => document.getElementById('kb-version').textContent.includes('401')")
        page.click("#options summary")
        page.fill("#api-key", API_KEY)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("v => document.getElementById('kb-version').textContent === v",
                               arg=serve_layout["kbs"]["kb_a"].version)
        _ask(page, QUESTIONS[0])
        assert page.locator("#ask-status").text_content().startswith("answered")


def test_the_page_leaves_the_model_settings_to_the_model_and_names_its_method(page, served, serve_layout):
    """As it loads, the page sends a question alone ({"questions": [...]}: the stored RAG-Sequence settings of the
    model apply, as POST /generate with no option answers) and its header names what /health reports."""
    url, _ = served
    question = QUESTIONS[0]
    want = httpx.post(f"{url}/generate", json={"questions": [question]}, timeout=120).json()["answers"][0]
    health = httpx.get(f"{url}/health", timeout=60).json()
    assert (health["method"], health["generator_kind"], health["reader"]) == ("rag-sequence", "seq2seq", "rag")
    sent: list = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/generate") else None)
    page.goto(url)
    page.wait_for_function("() => document.getElementById('model-info').textContent.includes('RAG-Sequence')")
    assert "seq2seq generator" in page.locator("#model-info").text_content()
    page.fill("#question", question)
    page.click("#ask")
    page.wait_for_function("() => document.getElementById('ask-status').textContent.startsWith('answered')")
    assert sent == [{"questions": [question]}]
    assert page.locator("#answer").text_content() == (want["text"] or "(empty answer)")
    assert page.errors == []


def test_page_headers_forbid_inline_and_foreign_content(site):
    url, _ = site
    for path, kind in (("/", "text/html"), ("/static/app.js", "text/javascript"), ("/static/style.css", "text/css")):
        r = httpx.get(f"{url}{path}", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert r.headers["content-security-policy"] == CSP and "default-src 'self'" in CSP and "unsafe" not in CSP
        assert r.headers["x-content-type-options"] == "nosniff"
    html = httpx.get(url, timeout=30).text
    assert "<script>" not in html and "style=" not in html and "http" not in html.replace("http-equiv",  # no inline code, no CDN
                                                                                          "")
    js = httpx.get(f"{url}/static/app.js", timeout=30).text
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js and "localStorage" not in js
    for path in ("/static/index.html", "/static/../page.py", "/static/%2e%2e/page.py", "/static/nope.js"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 404


@pytest.mark.slow
def test_demo_model_page(page, tmp_path):
    """The bundled demo model (its knowledge base is built on first use): a RAG-Token answer whose tokens come from
    different passages, drawn as the heatmap. RAG_PAGE_SCREENSHOT=PATH also saves the screenshot there (the docs' one
    is taken this way)."""
    import rag

    pipe = rag.load("demo")
    app = create_app(pipe, model_name="demo")
    question = "what is the atomic weight of gold?"
    with background_server(app) as url:
        want = httpx.post(f"{url}/generate", json={"questions": [question], "n_docs": 5, "marginalization": "token",
                                                   "max_new_tokens": 16}, timeout=120).json()["answers"][0]
        page.set_viewport_size({"width": 1000, "height": 900})
        page.goto(url)
        page.wait_for_function("v => document.getElementById('kb-version').textContent === v", arg=pipe.kb_version)
        page.click("#options summary")
        page.fill("#n-docs", "5")
        page.select_option("#marginalization", "token")
        page.fill("#max-new-tokens", "16")
        page.fill("#question", question)
        page.click("#ask")
        page.wait_for_function("() => document.getElementById('ask-status').textContent.startsWith('answered')")
        assert page.locator("#answer").text_content() == want["text"]
        assert page.locator("#heatmap td.cell").count() == 5 * len(want["tokens"]) > 0
        page.click("#options summary")  # fold the options away for the picture
        shots = [tmp_path / "serve-page.png"] + ([Path(os.environ["RAG_PAGE_SCREENSHOT"])]
                                                 if os.environ.get("RAG_PAGE_SCREENSHOT") else [])
        for shot in shots:
            page.screenshot(path=str(shot), full_page=True)
    assert page.errors == []
