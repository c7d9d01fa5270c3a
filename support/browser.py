"""A real headless Chromium (Debian's chromium + chromedriver) for the UI tests and bench/ui."""

from __future__ import annotations

import time


def chrome():
    """A headless Chromium driven by selenium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
              "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--window-size=1400,1000"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def wait_rendered(driver, timeout: float = 90) -> None:
    """Until Streamlit stops running the script and a page title is on screen."""
    from selenium.webdriver.common.by import By

    deadline = time.time() + timeout
    while time.time() < deadline:
        running = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        titles = driver.find_elements(By.CSS_SELECTOR, "h1")
        if titles and not running:
            time.sleep(0.5)
            if not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]'):
                return
        time.sleep(0.25)
    raise TimeoutError("page did not finish rendering")
