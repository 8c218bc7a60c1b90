"""A real headless Chromium for the chat page's tests, driven over the DevTools protocol (CDP) with
aiohttp's websocket client (a runtime dependency already): no WebDriver, no Node, no new package.

Chromium is Debian's `chromium` package, installed on first use as the client venvs are made
(client_venv.py): on demand, once per machine (apt-get, as root), under a lock so that two test
runs install it once. Only an unreachable package archive is reported as such (the caller may
skip, saying so); any other failure is an error."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from lockstep.testing.client_venv import PackageIndexUnreachable
from lockstep.utils.cache import cache_dir, cache_lock
from lockstep.utils.process import die_with_parent

CHROMIUM = Path("/usr/bin/chromium")
INSTALL = (["apt-get", "update", "-q"],
           ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"])
# apt's words when the archive cannot be reached.
_NO_ARCHIVE = ("Temporary failure resolving", "Could not resolve", "Failed to fetch",
               "Unable to locate package", "Network is unreachable")
# Without the background-networking flags Chromium keeps dialling Google's services, and on a
# closed network those refusals stall it; --remote-debugging-port=0 picks a free port, which
# Chromium writes to <user-data-dir>/DevToolsActivePort.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1200,800", "--remote-debugging-port=0")


def ensure_chromium(timeout: float = 1200) -> Path:
    """/usr/bin/chromium, installed with apt-get when it is missing."""
    if CHROMIUM.exists():
        return CHROMIUM
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError(f"{CHROMIUM} is missing; install Debian's chromium package "
                           f"({' && '.join(' '.join(c) for c in INSTALL)}) as root")
    lock = cache_dir("chromium-install.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(lock):
        if CHROMIUM.exists():  # another test run installed it while we waited
            return CHROMIUM
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in INSTALL:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            output = done.stdout + done.stderr
            if done.returncode != 0 or (cmd[1] == "update" and "Failed to fetch" in output):
                if any(s in output for s in _NO_ARCHIVE):
                    raise PackageIndexUnreachable(f"apt cannot reach its archive: {output[-300:]}")
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    return CHROMIUM


class Page:
    """One browser tab over CDP: evaluate JavaScript, click and type as a user does (input
    events at the element, not DOM calls), screenshots; events seen while waiting are kept."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self._next_id = 0

    async def call(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        call_id = self._next_id
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        deadline = time.monotonic() + timeout
        while True:
            msg = await self.ws.receive(timeout=max(0.01, deadline - time.monotonic()))
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"the browser closed the DevTools connection ({msg.type})")
            data = json.loads(msg.data)
            if data.get("id") == call_id:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data.get("result", {})
            self.events.append(data)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True,
                                 returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60, every: float = 0.05) -> Any:
        """The first truthy value of `expression`, polled."""
        deadline = time.monotonic() + timeout
        while not (value := await self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true within {timeout:g} s: {expression}")
            await asyncio.sleep(every)
        return value

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for(f"location.href === {json.dumps(url)} && "
                            "document.readyState === 'complete'")

    async def click(self, selector: str) -> None:
        x, y = await self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                            clickCount=1)

    async def type(self, selector: str, text: str) -> None:
        """Click into the field, select what is there, and type `text` over it."""
        await self.click(selector)
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).select()")
        await self.call("Input.insertText", text=text)

    async def press_enter(self) -> None:
        key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13}
        await self.call("Input.dispatchKeyEvent", type="keyDown", text="\r", **key)
        await self.call("Input.dispatchKeyEvent", type="keyUp", **key)

    async def screenshot(self, path: Path) -> Path:
        data = await self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def errors(self) -> list[str]:
        """The page's uncaught exceptions and the errors it logged (CSP violations included)."""
        out = []
        for e in self.events:
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(json.dumps(e["params"]["exceptionDetails"])[:500])
            elif e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error":
                entry = e["params"]["entry"]
                out.append(f"{entry.get('source')}: {entry['text']} {entry.get('url', '')}")
        return out


@contextlib.asynccontextmanager
async def headless_chromium(timeout: float = 60) -> AsyncIterator[Page]:
    """A fresh Chromium (its own profile in a new temporary folder) and its first tab, with
    runtime, log and network events on; on exit the browser is killed by its PID."""
    chromium = ensure_chromium()
    with tempfile.TemporaryDirectory(prefix="lockstep-chromium-") as profile:
        log = open(Path(profile) / "chromium.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen([str(chromium), *FLAGS, f"--user-data-dir={profile}",
                                 "about:blank"], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_own_group_dying_with_parent)
        try:
            port = await _devtools_port(Path(profile), proc, timeout)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                    tabs = [t for t in await r.json() if t["type"] == "page"]
                async with http.ws_connect(tabs[0]["webSocketDebuggerUrl"],
                                           max_msg_size=0) as ws:
                    page = Page(ws)
                    for domain in ("Page", "Runtime", "Log", "Network"):
                        await page.call(f"{domain}.enable")
                    yield page
        finally:
            _kill_group(proc)
            log.close()


def _own_group_dying_with_parent() -> None:
    os.setpgid(0, 0)  # Chromium's renderer, GPU and utility processes join this group
    die_with_parent()


def _kill_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Kill Chromium and every process it started, by its group (its PID), and wait until none is
    left: killing the browser alone left its children writing into the profile folder while it was
    being removed ("Directory not empty"), and left them running after the test."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise RuntimeError(f"chromium's processes (group {proc.pid}) outlived SIGKILL for {timeout:g} s")


async def _devtools_port(profile: Path, proc: subprocess.Popen, timeout: float) -> int:
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while not (active.exists() and active.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = "exited" if proc.poll() is not None else f"gave no DevTools port in {timeout:g} s"
            log = (profile / "chromium.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"chromium {why}:\n{log}")
        await asyncio.sleep(0.1)
    return int(active.read_text().split()[0])
