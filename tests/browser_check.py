"""A maintainer's check in a real browser (not part of make test): each lesson opened in JupyterLab or Notebook 7
under headless Chromium, Run All, every slider dragged and every dropdown and button changed in quick succession,
then a screenshot of every widget before and after, a count of its image's non-white pixels (a blank widget has
none) and every output that shows a traceback.

Needs Playwright and a Chromium, neither of them a course dependency: on Debian, `apt-get install chromium` and
`python3 -m venv /tmp/pw && /tmp/pw/bin/pip install playwright` (its own browser download is not needed). Then::

    /tmp/pw/bin/python tests/browser_check.py 08_pipeline 11_moe          # JupyterLab
    FRONT=notebook /tmp/pw/bin/python tests/browser_check.py 08_pipeline  # Notebook 7

Screenshots and report.json land in $BROWSER_OUT/<front>/ (default /tmp/dtcourse-browser). Look at them.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("BROWSER_OUT", "/tmp/dtcourse-browser")) / os.environ.get("FRONT", "lab")
FRONT = os.environ.get("FRONT", "lab")          # "lab" or "notebook" (Notebook 7)
ROOT = ".jp-NotebookPanel:not(.lm-mod-hidden)"
WIDGET = ".jupyter-widgets.widget-container.widget-box.widget-vbox"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def start_lab(port):
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{REPO}/.venv/bin:" + os.environ["PATH"],
               JUPYTER_CONFIG_PATH=f"{REPO}/.jupyter/student:{REPO}/.jupyter/course",
               JUPYTERLAB_SETTINGS_DIR=str(OUT / "settings"))
    tracker = OUT / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True, exist_ok=True)
    (tracker / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')   # render every cell
    cmd = [f"{REPO}/.venv/bin/jupyter", FRONT, "--no-browser", f"--port={port}", "--ServerApp.token=",
           "--ServerApp.password=", "--ServerApp.root_dir=.", "--allow-root", "--ServerApp.disable_check_xsrf=True"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(OUT / "lab.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    for _ in range(120):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("jupyter lab did not start")


def run_lesson(page, port, name, log):
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    page.goto(f"http://127.0.0.1:{port}/lab/tree/lessons/{name}.ipynb?reset" if FRONT == "lab"
              else f"http://127.0.0.1:{port}/notebooks/lessons/{name}.ipynb")
    page.wait_for_selector(ROOT + " .jp-Notebook .jp-Cell", timeout=60000)
    page.wait_for_timeout(3000)
    started = time.time()
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click(timeout=10000)   # the menu
    page.get_by_text("Run All Cells", exact=True).click(timeout=10000)
    page.wait_for_timeout(2000)
    while time.time() - started < 240:
        busy = page.evaluate("""(R) => [...document.querySelectorAll(R + ' .jp-InputArea-prompt')]
                                 .filter(e => e.textContent.includes('*')).length""", ROOT)
        if not busy:
            break
        page.wait_for_timeout(1000)
    took = time.time() - started
    errors = page.evaluate(r"""(R) => [...document.querySelectorAll(R + ' .jp-OutputArea-output')]
          .map(e => e.innerText).filter(t => /Traceback \(most recent call last\)|^[A-Za-z_.]*Error: /m.test(t)).map(t => t.slice(0, 400))""", ROOT)
    log.append({"lesson": name, "run_all_s": round(took, 1), "errors": errors})
    widgets = page.locator(ROOT + " " + WIDGET)
    n = widgets.count()
    for i in range(n):
        w = widgets.nth(i)
        w.scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        w.screenshot(path=str(d / f"w{i}_0.png"))
        sliders = w.locator(".noUi-handle")
        tracks = w.locator(".noUi-target")
        for j in range(sliders.count()):                       # quick successive drags, by the mouse
            hb, tb = sliders.nth(j).bounding_box(), tracks.nth(j).bounding_box()
            y = hb["y"] + hb["height"] / 2
            page.mouse.move(hb["x"] + hb["width"] / 2, y)
            page.mouse.down()
            for frac in (0.9, 0.2, 0.7, 0.5):
                page.mouse.move(tb["x"] + frac * tb["width"], y, steps=4)
            page.mouse.up()
        selects = w.locator("select")
        for j in range(selects.count()):
            opts = selects.nth(j).locator("option").all_inner_texts()
            for o in opts[1:]:                                  # ends on the last: a change
                selects.nth(j).select_option(label=o)
        toggles = w.locator(".widget-toggle-button, .jupyter-button")
        for j in range(toggles.count()):
            try:
                toggles.nth(j).click(timeout=2000)
            except Exception:
                pass
        page.wait_for_timeout(3000)
        w.screenshot(path=str(d / f"w{i}_1.png"))
        blank = page.evaluate("""([i, sel]) => {
            const box = document.querySelectorAll(sel)[i];
            const img = box && box.querySelector('img');
            if (!img || !img.naturalWidth) return null;
            const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
            const ctx = c.getContext('2d'); ctx.drawImage(img, 0, 0);
            const d = ctx.getImageData(0, 0, c.width, c.height).data; let n = 0;
            for (let k = 0; k < d.length; k += 4) if (d[k] < 245 || d[k + 1] < 245 || d[k + 2] < 245) n++;
            return [img.naturalWidth, img.naturalHeight, n]; }""", [i, ROOT + " " + WIDGET])
        changed = (d / f"w{i}_0.png").read_bytes() != (d / f"w{i}_1.png").read_bytes()
        log[-1].setdefault("widgets", []).append({"index": i, "image": blank, "changed": changed})
    page.screenshot(path=str(d / "page_end.png"), full_page=False)


def main(lessons):
    OUT.mkdir(parents=True, exist_ok=True)
    port = free_port()
    lab = start_lab(port)
    log = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for name in lessons:
                try:
                    run_lesson(page, port, name, log)
                except Exception as err:
                    log.append({"lesson": name, "failed": repr(err)[:500]})
                    page.screenshot(path=str(OUT / f"{name}_failure.png"))
                # shut the kernel down before the next lesson
                page.evaluate("""async () => { const r = await fetch('/api/kernels'); const ks = await r.json();
                    for (const k of ks) await fetch('/api/kernels/' + k.id, {method: 'DELETE'}); }""")
            browser.close()
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
    (OUT / "report.json").write_text(json.dumps(log, indent=1))
    print(json.dumps(log, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
