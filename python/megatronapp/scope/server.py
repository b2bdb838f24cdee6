"""The MegaScope web server: one aiohttp application on its own thread of rank 0.

HTTP/JSON and WebSocket API (docs/scope.md):

- ``GET /`` the page; ``GET /static/...`` its modules; ``GET /static/plotly.min.js``
  the plotly.js bundled in the ``plotly`` wheel (nothing from the internet).
- ``GET /api/info``; ``POST /api/generate``, ``/api/perturb``, ``/api/clear``.
- ``GET /ws``: a WebSocket taking the same commands as ``{"op": ..., ...}`` and
  pushing ``{"type": "step", ...}`` while attached to a training run.

Requests are validated here, before they reach the ranks; every error is
``{"error": "..."}`` with status 400 (413 for an oversized body). The server
binds 127.0.0.1 by default; any other address needs a token (``--token``),
sent as ``Authorization: Bearer T`` or ``?token=T`` (megatronapp._http, which
the generation server shares). Commands go to the
rank-0 thread that drives the model through a queue, so a client that
connects, disconnects or misbehaves never touches the training loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading

from .._http import HttpServerThread
from . import ScopeError, check_perturbation

__all__ = ["ScopeServer", "validate", "MAX_REQUEST_BYTES"]

MAX_REQUEST_BYTES = 64 * 1024
MAX_BACKLOG = 8  #: events waiting to be sent before newer ones are dropped
STATIC = os.path.join(os.path.dirname(__file__), "static")


def _plotly_js() -> str | None:
    try:
        import plotly
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    return path if os.path.isfile(path) else None


def _typed(cmd, key, types, default, name=None):
    v = cmd.get(key, default)
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        want = " or ".join(t.__name__ for t in types)
        raise ScopeError(f"{name or key}: expected {want}, got {type(v).__name__}")
    return v


def _layers(layers):
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and (not isinstance(layers, list) or len(layers) > 4096 or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise ScopeError("layers: expected a layer number, a list of them, or null")
    return layers


def validate(cmd) -> dict:
    """A client's command checked and normalized (ScopeError otherwise)."""
    from .session import MAX_PROMPT_CHARS

    if not isinstance(cmd, dict):
        raise ScopeError("a command is a JSON object like {\"op\": \"generate\", ...}")
    op = cmd.get("op")
    if op in ("info", "clear"):
        return {"op": op}
    if op in ("watch", "unwatch"):
        out = {"op": op}
        for k, types in (("site", (str,)), ("reduce", (str,)), ("bins", (int,)), ("dim", (int,)),
                         ("k", (int,))):
            if k in cmd:
                out[k] = _typed(cmd, k, types, None)
        if op == "watch" and "site" not in out:
            raise ScopeError("watch needs a site")
        if "layers" in cmd:
            out["layers"] = _layers(cmd["layers"])
        return out
    if op == "generate":
        prompts = cmd.get("prompts")
        if prompts is None:
            prompts = [_typed(cmd, "prompt", (str,), None)]
        if not isinstance(prompts, list) or not 1 <= len(prompts) <= 16 \
                or not all(isinstance(p, str) and p for p in prompts):
            raise ScopeError("prompts: expected 1 to 16 non-empty strings")
        if sum(len(p) for p in prompts) > MAX_PROMPT_CHARS:
            raise ScopeError(f"prompts: more than {MAX_PROMPT_CHARS} characters in all")
        out = {"op": op, "prompts": prompts,
               "max_new_tokens": _typed(cmd, "max_new_tokens", (int,), 8),
               "mode": _typed(cmd, "mode", (str,), "slow"),
               "top_k": _typed(cmd, "top_k", (int,), 5),
               "sample": _typed(cmd, "sample", (bool,), False),
               "temperature": float(_typed(cmd, "temperature", (int, float), 1.0)),
               "seed": _typed(cmd, "seed", (int,), 0),
               "bins": _typed(cmd, "bins", (int,), 64)}
        if not 1 <= out["top_k"] <= 50 or not 1 <= out["bins"] <= 512:
            raise ScopeError("top_k must be in [1, 50] and bins in [1, 512]")
        if out["mode"] not in ("slow", "fast"):
            raise ScopeError(f"mode {out['mode']!r}: expected slow or fast")
        return out
    if op == "perturb":
        site = _typed(cmd, "site", (str,), None)
        kind = _typed(cmd, "kind", (str,), None)
        check_perturbation(site, kind)
        out = {"op": op, "site": site, "kind": kind}
        for k, types in (("std", (int, float)), ("scale", (int, float)),
                         ("fraction", (int, float)), ("bit", (int,)), ("head", (int,)),
                         ("seed", (int,)), ("name", (str,))):
            if k in cmd:
                v = _typed(cmd, k, types, None)
                out[k] = float(v) if float in types else v
        if "layers" in cmd:
            out["layers"] = _layers(cmd["layers"])
        if "steps" in cmd:
            steps = cmd["steps"]
            if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
                raise ScopeError("steps: expected a positive integer, or null (until cleared)")
            out["steps"] = steps
        return out
    raise ScopeError(f"unknown op {op!r}: expected info, generate, perturb, clear, watch or "
                     "unwatch")


class ScopeServer(HttpServerThread):
    """The web server on a daemon thread. ``requests`` holds (command,
    reply) pairs for the thread that drives the ranks; ``publish`` pushes
    an event to every WebSocket client."""

    client_errors = (ScopeError,)
    thread_name = "mapp-scope-server"

    def __init__(self, host: str = "127.0.0.1", port: int = 8080, token: str | None = None):
        super().__init__(host, port, token, max_request_bytes=MAX_REQUEST_BYTES,
                         refuse=ScopeError)
        self._clients: set = set()
        self._backlog = 0  # events queued for sending (under _lock)
        self._lock = threading.Lock()
        self.dropped = 0  #: events dropped because clients were slower than training

    def routes(self, app) -> None:
        app.router.add_get("/", self._index)
        app.router.add_get("/api/info", self._api)
        for op in ("generate", "perturb", "clear", "info", "watch", "unwatch"):
            app.router.add_post(f"/api/{op}", self._api)
        app.router.add_get("/ws", self._ws)
        app.router.add_get("/static/plotly.min.js", self._plotly)
        app.router.add_static("/static/", STATIC)

    async def before_shutdown(self) -> None:
        for ws in list(self._clients):
            try:
                await asyncio.wait_for(ws.close(code=1001, message=b"run ended"), 2)
            except Exception:  # noqa: BLE001 - a client that vanished
                pass

    def _json_error(self, status: int, text: str):
        return self.error_response(status, text)

    # ---- handlers ---------------------------------------------------------
    async def _index(self, request):
        from aiohttp import web

        return web.FileResponse(os.path.join(STATIC, "index.html"))

    async def _plotly(self, request):
        from aiohttp import web

        path = _plotly_js()
        if path is None:
            return self._json_error(404, "plotly is not installed: pip install plotly")
        return web.FileResponse(path)

    async def submit(self, cmd: dict) -> dict:
        """Queues a validated command for the driving thread; its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def reply(result):
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))
        try:
            self.requests.put_nowait((cmd, reply))
        except queue.Full:
            return {"error": "busy: too many requests queued; retry shortly"}
        return await fut

    async def _api(self, request):
        from aiohttp import web

        op = request.path.rsplit("/", 1)[1]
        body = {}
        if request.method == "POST" and request.can_read_body:
            raw = await request.read()
            body = json.loads(raw) if raw.strip() else {}
            if not isinstance(body, dict):
                raise ScopeError("the request body must be a JSON object")
        cmd = validate({**body, "op": op})
        result = await self.submit(cmd)
        return web.json_response(result, status=400 if "error" in result else 200)

    async def _ws(self, request):
        from aiohttp import WSMsgType, web

        ws = web.WebSocketResponse(max_msg_size=MAX_REQUEST_BYTES, heartbeat=30)
        await ws.prepare(request)
        self._clients.add(ws)
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    if msg.type == WSMsgType.ERROR:
                        break
                    await ws.send_json({"error": "send JSON text messages"})
                    continue
                try:
                    cmd = validate(json.loads(msg.data))
                except (ScopeError, json.JSONDecodeError) as e:
                    await ws.send_json({"error": str(e)})
                    continue
                result = await self.submit(cmd)
                await ws.send_json({"type": "reply", "op": cmd["op"], **result})
        finally:
            self._clients.discard(ws)
        return ws

    # ---- pushing events (from any thread) ---------------------------------
    def publish(self, event: dict) -> None:
        """Queues `event` for every client; encoding and sending happen on
        the server's thread (off the training loop's path)."""
        if self._loop is None or not self._clients:
            return
        with self._lock:
            if self._backlog >= MAX_BACKLOG:  # slow clients: drop, never queue unboundedly
                self.dropped += 1
                return
            self._backlog += 1

        async def send():
            try:
                data = json.dumps(event)
                for ws in list(self._clients):
                    try:
                        await asyncio.wait_for(ws.send_str(data), 10)
                    except Exception:  # noqa: BLE001 - a client gone or stuck mid-send
                        self._clients.discard(ws)
            finally:
                with self._lock:
                    self._backlog -= 1
        asyncio.run_coroutine_threadsafe(send(), self._loop)

    @property
    def has_clients(self) -> bool:
        return bool(self._clients)
