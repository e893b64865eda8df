"""A real JupyterLab in a real browser (issues 3 and 28).

Starts JupyterLab on loopback with the Distributed Python kernelspec installed into a temporary
prefix (one server for the module; each test opens its own notebook, and so its own kernel, and
shuts it down) and drives it in headless Chromium (Debian's ``chromium`` driven by Playwright's
Python package):

- picks "Distributed Python" from the launcher, runs a cell that prints the rank and checks the
  merged output on the page, presses the stop button during a long cell and checks that the cell
  ends and the kernel stays usable, and checks the ranks' widgets;
- JupyterLab's debugger on rank 1 (``%dist_debug 1``): the bug button, a breakpoint clicked in the
  cell's gutter, the cell stopped there with rank 1's variables in the debugger's Variables panel,
  continue, and the cell's merged output.

Screenshots land in the ``artifacts`` dir; with ``DIST_KERNEL_UPDATE_DOCS=1`` the docs' pictures
``docs/jupyterlab.png`` (the README's) and ``docs/debugger.png`` (docs/ranks.md's) are refreshed from them.

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


#: how the module's server is started: plain JupyterLab, as a user who never heard of dist_kernel lab
JUPYTER_LAB = (sys.executable, "-m", "jupyterlab")


class Lab:
    """A JupyterLab server in its own session, with a private JUPYTER_PATH, config and runtime dir,
    started by ``command`` (plain ``jupyter lab``, or ``python -m dist_kernel lab``) with ``options``
    after the test's own."""

    def __init__(self, tmp: Path, command: tuple[str, ...] = JUPYTER_LAB, options: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.command = command
        self.options = options
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
                [*self.command, "--no-browser", "--allow-root",
                 "--ip=127.0.0.1", f"--port={self.port}", "--ServerApp.port_retries=0",
                 "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
                 f"--ServerApp.root_dir={self.tmp / 'root'}", "--LabApp.news_url=None",
                 "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", *self.options],
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

    def shutdown_kernels(self, timeout: float = 30) -> None:
        """Shut down every kernel of the server (a test's notebook kernel) and wait for its processes
        to end; any that do not are reported by :meth:`stop`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.remember_processes()
        api = f"http://127.0.0.1:{self.port}/api/kernels"
        with urllib.request.urlopen(api, timeout=10) as r:
            kernels = json.load(r)
        for kernel in kernels:
            with urllib.request.urlopen(urllib.request.Request(f"{api}/{kernel['id']}", method="DELETE"),
                                        timeout=timeout):
                pass
        psutil.wait_procs([p for p in _tree(self.proc.pid) if p.pid != self.proc.pid], timeout=timeout)

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
def running_lab(tmp: Path, command: tuple[str, ...] = JUPYTER_LAB, options: tuple[str, ...] = ()):
    server = Lab(tmp, command, options)
    ok = False
    try:
        yield server, server.start()
        ok = True
    finally:
        leftovers = server.stop()
    # only when the body passed: a failure inside it must not be hidden by this one
    assert not (ok and leftovers), f"processes left behind after JupyterLab stopped: {leftovers}\n{server.log()}"


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """One JupyterLab server for the module's tests: (server, url)."""
    _require()
    with running_lab(tmp_path_factory.mktemp("jupyterlab")) as lab:
        yield lab


@pytest.fixture
def lab(jupyterlab):
    """The module's server, with the test's kernels shut down after it (no idle ranks beside the next test's)."""
    yield jupyterlab
    jupyterlab[0].shutdown_kernels()


def _cell(page, index: int):
    return page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell").nth(index)


def _type_cell(page, index: int, code: str) -> None:
    """Type ``code`` into cell ``index`` (creating it if needed), leaving it the active cell."""
    cells = page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell")
    while cells.count() <= index:
        _cell(page, cells.count() - 1).locator(".jp-InputArea-prompt").click()
        page.keyboard.press("b")  # command mode: insert a cell below
        page.wait_for_function("n => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell').length > n",
                               arg=index, timeout=5000)
    editor = _cell(page, index).locator(".cm-content")
    editor.click()
    page.keyboard.insert_text(code)  # no key events: no auto-closed brackets or auto-indent


def _run_cell(page, index: int, code: str) -> None:
    """Type ``code`` into cell ``index`` (creating it if needed) and Shift+Enter it."""
    _type_cell(page, index, code)
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


@contextlib.contextmanager
def _browser_page(server: Lab, shots: Path, viewport: dict[str, int]):
    """A page in headless Chromium. On failure its screenshot, HTML, console log and the server's log
    land in ``shots``; afterwards the Playwright driver and Chromium must be gone (the servers and
    their kernels are not this function's)."""
    from playwright.sync_api import sync_playwright

    shots.mkdir(parents=True, exist_ok=True)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM, headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage",
                      "--no-first-run", "--disable-extensions", "--disable-component-update"])
            page = browser.new_page(viewport=viewport)
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.set_default_timeout(30_000)
            try:
                yield page
            except BaseException:
                try:
                    page.screenshot(path=str(shots / "failure.png"))
                    (shots / "failure.html").write_text(page.content())
                except Exception:  # noqa: BLE001 - best effort; keep the original error
                    pass
                (shots / "browser-console.log").write_text("\n".join(console))
                raise
            finally:
                server.remember_processes()
                shutil.copyfile(server.log_path, shots / "jupyterlab.log")
                browser.close()
    finally:
        # what the servers started before the page (a second server's kernels too) is not the page's
        skip = before | {p.pid for pid in before | {server.proc.pid} for p in _tree(pid)}
        mine = [p for p in psutil.Process().children(recursive=True) if p.pid not in skip]
        _gone, alive = psutil.wait_procs(mine, timeout=10)
        for p in alive:
            p.kill()
    assert not alive, f"browser processes left behind: {[p.pid for p in alive]}"


def _open_notebook(page, server: Lab, url: str) -> float:
    """A new notebook with the Distributed Python kernel, from the launcher of a fresh workspace
    (``?reset``: not the tabs an earlier test left open); the seconds until its kernel was idle."""
    page.goto(f"{url}/lab?reset", wait_until="domcontentloaded")
    card = page.locator(CARD)
    card.wait_for(state="visible", timeout=60_000)
    t_click = time.monotonic()
    card.click()
    page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell .cm-content").first.wait_for()
    _wait_kernel_idle(page, timeout=90)
    server.remember_processes()
    return round(time.monotonic() - t_click, 1)


def _update_docs(shot: Path, name: str) -> None:
    """Refresh the docs' picture ``docs/<name>`` from ``shot``, on request only."""
    if os.environ.get("DIST_KERNEL_UPDATE_DOCS"):
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copyfile(shot, REPO / "docs" / name)


def test_jupyterlab_launcher_merged_output_and_interrupt(lab, artifacts):
    server, url = lab
    shots = artifacts / "jupyterlab"
    timings: dict[str, float] = {}
    with _browser_page(server, shots, {"width": 1200, "height": 760}) as page:
        try:
            timings["kernel_ready_s"] = _open_notebook(page, server, url)

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
            _update_docs(shots / "shared-slider.png", "jupyterlab.png")
        finally:
            (shots / "timings.json").write_text(json.dumps(timings) + "\n")


#: the debugged cell: stopped at line 2, rank 1 has x (10) and not yet y
DEBUG_CELL = "x = rank * 10\ny = x + 1\nprint(y)"
BREAK_LINE = 2
#: the debugger's state on the page: the call stack's frames ("name location") and the Variables
#: panel's top-level variables (name -> value as shown)
DEBUGGER_STATE_JS = """() => ({
  frames: [...document.querySelectorAll('.jp-DebuggerCallstack .jp-DebuggerCallstackFrame')]
    .map(f => f.innerText.replace(/\\s+/g, ' ').trim()),
  variables: Object.fromEntries([...document.querySelectorAll('.jp-DebuggerVariables .jp-DebuggerVariables-name')]
    .map(n => [n.textContent.trim(),
               n.nextElementSibling && n.nextElementSibling.classList.contains('jp-DebuggerVariables-detail')
                 ? n.nextElementSibling.textContent.trim() : ''])),
})"""


def _kernel_message(payload: str | bytes) -> dict | None:
    """A kernel message from a frame of JupyterLab's kernel websocket (the v1 binary protocol:
    offsets, then channel, header, parent header, metadata, content), or None."""
    try:
        if isinstance(payload, str):
            return json.loads(payload)
        count = int.from_bytes(payload[:8], "little")
        if not 6 <= count <= 64 or len(payload) < 8 * (count + 1):
            return None  # not a kernel message (a collaboration document's frames are binary too)
        offsets = [int.from_bytes(payload[8 + 8 * i:16 + 8 * i], "little") for i in range(count)]
        parts = [payload[offsets[i]:offsets[i + 1]] for i in range(min(count - 1, 5))]
        return {"channel": parts[0].decode(), "header": json.loads(parts[1]), "parent_header": json.loads(parts[2]),
                "content": json.loads(parts[4])}
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


class DebugTraffic:
    """The kernel's debug and execute messages on a page's websockets: a failure's evidence, and
    which ``debug_request``s still wait for their reply."""

    def __init__(self, page) -> None:
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        self.pending: set[str] = set()
        page.on("websocket", self._listen)

    def _listen(self, ws) -> None:
        if "/api/kernels/" in ws.url:  # the kernel's channels, not a collaboration document's
            ws.on("framesent", lambda p: self._keep(">>", p))
            ws.on("framereceived", lambda p: self._keep("<<", p))

    def _keep(self, direction: str, payload: str | bytes) -> None:
        msg = _kernel_message(payload)
        kind = msg and msg.get("header", {}).get("msg_type", "")
        if not kind or not (kind.startswith("debug_") or kind.startswith("execute_")):
            return
        if kind == "debug_request":
            self.pending.add(msg["header"].get("msg_id", ""))
        elif kind == "debug_reply":
            self.pending.discard((msg.get("parent_header") or {}).get("msg_id", ""))
        self.lines.append(f"{time.monotonic() - self.t0:7.2f} {direction} {kind} {json.dumps(msg.get('content'))[:600]}")

    def wait_settled(self, page, quiet: float = 1.0, timeout: float = 30) -> None:
        """Wait until no debug request has been waiting for its reply for ``quiet`` seconds: the
        frontend's breakpoint updates done (one still on its way could undo a newer one)."""
        deadline = time.monotonic() + timeout
        settled_since = None
        while time.monotonic() < deadline:
            page.wait_for_timeout(100)  # lets Playwright deliver the websocket events
            if self.pending:
                settled_since = None
            elif settled_since is None:
                settled_since = time.monotonic()
            elif time.monotonic() - settled_since >= quiet:
                return
        raise AssertionError(f"debug requests still unanswered after {timeout:.0f}s: {len(self.pending)}")


def _debugger_state(page) -> dict:
    return page.evaluate(DEBUGGER_STATE_JS)


def _enable_debugger(page) -> None:
    """The bug button of the notebook's toolbar: the debugger sidebar opens beside the notebook."""
    panel = page.locator(".jp-NotebookPanel:visible")
    bug = panel.locator(".jp-DebuggerBugButton")
    bug.wait_for()
    page.wait_for_function(  # enabled once JupyterLab knows the kernel can debug (kernel_info: debugger)
        "() => document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-DebuggerBugButton')"
        ".getAttribute('aria-disabled') !== 'true'", timeout=30_000)
    if bug.get_attribute("aria-pressed") != "true":
        bug.click()
    panel.locator(".jp-DebuggerBugButton[aria-pressed='true']").wait_for(timeout=30_000)
    page.locator(".jp-DebuggerSidebar").wait_for(state="visible")


def _toggle_breakpoint(page, index: int, line: int) -> None:
    """Click the breakpoint gutter of cell ``index`` beside its line ``line``; wait until the
    debugger's Breakpoints panel lists it."""
    cell = _cell(page, index)
    box = cell.locator(".cm-line").nth(line - 1).bounding_box()
    gutter = cell.locator(".cm-gutter.cm-breakpoint-gutter").bounding_box()
    assert box and gutter, f"cell {index}: no line {line} or no breakpoint gutter (debugger not enabled?)"
    page.mouse.click(gutter["x"] + gutter["width"] / 2, box["y"] + box["height"] / 2)
    page.locator(".jp-DebuggerBreakpoints .jp-DebuggerBreakpoint-line", has_text=str(line)).first.wait_for(
        timeout=10_000)


def _wait_stopped(page, index: int, line: int, variable: str, timeout: float = 60) -> dict:
    """Wait until the debugged rank is stopped at ``line`` of cell ``index`` with its variables shown:
    the call stack's top frame is that line, and the Variables panel lists ``variable``, one that the
    cell made before that line (the panel shows the kernel's globals before the cell runs too). The
    debugger's state then; an AssertionError with what the page shows when it does not stop."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            f"() => {{ const s = ({DEBUGGER_STATE_JS})(); "
            f"return s.frames.length > 0 && s.frames[0].endsWith(':{line}') && {variable!r} in s.variables; }}",
            timeout=timeout * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"the debugger did not stop at line {line} with the variables shown within "
                             f"{timeout:.0f}s: {_debugger_state(page)}; cell prompt {_prompt(page, index)!r}, "
                             f"output {_output(page, index)!r}") from None
    return _debugger_state(page)


def test_jupyterlab_debugger_stops_rank_1_at_a_gutter_breakpoint(lab, artifacts):
    """Issue 28: with ``%dist_debug 1``, JupyterLab's debugger stops rank 1 at a breakpoint clicked
    in the cell's gutter and shows rank 1's variables; continue finishes the cell on every rank."""
    server, url = lab
    shots = artifacts / "jupyterlab-debugger"
    with _browser_page(server, shots, {"width": 1400, "height": 900}) as page:
        traffic = DebugTraffic(page)
        try:
            _debug_rank_1(page, server, url, shots, traffic)
        finally:
            (shots / "debug-messages.log").write_text("\n".join(traffic.lines) + "\n")


def _debug_rank_1(page, server: Lab, url: str, shots: Path, traffic: DebugTraffic) -> None:
    _open_notebook(page, server, url)
    page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()  # fold the file browser
    _run_cell(page, 0, "%dist_debug 1")
    _wait_prompt_done(page, 0, timeout=30)
    assert _output(page, 0).strip() == "debugger: rank 1", _output(page, 0)
    # the cell's code first: typed while the debugger is on, each change sends the cell's breakpoints
    # again, and one of those still on its way could undo the breakpoint clicked next
    _type_cell(page, 1, DEBUG_CELL)

    _enable_debugger(page)
    page.locator(".jp-DebuggerVariables .jp-DebuggerVariables-name", has_text=re.compile(r"^rank$")).first.wait_for(
        timeout=60_000)  # the debugger started on rank 1: its globals are shown
    traffic.wait_settled(page)
    _toggle_breakpoint(page, 1, BREAK_LINE)
    traffic.wait_settled(page)
    assert page.locator(".jp-DebuggerBreakpoints .jp-DebuggerBreakpoint").count() == 1, "the breakpoint went away"
    _cell(page, 1).locator(".cm-content").click()  # cell 1 active
    page.locator(".jp-NotebookPanel:visible .jp-Toolbar "
                 "[data-command='notebook:run-cell-and-select-next']").click()

    state = _wait_stopped(page, 1, BREAK_LINE, "x")
    variables = state["variables"]
    assert variables.get("rank") == "1", state  # rank 1's, not rank 0's
    assert variables.get("x") == "10", state
    assert "y" not in variables, state  # stopped before line 2 ran
    assert _prompt(page, 1) == "[*]:", _prompt(page, 1)
    page.screenshot(path=str(shots / "debugger.png"))
    _update_docs(shots / "debugger.png", "debugger.png")

    page.locator(".jp-DebuggerSidebar [data-command='debugger:continue']").click()
    _wait_prompt_done(page, 1, timeout=30)
    text = _output(page, 1)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    assert "[rank 0] 1" in lines, text
    assert "[rank 1] 11" in lines, text
    assert text.count("rank 1 is stopped at a breakpoint") == 1, text  # said once, never "hung"
    assert "hung" not in text and "stuck" not in text, text
    page.locator(".jp-DebuggerCallstack .jp-DebuggerCallstackFrame").first.wait_for(state="detached",
                                                                                   timeout=10_000)
    page.screenshot(path=str(shots / "debugger-continued.png"))
