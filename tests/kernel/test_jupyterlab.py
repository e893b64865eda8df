"""A real JupyterLab in a real browser (issue 3).

Starts JupyterLab on loopback with the Distributed Python kernelspec installed into a temporary
prefix, opens it in headless Chromium (Debian's ``chromium`` driven by Playwright's Python package),
picks "Distributed Python" from the launcher, runs a cell that prints the rank and checks the merged
output on the page, presses the stop button during a long cell and checks that the cell ends and the
kernel stays usable. Screenshots land in the ``artifacts`` dir; the merged-output one is also copied
to ``docs/jupyterlab.png`` (shown in the README).

Needs ``/usr/bin/chromium``, ``playwright`` and ``jupyterlab`` (``.ci/install-browser.sh``): when
they are missing the test fails, it does not skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("DIST_KERNEL_CHROMIUM", "/usr/bin/chromium")
DISPLAY_NAME = "Distributed Python"
CARD = f'.jp-LauncherCard[data-category="Notebook"][title="{DISPLAY_NAME}"]'
INSTALL_HINT = "run .ci/install-browser.sh (apt-get install chromium; pip install playwright jupyterlab)"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _require() -> None:
    """Fail (not skip) with a clear message when the browser stack is missing."""
    missing = []
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"chromium ({CHROMIUM})")
    for mod in ("playwright", "jupyterlab"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(f"python package {mod!r}")
    if missing:
        pytest.fail(f"missing for the JupyterLab browser test: {', '.join(missing)}; {INSTALL_HINT}", pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class Lab:
    """A JupyterLab server in its own session, with a private JUPYTER_PATH, config and runtime dir."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        prefix = tmp / "prefix"
        out = subprocess.run([sys.executable, "-m", "dist_kernel", "install", "--prefix", str(prefix), "--ranks", "2"],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, f"kernelspec install failed:\n{out.stdout}\n{out.stderr}"
        kernels = prefix / "share" / "jupyter" / "kernels"
        assert (kernels / "distributed-python" / "kernel.json").is_file(), out.stdout
        root = tmp / "root"
        root.mkdir()
        for d in ("config", "data", "runtime"):
            (tmp / d).mkdir()
        # no "get notified about Jupyter news?" toast over the notebook
        settings = tmp / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True)
        (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
        self.env = {
            **os.environ,
            "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
            "JUPYTER_CONFIG_DIR": str(tmp / "config"),
            "JUPYTER_DATA_DIR": str(tmp / "data"),
            "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(tmp / "config" / "lab" / "user-settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "config" / "lab" / "workspaces"),
            "PYTHONUNBUFFERED": "1",
        }
        self.log_path = tmp / "jupyterlab.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.procs_seen: dict[int, psutil.Process] = {}

    def start(self, timeout: float = 60) -> str:
        for _attempt in range(3):  # a free port can be taken between picking and binding
            self.port = _free_port()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
                 "--ip=127.0.0.1", f"--port={self.port}", "--ServerApp.port_retries=0",
                 "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
                 f"--ServerApp.root_dir={self.tmp / 'root'}", "--LabApp.news_url=None",
                 "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                env=self.env, cwd=self.tmp / "root", stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT,
                start_new_session=True)
            url = f"http://127.0.0.1:{self.port}"
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                        if r.status == 200:
                            return url
                except OSError:
                    time.sleep(0.3)
            if self.proc.poll() is None:
                break
        raise AssertionError(f"JupyterLab did not start on port {self.port}:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def remember_processes(self) -> None:
        if self.proc is not None:
            for p in _tree(self.proc.pid):
                self.procs_seen[p.pid] = p

    def stop(self) -> list[str]:
        """SIGTERM the server (it shuts its kernels down), then make sure nothing it started is left."""
        if self.proc is None:
            return []
        self.remember_processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        _gone, alive = psutil.wait_procs(list(self.procs_seen.values()), timeout=10)
        leftovers = []
        for p in alive:
            try:
                leftovers.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:  # anything else still in the server's session (its process group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return leftovers


@contextlib.contextmanager
def running_lab(tmp: Path):
    server = Lab(tmp)
    ok = False
    try:
        yield server, server.start()
        ok = True
    finally:
        leftovers = server.stop()
    # only when the body passed: a failure inside it must not be hidden by this one
    assert not (ok and leftovers), f"processes left behind after JupyterLab stopped: {leftovers}\n{server.log()}"


def _cell(page, index: int):
    return page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell").nth(index)


def _run_cell(page, index: int, code: str) -> None:
    """Type ``code`` into cell ``index`` (creating it if needed) and Shift+Enter it."""
    cells = page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell")
    while cells.count() <= index:
        _cell(page, cells.count() - 1).locator(".jp-InputArea-prompt").click()
        page.keyboard.press("b")  # command mode: insert a cell below
        page.wait_for_function("n => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell').length > n",
                               arg=index, timeout=5000)
    editor = _cell(page, index).locator(".cm-content")
    editor.click()
    page.keyboard.insert_text(code)  # no key events: no auto-closed brackets or auto-indent
    page.keyboard.press("Shift+Enter")


def _prompt(page, index: int) -> str:
    return _cell(page, index).locator(".jp-InputArea-prompt").inner_text().strip()


def _wait_prompt_done(page, index: int, timeout: float) -> str:
    """Wait until cell ``index`` shows a finished prompt like ``[3]:`` and return it."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = _prompt(page, index)
        if re.fullmatch(r"\[\d+\]:", text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"cell {index} did not finish within {timeout:.0f}s (prompt {text!r})")


def _output(page, index: int) -> str:
    return _cell(page, index).locator(".jp-OutputArea").inner_text()


def _kernel_state(page) -> tuple[str, str]:
    """(kernel display name in the notebook toolbar, execution indicator status)."""
    panel = page.locator(".jp-NotebookPanel:visible")
    name = panel.locator(".jp-KernelName").first.inner_text().strip()
    status = panel.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status") or ""
    return name, status


def _wait_kernel_idle(page, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = ("", "")
    while time.monotonic() < deadline:
        state = _kernel_state(page)
        if state == (DISPLAY_NAME, "idle"):
            return
        time.sleep(0.25)
    raise AssertionError(f"{DISPLAY_NAME} kernel not idle after {timeout:.0f}s (name, status: {state})")


def test_jupyterlab_launcher_merged_output_and_interrupt(tmp_path, artifacts):
    _require()
    with running_lab(tmp_path) as (server, url):
        _drive(server, url, artifacts)


def _drive(server: Lab, url: str, artifacts: Path) -> None:
    from playwright.sync_api import sync_playwright

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        _drive_browser(server, url, artifacts, sync_playwright)
    finally:
        # the Playwright driver and Chromium must be gone too (the server and its kernels are not ours here)
        skip = before | {p.pid for p in _tree(server.proc.pid)}
        mine = [p for p in psutil.Process().children(recursive=True) if p.pid not in skip]
        _gone, alive = psutil.wait_procs(mine, timeout=10)
        for p in alive:
            p.kill()
    assert not alive, f"browser processes left behind: {[p.pid for p in alive]}"


def _drive_browser(server: Lab, url: str, artifacts: Path, sync_playwright) -> None:
    shots = artifacts / "jupyterlab"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage",
                  "--no-first-run", "--disable-extensions", "--disable-component-update"])
        page = browser.new_page(viewport={"width": 1200, "height": 760})
        console: list[str] = []
        timings: dict[str, float] = {}
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.set_default_timeout(30_000)
        try:
            page.goto(f"{url}/lab", wait_until="domcontentloaded")
            card = page.locator(CARD)
            card.wait_for(state="visible", timeout=60_000)
            t_click = time.monotonic()
            card.click()

            page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell .cm-content").first.wait_for()
            _wait_kernel_idle(page, timeout=90)
            timings["kernel_ready_s"] = round(time.monotonic() - t_click, 1)
            server.remember_processes()

            # 1. merged output: the identical line once, the differing ones labelled with their rank
            _run_cell(page, 0, "print('hello from', rank); print('same everywhere')")
            _wait_prompt_done(page, 0, timeout=30)
            text = _output(page, 0)
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            assert lines.count("same everywhere") == 1, text
            assert "[rank 0] hello from 0" in lines, text
            assert "[rank 1] hello from 1" in lines, text
            page.keyboard.press("Escape")  # command mode: no caret in the picture
            page.screenshot(path=str(shots / "merged-output.png"))

            # 2. the stop button ends a long cell on every rank, and the kernel stays usable
            _run_cell(page, 1, "import time\nprint('sleeping', rank, flush=True)\ntime.sleep(60)")
            page.wait_for_function(
                "() => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')[1]"
                ".querySelector('.jp-OutputArea').innerText.includes('sleeping')", timeout=20_000)
            assert _prompt(page, 1) == "[*]:", _prompt(page, 1)
            t0 = time.monotonic()
            page.locator(".jp-NotebookPanel:visible .jp-Toolbar [data-command='notebook:interrupt-kernel']").click()
            _wait_prompt_done(page, 1, timeout=20)
            took = timings["interrupt_s"] = round(time.monotonic() - t0, 1)
            page.wait_for_function(
                "() => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')[1]"
                ".querySelector('.jp-OutputArea').innerText.includes('KeyboardInterrupt')", timeout=5_000)
            text = _output(page, 1)
            assert took < 20, took
            assert "KeyboardInterrupt" in text, text
            assert text.count("Traceback (most recent call last)") == 1, f"KeyboardInterrupt not shown once:\n{text}"
            page.screenshot(path=str(shots / "interrupted.png"))

            _run_cell(page, 2, "print('still here', world_size)")
            _wait_prompt_done(page, 2, timeout=30)
            assert _output(page, 2).strip() == "still here 2", _output(page, 2)
            _wait_kernel_idle(page, timeout=10)
            page.screenshot(path=str(shots / "after-interrupt.png"))

            # 3. widgets made on the ranks render: one slider per rank
            _run_cell(page, 3, "import ipywidgets as w\nw.IntSlider(value=rank, description=f'rank {rank}')")
            _wait_prompt_done(page, 3, timeout=30)
            page.wait_for_function(
                "() => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')[3]"
                ".querySelectorAll('.widget-slider').length === 2", timeout=20_000)
            page.keyboard.press("Escape")  # command mode: no caret in the picture
            page.screenshot(path=str(shots / "widgets.png"))
            # 4. a slider every rank makes the same way is one slider; moving it moves every rank's
            _run_cell(page, 4, "shared = w.IntSlider(value=3)\nshared")
            _wait_prompt_done(page, 4, timeout=30)
            page.wait_for_function(
                "() => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')[4]"
                ".querySelectorAll('.widget-slider').length === 1", timeout=20_000)
            _cell(page, 4).locator(".noUi-handle").first.focus()
            page.keyboard.press("ArrowRight")  # one step: 3 -> 4, on the one slider the ranks share
            page.wait_for_function(
                "() => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')[4]"
                ".querySelector('.widget-readout').innerText.trim() === '4'", timeout=10_000)
            time.sleep(1)  # the frontend's update on its way to the ranks
            _run_cell(page, 5, "print(shared.value)")
            _wait_prompt_done(page, 5, timeout=30)
            assert _output(page, 5).strip() == "4", _output(page, 5)  # unlabelled: every rank has 4
            page.screenshot(path=str(shots / "shared-slider.png"))
            if os.environ.get("DIST_KERNEL_UPDATE_DOCS"):  # refresh the README's picture on request
                (REPO / "docs").mkdir(exist_ok=True)
                shutil.copyfile(shots / "shared-slider.png", REPO / "docs" / "jupyterlab.png")
        except BaseException:
            try:
                page.screenshot(path=str(shots / "failure.png"))
                (shots / "failure.html").write_text(page.content())
            except Exception:  # noqa: BLE001 - best effort; keep the original error
                pass
            (shots / "browser-console.log").write_text("\n".join(console))
            shutil.copyfile(server.log_path, shots / "jupyterlab.log")
            raise
        finally:
            (shots / "timings.json").write_text(json.dumps(timings) + "\n")
            server.remember_processes()
            browser.close()
    shutil.copyfile(server.log_path, shots / "jupyterlab.log")
