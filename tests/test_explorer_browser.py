"""The explorer as a person meets it: ``notebooks/explore.ipynb`` in JupyterLab, in
headless Chromium driven by Playwright.

JupyterLab runs on 127.0.0.1 (a free port, a token, its own config, runtime and
workspace folders, so nothing of the user's is read or restored), on a copy of the
notebook. The test waits for the kernel, runs all cells, checks that every widget
rendered with no widget error, changes the paper setting, a field and the cost source
and checks that the output changed each time, saves the notebook and checks that
opening it did not rewrite its kernelspec or language_info, then shuts JupyterLab down
and checks that no process of it is left.

It needs Debian's ``chromium`` (``/usr/bin/chromium``, or ``TPLIB_CHROMIUM``) and the
``playwright`` package; ``make test-browser`` installs both. Without them it is skipped
with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tplib.reproduce import notebooks_dir

CHROMIUM = os.environ.get("TPLIB_CHROMIUM") or shutil.which("chromium")
# Chromium's own background traffic is refused on a closed network, many times a second.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000

try:
    from playwright.sync_api import Page, sync_playwright
except ImportError:  # the browser extra is not installed
    sync_playwright = None  # type: ignore[assignment]

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium: install Debian's chromium (make test-browser does, as root)",
    ),
    pytest.mark.skipif(
        sync_playwright is None,
        reason="no playwright: pip install -e '.[browser]' (make test-browser does)",
    ),
]


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    process: subprocess.Popen[bytes]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    root, port, token = tmp_path / "root", _free_port(), secrets.token_hex(16)
    root.mkdir()
    shutil.copy(notebooks_dir() / "explore.ipynb", root / "explore.ipynb")
    env = os.environ | {
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
    }
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
        "--LabApp.expose_app_in_browser=True",
        *(["--allow-root"] if os.geteuid() == 0 else []),
    ]
    log = (tmp_path / "lab.log").open("wb")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                _get(f"{url}/api/status?token={token}")
                break
            assert proc.poll() is None, (tmp_path / "lab.log").read_text()
            assert time.monotonic() < deadline, "JupyterLab did not answer within 60 s"
            time.sleep(0.2)
        yield Lab(url, token, root, proc)
    finally:
        _shut_down(proc, url, token)
        log.close()


def _shut_down(proc: subprocess.Popen[bytes], url: str, token: str) -> None:
    """Ask JupyterLab to stop (it stops its kernels), then make sure of it: no process
    it started may outlive the test."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(OSError):
        req = urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST")
        urllib.request.urlopen(req, timeout=5).close()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _, alive = psutil.wait_procs(family, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"processes left after JupyterLab stopped: {alive}"


def _explorer_text(page: Page) -> str:
    """The explorer's output: the plan's text and its table, or the error."""
    return str(page.locator(".widget-output").first.inner_text())


def _wait_for_change(page: Page, before: str) -> str:
    deadline = time.monotonic() + TIMEOUT_MS / 1e3
    while (now := _explorer_text(page)) == before or "planning" in _status(page):
        assert time.monotonic() < deadline, f"the explorer's output did not change from {before!r}"
        page.wait_for_timeout(100)
    return now


def _status(page: Page) -> str:
    return str(page.locator(".widget-html").first.inner_text())


def _outputs(page: Page) -> str:
    """Every cell's output, as text (not the cells' sources, which may quote errors)."""
    return "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())


def _command(page: Page, name: str) -> None:
    page.evaluate(f"window.jupyterapp.commands.execute({name!r})")


def test_the_explorer_in_jupyterlab_in_chromium(lab: Lab) -> None:
    t0 = time.monotonic()
    original = json.loads((lab.root / "explore.ipynb").read_text())
    assert sync_playwright is not None and CHROMIUM is not None
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(f"{lab.url}/lab/tree/explore.ipynb?token={lab.token}")
            # Run All before the kernel is idle would run nothing.
            page.wait_for_selector(".jp-Notebook")
            page.wait_for_function(
                "() => { const w = window.jupyterapp.shell.currentWidget;"
                " const k = w && w.sessionContext && w.sessionContext.session"
                " && w.sessionContext.session.kernel;"
                " return k && k.status === 'idle'; }"
            )
            _command(page, "notebook:run-all-cells")
            page.wait_for_selector(".widget-output >> text=DP plan:")
            page.wait_for_function(
                "() => document.querySelectorAll('.jp-Notebook .jp-InputPrompt').length > 0 &&"
                " [...document.querySelectorAll('.jp-InputPrompt')]"
                ".every(p => !p.textContent.includes('*'))"
            )
            outputs = _outputs(page)
            assert "Error displaying widget" not in outputs and "Traceback" not in outputs
            for cls in ("widget-dropdown", "widget-toggle-buttons", "widget-text", "widget-output"):
                assert page.locator(f".jp-Notebook .{cls}").count() > 0, cls
            setting = page.locator(".widget-dropdown:has-text('paper setting') select")
            assert "(9)" in setting.locator("option:checked").inner_text()
            shown = _explorer_text(page)
            assert "DP plan:" in shown and "best uniform" in shown

            setting.select_option(index=3)  # another paper setting
            shown = _wait_for_change(page, shown)
            assert "DP plan:" in shown

            stages = page.locator(".widget-inline-hbox:has-text('#Pipe K') input")
            stages.fill(str(int(stages.input_value()) * 2))
            stages.press("Enter")
            shown = _wait_for_change(page, shown)
            # A hand edit leaves the paper setting, and the dropdown says so.
            assert setting.locator("option:checked").inner_text() == "custom"

            page.locator(".widget-toggle-button:has-text('profile file')").click()
            shown = _wait_for_change(page, shown)
            assert "enter its path" in shown

            assert "Error displaying widget" not in _outputs(page)
            _command(page, "docmanager:save")
            page.wait_for_function(
                "() => !window.jupyterapp.shell.currentWidget.context.model.dirty"
            )
        finally:
            browser.close()
    saved = json.loads((lab.root / "explore.ipynb").read_text())
    # Opening and running it must not rewrite what the repository commits.
    for key in ("kernelspec", "language_info"):
        assert saved["metadata"][key] == original["metadata"][key], key
    print(f"browser test: {time.monotonic() - t0:.1f} s")
