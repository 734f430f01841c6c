"""The maintainers' check of `make site` in a real browser: every page opens, every figure shows, no traceback.

    /tmp/pw/bin/python tests/site_check.py [site]        # needs Playwright and Debian's chromium

It serves the folder on localhost, opens index.html in headless Chromium, follows every lesson link in
order, and on each page counts the images and those that drew (naturalWidth > 0), the widgets shown as
pictures, and any "Traceback" in the text; it follows the page's "next" link to check the bar too. A
screenshot of each page's first screen lands in $SITE_OUT (default /tmp/dtcourse-site). Exit 1 if a page
failed, an image did not draw or a traceback showed.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import sys
import threading
from pathlib import Path

from playwright.sync_api import sync_playwright

SITE = Path(sys.argv[1] if len(sys.argv) > 1 else "site").resolve()
OUT = Path(os.environ.get("SITE_OUT", "/tmp/dtcourse-site"))
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    report, bad = [], 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{base}/index.html")
        links = page.eval_on_selector_all("ul.lessons a", "els => els.map(e => e.getAttribute('href'))")
        for i, href in enumerate(links):
            page.goto(f"{base}/{href}", wait_until="load")
            page.wait_for_timeout(300)
            images = page.eval_on_selector_all("img", "els => els.map(e => e.complete && e.naturalWidth > 0)")
            stills = page.locator(".dtcourse-still").count()
            text = page.inner_text("body")
            nxt = page.locator("nav.dtcourse-nav.top a").last.get_attribute("href")
            row = {"page": href, "images": len(images), "drawn": sum(images), "widgets as pictures": stills,
                   "traceback": "Traceback" in text, "next": nxt}
            ok = images and all(images) and not row["traceback"] and (i + 1 == len(links) or nxt == links[i + 1])
            bad += not ok
            report.append(row)
            page.screenshot(path=str(OUT / f"{Path(href).stem}.png"))
            print(("ok  " if ok else "BAD ") + json.dumps(row), flush=True)
        browser.close()
    server.shutdown()
    (OUT / "report.json").write_text(json.dumps(report, indent=1))
    print(f"{len(report)} pages, {bad} bad; screenshots in {OUT}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
