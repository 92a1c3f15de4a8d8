"""report.html's attention explorer in a real browser: headless Chromium driven by Selenium.

Uses the system's Chromium and chromedriver (Debian: apt-get install chromium chromium-driver);
Selenium Manager is kept offline, so nothing is downloaded. Skips, saying why, without them.

Also a script: ``python tests/test_report_browser.py REPORT.html OUT.png`` saves a screenshot of the explorer.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
DRIVER = shutil.which("chromedriver")


def _skip_reason() -> str | None:
    if CHROMIUM is None or DRIVER is None:
        return ("needs a system Chromium and chromedriver on PATH (Debian: apt-get install chromium "
                "chromium-driver); .ci/run installs them")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium (pip install -e '.[test]')"
    return None


def start_browser(width: int = 1200, height: int = 1600):
    """A headless Chromium via the system chromedriver, with the browser console captured."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not download a browser or a driver
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--allow-file-access-from-files"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(executable_path=DRIVER))


def open_report(driver, path: Path, timeout: float = 30.0) -> None:
    """Load report.html and wait until the explorer has drawn."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(Path(path).resolve().as_uri())
    WebDriverWait(driver, timeout).until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")


def screenshot(report: Path, out: Path) -> Path:
    """Save a PNG of the explorer section of a report.html, after clicking a patch."""
    from selenium.webdriver.common.by import By

    driver = start_browser(1100, 900)
    try:
        open_report(driver, report)
        section = driver.find_element(By.ID, "explorer")
        driver.execute_script("arguments[0].scrollIntoView()", section)
        canvas = driver.find_element(By.ID, "x-attention")
        _click_patch(driver, canvas, 2, 5, driver.execute_script("return JSON.parse("
                                                              "document.getElementById('explorer-data').textContent)"
                                                              ".grid"))
        section.screenshot(str(out))
    finally:
        driver.quit()
    return out


def _click_patch(driver, canvas, row: int, col: int, grid) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    gh, gw = grid
    w, h = canvas.size["width"], canvas.size["height"]
    x = (col + 0.5) * w / gw - w / 2  # Selenium 4 offsets are from the element's centre
    y = (row + 0.5) * h / gh - h / 2
    ActionChains(driver).move_to_element_with_offset(canvas, int(x), int(y)).click().perform()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    import vitlab
    from vitlab.analysis import inspect_model

    torch.manual_seed(0)
    model = vitlab.create_model("deit_tiny_distilled_patch4_32", embed_dim=32, depth=2, num_heads=2).eval()
    out = tmp_path_factory.mktemp("browser")
    return inspect_model(model, torch.randn(3, 3, 32, 32), out, labels=[0, 1, 2], curve_steps=4,
                         sanity_images=2, importance_images=3)


@pytest.mark.slow
def test_explorer_click_changes_the_map_without_console_errors(report):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = start_browser()
    try:
        open_report(driver, report)
        canvas = driver.find_element(By.ID, "x-attention")
        driver.execute_script("arguments[0].scrollIntoView()", canvas)
        pixels = lambda: driver.execute_script("return arguments[0].toDataURL()", canvas)
        state = lambda key: canvas.get_attribute(f"data-{key}")
        assert state("query") == "cls" and state("layer") == "1"  # the last block, class token, at load

        Select(driver.find_element(By.ID, "x-image")).select_by_value("2")
        Select(driver.find_element(By.ID, "x-layer")).select_by_value("0")
        Select(driver.find_element(By.ID, "x-head")).select_by_value("1")
        WebDriverWait(driver, 10).until(lambda d: (state("image"), state("layer"), state("head")) == ("2", "0", "1"))
        before = pixels()

        _click_patch(driver, canvas, 2, 3, (8, 8))
        WebDriverWait(driver, 10).until(lambda d: state("query") == str(2 * 8 + 3))
        after = pixels()
        assert after != before, "clicking a patch did not change the shown attention map"
        assert "patch (2, 3)" in driver.find_element(By.ID, "x-attention-info").text

        _click_patch(driver, canvas, 6, 1, (8, 8))  # another patch, another map
        WebDriverWait(driver, 10).until(lambda d: state("query") == str(6 * 8 + 1))
        assert pixels() != after

        driver.find_element(By.ID, "x-query-dist").click()  # the distilled model's second token
        WebDriverWait(driver, 10).until(lambda d: state("query") == "dist")

        method = driver.find_element(By.ID, "x-method")
        Select(driver.find_element(By.ID, "x-method-select")).select_by_visible_text("relevance (Chefer et al.)")
        WebDriverWait(driver, 10).until(lambda d: method.get_attribute("data-method") == "relevance")
        info = driver.find_element(By.ID, "x-method-info").text
        assert "deletion AUC" in info and "positive perturbation" in info

        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert not errors, errors
    finally:
        driver.quit()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tests/test_report_browser.py REPORT.html OUT.png")
    reason = _skip_reason()
    if reason:
        sys.exit(reason)
    print(screenshot(Path(sys.argv[1]), Path(sys.argv[2])))
