"""The docs site in a real browser: headless Chromium, driven over the DevTools protocol, opens the built
site from a local server; the home page, a guide, the API reference and the search box work, nothing asks
the network, and no page logs an error.

The site is the one `make docs` built (HEADLAB_SITE, as `make test` sets it), else built here with
--strict. `UPDATE_DOCS_SCREENSHOT=1` writes the home page's screenshot to docs/site_home.png.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from test_report import CHROMIUM

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "site_home.png"
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian package: chromium)")


def build_site(target: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true", "OMP_NUM_THREADS": "1"}
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(target)]
    proc = subprocess.run(mkdocs, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    given = os.environ.get("HEADLAB_SITE")
    if given and (ROOT / given / "index.html").is_file():
        return ROOT / given
    target = tmp_path_factory.mktemp("site") / "site"
    build_site(target)
    return target


@pytest.fixture(scope="module")
def served(site) -> Iterator[str]:
    handler = functools.partial(Quiet, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # the test's output is the assertions'
        pass


class Browser:
    """Chromium over --remote-debugging-pipe (fd 3 in, fd 4 out, JSON messages ending in a NUL byte):
    no websocket client, no driver binary."""

    def __init__(self, profile: Path) -> None:
        to_chrome_r, self.to_chrome = os.pipe()
        self.from_chrome, from_chrome_w = os.pipe()

        def wire() -> None:  # in the child: its ends at fds 3 and 4, where Chromium looks for them
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900", f"--user-data-dir={profile}", "about:blank"]  # fmt: skip
        assert CHROMIUM is not None
        self.proc = subprocess.Popen(
            [CHROMIUM, *flags], preexec_fn=wire, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self.buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer")
            chunk = os.read(self.from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed its pipe")
            self.buffer += chunk
        message, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, timeout: float = 60, **params: Any) -> dict:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self.to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            found = next((e for e in self.events if e["method"] == method), None)
            if found is not None:
                self.events.remove(found)
                return found
            self.events.append(self._read(deadline))

    def open(self, url: str) -> None:
        self.events = [e for e in self.events if e["method"] != "Page.loadEventFired"]
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str, timeout: float = 30) -> Any:
        result = self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True, timeout=timeout
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def until(self, expression: str, timeout: float = 20) -> Any:
        """The expression's value once it is truthy (the page's scripts run after load)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"never true: {expression}")

    def errors(self) -> list[str]:
        """What the pages logged as errors: uncaught exceptions, console.error, failed loads."""
        self.call("Runtime.evaluate", expression="0")  # collect the events sent so far
        found = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                found.append(json.dumps(p["exceptionDetails"])[:300])
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                found.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif e["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
                found.append(f"{p['entry'].get('url', '')}: {p['entry']['text']}")
        return found

    def requested(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e["method"] == "Network.requestWillBeSent"]

    def screenshot(self, target: Path) -> None:
        target.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.to_chrome)
        os.close(self.from_chrome)


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Browser]:
    if CHROMIUM is None:
        pytest.skip("no Chromium installed (Debian package: chromium)")
    opened = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield opened
    opened.close()


def visit(browser: Browser, url: str) -> None:
    browser.events.clear()
    browser.open(url)
    browser.until("document.readyState === 'complete' && !!document.querySelector('.md-content h1')")


def offsite(browser: Browser, served: str) -> list[str]:
    return [u for u in browser.requested() if not u.startswith((served, "data:", "blob:", "about:"))]


@needs_chromium
def test_home_page_renders_offline_without_errors(browser, served, tmp_path):
    visit(browser, served)
    assert browser.evaluate("document.querySelector('.md-content h1').textContent").startswith("headlab")
    nav = browser.evaluate("[...document.querySelectorAll('.md-nav__link')].map(a => a.textContent.trim())")
    assert {"Getting started", "Concepts", "Guides", "Reference"} <= set(nav)
    images = browser.evaluate("[...document.querySelectorAll('.md-content img')].map(i => i.naturalWidth)")
    assert images and all(w > 0 for w in images), "every picture of the home page loads"
    assert browser.errors() == []
    assert offsite(browser, served) == [], "the site asks nothing of the network"
    shot = SCREENSHOT if os.environ.get("UPDATE_DOCS_SCREENSHOT") else tmp_path / "home.png"
    browser.screenshot(shot)
    import matplotlib.image

    assert matplotlib.image.imread(shot)[..., :3].std() > 0.05  # not a blank page


@needs_chromium
def test_a_guide_renders_with_its_code_blocks(browser, served):
    visit(browser, served + "guides/ablation-patching/")
    assert "ablation" in browser.evaluate("document.querySelector('.md-content h1').textContent").lower()
    assert browser.evaluate("document.querySelectorAll('.md-content pre code').length") > 0
    toc = browser.evaluate("document.querySelectorAll('.md-sidebar--secondary .md-nav__link').length")
    assert toc >= 1, "the page's table of contents is there"
    assert browser.errors() == [] and offsite(browser, served) == []
    visit(browser, served + "getting-started/quickstart/")  # the notebook, rendered as stored
    assert browser.evaluate("document.querySelectorAll('.md-content .jp-CodeCell').length") > 3
    assert browser.errors() == [] and offsite(browser, served) == []


@needs_chromium
def test_the_api_reference_lists_every_public_name_with_its_signature(browser, served):
    import headlab

    sys.path.insert(0, str(ROOT / "docs"))
    import reference_pages

    names = reference_pages.public_names()
    assert set(names) == {n for n in vars(headlab) if not n.startswith("_") and n != "annotations"} - {
        n for n, v in vars(headlab).items() if type(v).__name__ == "module"
    }
    visit(browser, served + "reference/api/")
    found = browser.evaluate(
        "Object.fromEntries("
        + json.dumps(names)
        + """.map(n => {
            const h = document.getElementById('headlab.' + n);
            const doc = h && h.closest('.doc-object');
            return [n, doc ? {signature: (doc.querySelector('.doc-signature') || {}).textContent || '',
                              text: doc.querySelector('.doc-contents').textContent.trim().length} : null];
        }))"""
    )
    missing = [n for n, v in found.items() if v is None]
    assert missing == [], f"not in the API reference: {missing}"
    for name, shown in found.items():
        if callable(getattr(headlab, name)) and not isinstance(getattr(headlab, name), type):
            assert name in shown["signature"], f"{name}: no signature shown"
        assert shown["text"] > 40, f"{name}: no docstring shown"
    assert browser.errors() == []


@needs_chromium
def test_the_search_box_finds_a_page(browser, served):
    visit(browser, served)
    browser.evaluate("document.querySelector('label.md-search__icon, label[for=__search]').click()")
    browser.evaluate("document.querySelector('input.md-search__input').focus()")
    browser.call("Input.insertText", text="atlas")
    hits = browser.until(
        "[...document.querySelectorAll('.md-search-result__item a')].map(a => a.getAttribute('href'))", timeout=30
    )
    assert any(re.search(r"guides/atlas", h) for h in hits), hits
    assert browser.errors() == [] and offsite(browser, served) == []
