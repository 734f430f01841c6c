"""The course as a static web site: every lesson executed here, with its outputs and figures, as HTML.

    python -m dtcourse.site                 # make site: all lessons into site/, then open site/index.html
    python -m dtcourse.site --out /tmp/s lessons/04_mixed_precision.ipynb     # some lessons only

Each lesson runs top to bottom in a fresh kernel (nbclient), in ``lessons/`` as in JupyterLab, and
is written as one page with nbconvert's ``lab`` template, so it looks as it does in JupyterLab. The
pages share a bar (contents, previous, next), and ``index.html`` lists the lessons in order with
each one's title and summary line. Widgets cannot run without a kernel: the kernel starts with
``DTCOURSE_STATIC_WIDGETS=1``, so each one shows its picture as drawn, under a line that names its
settings (``dtcourse.lab.widgets.still``). A cell that raises stops the build with the lesson's
name and the cell, as nbval would.

Why nbconvert: JupyterLab already installs it (nothing new to install or keep up to date), its
``lab`` template renders outputs exactly as the front end does, and the site is plain files that
any static host serves. Jupyter Book 2 builds a richer site but needs Node.js and its own
toolchain; Jupyter Book 1 pins an older Sphinx stack and is no longer developed.
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STYLE = """<style>
.dtcourse-nav { font: 14px/1.6 system-ui, sans-serif; margin: 0 auto; max-width: 1000px; padding: 8px 16px;
  display: flex; justify-content: space-between; border-bottom: 1px solid #ddd; }
.dtcourse-nav.bottom { border-top: 1px solid #ddd; border-bottom: none; margin-top: 24px; }
.dtcourse-nav a { text-decoration: none; }
.dtcourse-still em { color: #555; }
</style>"""


def lesson_info(path: Path) -> tuple[str, str]:
    """A lesson's title (its first heading) and its summary (the first italic line, e.g. its timing)."""
    nb = json.loads(path.read_text())
    title, summary = path.stem, ""
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for line in "".join(cell["source"]).splitlines():
            if line.startswith("# ") and title == path.stem:
                title = line[2:].strip()
            elif re.fullmatch(r"\*[^*].*\*", line.strip()) and not summary:
                summary = line.strip().strip("*")
        if title != path.stem:
            break
    return title, summary


def nav(pages: list[tuple[str, str]], i: int, where: str = "top") -> str:
    """The bar above and below lesson ``i``'s page: the previous lesson, the contents, the next lesson."""
    prev = f'<a href="{pages[i - 1][0]}">← {html.escape(pages[i - 1][1])}</a>' if i > 0 else "<span></span>"
    nxt = (f'<a href="{pages[i + 1][0]}">{html.escape(pages[i + 1][1])} →</a>' if i + 1 < len(pages)
           else "<span></span>")
    return f'<nav class="dtcourse-nav {where}">{prev}<a href="index.html">Contents</a>{nxt}</nav>'


def execute(path: Path, timeout: int, env: dict[str, str]) -> tuple["object", float]:
    """Run the lesson in a fresh kernel in its own folder; the executed notebook and the seconds it took."""
    import tempfile

    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as sockets:   # the kernel's channels: local sockets, not TCP ports
        km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
        try:
            NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": str(path.parent)}}).execute(env=env)
        finally:                                     # a kernel manager passed in is the caller's to stop
            if km.has_kernel:
                km.shutdown_kernel()
    return nb, time.monotonic() - start


def page(nb, bar_top: str, bar_bottom: str, title: str) -> str:
    """One lesson as HTML (nbconvert's lab template), with the course's bars around it."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb, resources={"metadata": {"name": title}})
    body = body.replace("</head>", STYLE + "</head>", 1)
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + bar_top, body, count=1)
    return body.replace("</body>", bar_bottom + "</body>", 1)


def index(pages: list[tuple[str, str]], summaries: list[str], seconds: list[float]) -> str:
    """The contents page: every lesson in order, and where and when the outputs were made."""
    import torch

    rows = "\n".join(f'<li><a href="{name}">{html.escape(title)}</a><br><small>{html.escape(summary)}'
                     f"{' · ' if summary else ''}ran in {s:.0f} s</small></li>"
                     for (name, title), summary, s in zip(pages, summaries, seconds))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, Python "
               f"{platform.python_version()}, torch {torch.__version__}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dtcourse: distributed training, lesson by lesson</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body {{ font: 16px/1.5 system-ui, sans-serif; max-width: 760px; margin: 40px auto; padding: 0 16px; }}
ul.lessons {{ list-style: none; padding-left: 0; }} li {{ margin: 0 0 12px; }} small {{ color: #555; }}</style></head>
<body>
<h1>dtcourse</h1>
<p>A course on distributed deep-learning training, in notebooks that run real multi-process code on a
laptop. These pages are the lessons as they ran, with every output and figure; to change a number,
move a widget or do the problems, open the course in JupyterLab (see the repository's README).</p>
<p><small>Outputs made on {when} on {html.escape(machine)}. Times and measured rates are this
machine's.</small></p>
<ul class="lessons">
{rows}
</ul>
</body></html>
"""


def build(lessons: list[Path], out: Path, timeout: int = 600) -> list[float]:
    """Execute ``lessons`` and write one page each and ``index.html`` into ``out``; seconds per lesson."""
    # each kernel's environment, not this process's: widgets as pictures, one thread per rank as in make test,
    # and this Python's torchrun first on the PATH
    env = dict(os.environ, DTCOURSE_STATIC_WIDGETS="1", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out.mkdir(parents=True, exist_ok=True)
    infos = [lesson_info(p) for p in lessons]
    pages = [(p.stem + ".html", title) for p, (title, _) in zip(lessons, infos)]
    seconds = []
    for i, path in enumerate(lessons):
        print(f"{path.name}: running ...", end=" ", flush=True)
        try:
            nb, took = execute(path, timeout, env)
        except Exception as err:        # nbclient's CellExecutionError names the cell and the error
            raise SystemExit(f"\n{path}: a cell failed, so the site was not built.\n{err}") from None
        (out / pages[i][0]).write_text(page(nb, nav(pages, i), nav(pages, i, "bottom"), pages[i][1]))
        seconds.append(took)
        print(f"{took:.0f} s", flush=True)
    (out / "index.html").write_text(index(pages, [s for _, s in infos], seconds))
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="site", help="folder for the pages (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one cell may take")
    parser.add_argument("lessons", nargs="*", help="notebooks (default: every lesson, in order)")
    args = parser.parse_args(argv)
    lessons = [Path(p).resolve() for p in args.lessons] or sorted((ROOT / "lessons").glob("[0-9]*.ipynb"))
    start = time.monotonic()
    seconds = build(lessons, Path(args.out), args.timeout)
    print(f"{len(seconds)} lessons in {time.monotonic() - start:.0f} s: open {Path(args.out) / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
