"""The chat page at `/` (`app/server/web_ui.py`) in a real browser: Debian's Chromium
and chromedriver, headless, driven by selenium (skipped where they are not installed).

An answer streams into the page and is the API's own; closing the tab mid-answer ends
the request and frees its KV blocks within 2 s; markup in a message creates no element
and runs nothing; the pool panel shows what `/metrics` says; with `--api-key` the page
asks for the key; `--disable-web-ui` turns it off."""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

from app.server.app import ServerSettings
from tests.server_harness import ServerThread, metric, tiny_config

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="needs Debian's chromium and chromium-driver")


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    """A tiny random model with room for a long answer: the tab closes mid-answer."""
    from models.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path_factory.mktemp("tiny8k"), smollm2_dir,
                            max_position_embeddings=8192)
    srv = ServerThread(tiny_config(model, max_model_len=8192),
                       ServerSettings(log_stats_interval=0)).start()
    yield srv
    srv.stop()


def new_browser():
    os.environ["SE_AVOID_STATS"] = "true"  # selenium sends no usage figures
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # Debian's: selenium never downloads one
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1200,800"):
        options.add_argument(arg)
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER),
                            options=options)


@pytest.fixture
def browser():
    driver = new_browser()
    yield driver
    driver.quit()


def open_page(browser, url: str) -> WebDriverWait:
    browser.get(url + "/")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#model option"))
    return wait


def ask(browser, text: str, max_tokens: int, temperature: float = 0.0) -> None:
    for field, value in (("temperature", temperature), ("max-tokens", max_tokens)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    browser.find_element(By.ID, "prompt").send_keys(text)
    browser.find_element(By.ID, "send").click()


def test_an_answer_streams_into_the_page_and_is_the_apis(server, browser, tmp_path):
    wait = open_page(browser, server.url)
    page = httpx.get(server.url + "/")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    ask(browser, "Hello there", max_tokens=24)
    wait.until(lambda b: b.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text)
    shown = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .text").text
    stats = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text
    api = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello there"}]}).json()
    # The browser's textContent is the text; its rendering trims trailing white space.
    assert shown.strip() == api["choices"][0]["message"]["content"].strip()
    assert "first token" in stats and "tokens/s" in stats
    browser.save_screenshot(str(tmp_path / "chat.png"))


def test_closing_the_tab_mid_answer_frees_its_blocks(server, browser):
    text = httpx.get(server.url + "/metrics").text
    used_before = metric(text, "kv_blocks", 'state="used"')
    browser.switch_to.new_window("tab")
    chat = browser.current_window_handle
    open_page(browser, server.url)
    ask(browser, "Tell me a long story", max_tokens=8000, temperature=1.0)
    WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.CSS_SELECTOR, ".msg.assistant .text").text)
    assert metric(httpx.get(server.url + "/metrics").text, "num_requests_running") == 1
    browser.close()  # the tab, mid-answer
    browser.switch_to.window(browser.window_handles[0])
    deadline = time.monotonic() + 2
    while True:
        text = httpx.get(server.url + "/metrics").text
        if metric(text, "num_requests_running") == 0 and \
                metric(text, "kv_blocks", 'state="used"') == used_before:
            break
        assert time.monotonic() < deadline, "the closed tab's request still holds its blocks"
        time.sleep(0.05)
    assert chat not in browser.window_handles


def test_markup_in_a_message_creates_no_element_and_runs_nothing(server, browser):
    wait = open_page(browser, server.url)
    hostile = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script><b>bold</b>'
    ask(browser, hostile, max_tokens=4)
    wait.until(lambda b: b.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text)
    messages = browser.find_element(By.ID, "messages")
    assert messages.find_elements(By.CSS_SELECTOR, "img, script, b") == []
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user .text").text == hostile
    assert browser.execute_script("return window.pwned") is None


def test_the_pool_panel_shows_what_metrics_says(server, browser):
    wait = open_page(browser, server.url)
    text = httpx.get(server.url + "/metrics").text  # an idle server: nothing changes
    want = {"blocks-free": metric(text, "kv_blocks", 'state="free"'),
            "blocks-used": metric(text, "kv_blocks", 'state="used"'),
            "running": metric(text, "num_requests_running"),
            "waiting": metric(text, "num_requests_waiting")}
    for element, value in want.items():
        wait.until(lambda b, e=element, v=value:
                   b.find_element(By.ID, e).text == f"{v:g}")
    points = browser.find_element(By.ID, "line-used").get_attribute("points")
    assert points  # the chart is drawn
    step = httpx.get(server.url + "/plan").json()["live"]["last_step"]["decode"]
    wait.until(lambda b: b.find_element(By.ID, "mbu").text == f"{round(100 * step['mbu'])} %")


def test_with_an_api_key_the_page_asks_for_it(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(
        log_stats_interval=0, api_key="page-key")).start()
    browser = new_browser()
    try:
        assert httpx.get(srv.url + "/").status_code == 200  # the page itself: no secret
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        browser.get(srv.url + "/")
        alert = WebDriverWait(browser, 30).until(
            lambda b: _alert(b))
        alert.send_keys("page-key")
        alert.accept()
        WebDriverWait(browser, 30).until(
            lambda b: b.find_elements(By.CSS_SELECTOR, "#model option"))
        assert browser.execute_script(
            "return sessionStorage.getItem('ridgeline-api-key')") == "page-key"
    finally:
        browser.quit()
        srv.stop()


def _alert(browser):
    try:
        return browser.switch_to.alert
    except NoAlertPresentException:
        return False


def test_the_page_can_be_turned_off(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(
        log_stats_interval=0, disable_web_ui=True)).start()
    try:
        assert httpx.get(srv.url + "/").status_code == 404
        assert httpx.get(srv.url + "/ui/app.js").status_code == 404
    finally:
        srv.stop()
