"""The chat page in headless Chromium: type a question, see the answer stream in, ask a follow-up.

Skipped where no Chromium is installed (Debian: `apt-get install chromium`). The screenshot goes to
$NANOEULER_SCREENSHOT when set (e.g. /tmp/serve.png), else into the test's temporary directory."""

import json
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from cdp import Chromium, find_chromium  # noqa: E402
from serve_fixtures import LEARNED, chat_model, live_server  # noqa: E402

pytestmark = pytest.mark.skipif(find_chromium() is None, reason="needs Chromium (apt-get install chromium)")

LAST_ANSWER = """(() => { const all = document.querySelectorAll('.assistant');
  const a = all[all.length - 1];
  return a ? JSON.stringify({n: all.length, state: a.dataset.state, text: a.textContent, chunks: +a.dataset.chunks})
           : null; })()"""


def ask(browser, question: str, n: int) -> dict:
    browser.evaluate("document.getElementById('input').focus()")
    browser.type_text(question)
    browser.press_enter()
    browser.wait_for(
        f"document.querySelectorAll('.assistant').length === {n} && "
        "document.querySelectorAll('.assistant')[" + str(n - 1) + "].dataset.state === 'done'"
    )
    return json.loads(browser.evaluate(LAST_ANSWER))


def test_chat_page_streams_answers_in_a_browser(tmp_path_factory, tmp_path):
    model = chat_model(tmp_path_factory)
    shot = os.environ.get("NANOEULER_SCREENSHOT") or str(tmp_path / "serve.png")
    with live_server(model, max_tokens=48) as (url, _), Chromium() as browser:
        browser.open(url + "/")
        assert browser.wait_for("document.getElementById('meta').textContent.includes('serve_chat')")
        browser.evaluate("document.getElementById('temperature').value = '0'")
        (france, paris), (color, blue) = LEARNED.items()
        first = ask(browser, france, 1)
        assert first == {"n": 1, "state": "done", "text": paris, "chunks": first["chunks"]}
        assert first["chunks"] >= 2  # the answer arrived in pieces, each appended as it came
        second = ask(browser, color, 2)
        assert second["n"] == 2 and second["state"] == "done" and second["text"]
        users = browser.evaluate("[...document.querySelectorAll('.user')].map(e => e.textContent)")
        assert users == [france, color] and not browser.evaluate("document.querySelector('.error')")
        browser.screenshot(shot)
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
