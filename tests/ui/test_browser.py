"""End to end in a real browser: ``torchport ui`` with the simulated NPU, driven through headless Chromium.

Needs Chromium and its driver from the system's packages (Debian: ``apt-get install chromium chromium-driver``,
which ``scripts/setup.sh test`` does as root) and selenium; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gradio", reason="the dashboard needs gradio: pip install 'torchport[ui]'")
webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test drives Chromium with selenium: "
                                                             "pip install 'torchport[test]'")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

pytestmark = pytest.mark.slow  # a browser drives a served dashboard

REPO = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
START_S = 120  # imports torch and gradio and builds the app: ~10 s on a 2-core machine
WAIT_S = 60

CUDA_SCRIPT = """import torch

model = Net().cuda()
x = torch.randn(8, 16, device="cuda")
torch.cuda.synchronize()
"""


def _browser() -> tuple[str, str]:
    binary = next((found for name in BROWSERS if (found := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no Chromium and chromedriver on PATH; install them from the system's packages (Debian: "
                    "apt-get install chromium chromium-driver; scripts/setup.sh test does it when run as root)")
    return binary, driver


@pytest.fixture
def dashboard() -> Iterator[str]:
    """``torchport ui --port 0`` with the simulated NPU in a subprocess; yields its URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")}
    env.update(TORCHPORT_SIMULATE="npu", PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, "-m", "torchport", "ui", "--port", "0"], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    seen, url = [], None
    deadline = time.monotonic() + START_S
    try:
        while url is None and time.monotonic() < deadline and process.poll() is None:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            match = re.search(r"serving on (http://\S+)", line)
            url = match.group(1) if match else None
        assert url is not None, f"torchport ui did not start within {START_S} s:\n{''.join(seen)}"
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def browser() -> Iterator[Any]:
    binary, driver_path = _browser()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    profile = tempfile.mkdtemp(prefix="torchport-chromium-")
    # without these Chromium reaches for the network (updates, sync, QUIC probes) and can stall
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1200"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    os.environ.setdefault("SE_AVOID_STATS", "true")  # selenium-manager is not used (both paths are given)
    try:
        driver = webdriver.Chrome(service=webdriver.ChromeService(driver_path), options=options)
    except WebDriverException as exc:
        shutil.rmtree(profile, ignore_errors=True)
        pytest.skip(f"Chromium at {binary} did not start under {driver_path}: {exc.msg}")
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(driver: Any, ready: Callable[[], bool], what: str, shots: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except WebDriverException:
            pass  # the element is not there yet
        time.sleep(0.2)
    shot = shots / f"{re.sub(r'[^a-z]+', '-', what.lower())}.png"
    driver.save_screenshot(str(shot))
    body = driver.find_element(By.TAG_NAME, "body").text
    raise AssertionError(f"{what}: not seen within {WAIT_S} s (screenshot {shot}); the page says:\n{body[:3000]}")


def _text(driver: Any, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def _open_tab(driver: Any, name: str) -> None:
    tab = next(b for b in driver.find_elements(By.CSS_SELECTOR, "button[role=tab]") if b.text.strip() == name)
    tab.click()


def test_devices_doctor_and_a_migration_in_the_browser(browser: Any, dashboard: str, tmp_path: Path) -> None:
    browser.get(dashboard)

    # Devices: the simulated NPU and the CPU, with their memory
    _wait(browser, lambda: "npu:0" in _text(browser, "devices-table") and "cpu" in _text(browser, "devices-table"),
          "the devices table lists npu:0 and cpu", tmp_path)
    table = _text(browser, "devices-table")
    assert "Ascend910B3 (simulated)" in table and "64.00 GiB" in table
    assert "Host RAM" in _text(browser, "devices-host")

    # Doctor: every check passes on cpu and the simulated npu
    _open_tab(browser, "Doctor")
    browser.find_element(By.ID, "doctor-run").click()
    _wait(browser, lambda: "checks" in _text(browser, "doctor-summary"), "the doctor's summary", tmp_path)
    assert re.fullmatch(r"All \d+ checks passed(; \d+ skipped, not installed: .+)?",
                        _text(browser, "doctor-summary").strip())
    checks = _text(browser, "doctor-table")
    assert "npu:0" in checks and "PASS" in checks and "FAIL" not in checks
    assert ("SKIP" in checks) == ("skipped" in _text(browser, "doctor-summary"))

    # Migrate: an uploaded CUDA script gives its diff and a download
    _open_tab(browser, "Migrate")
    script = tmp_path / "train.py"
    script.write_text(CUDA_SCRIPT)
    browser.find_element(By.CSS_SELECTOR, "#migrate-upload input[type=file]").send_keys(str(script))
    _wait(browser, lambda: "+model = Net().to(DEVICE)" in _text(browser, "migrate-diff"), "the migration's diff",
          tmp_path)
    diff = _text(browser, "migrate-diff")
    assert "--- a/train.py" in diff and "-model = Net().cuda()" in diff
    assert "+if torch.accelerator.is_available():" in diff and "torch.accelerator.synchronize()" in diff
    assert "train.py" in _text(browser, "migrate-summary") and "3 sites rewritten" in _text(browser, "migrate-summary")
    assert browser.find_element(By.ID, "migrate-download").is_displayed()

    # Everything the page loaded came from the dashboard itself
    origin = dashboard.rstrip("/")
    requested = _requested_urls(browser)
    assert any(url.startswith(origin) for url in requested), requested
    remote = {url for url in requested if not url.startswith((origin, "data:", "blob:", "about:", "chrome"))}
    assert not remote, f"the page reached outside this machine: {sorted(remote)}"


def _requested_urls(driver: Any) -> set[str]:
    urls = set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.add(message["params"]["request"]["url"])
    return urls
