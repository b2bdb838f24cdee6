"""An aiohttp application on its own daemon thread: what MegaScope's server
and the generation server (megatronapp.serve) share.

- It binds 127.0.0.1 unless given a token; any other address without one is
  refused at start (the model would be exposed beyond this machine). With a
  token, every request must carry ``Authorization: Bearer T`` (or ``?token=T``);
  otherwise 401.
- Bodies are capped (413 above ``max_request_bytes``); malformed JSON and
  the subclass's client errors are 400; every error is JSON
  (:meth:`HttpServerThread.error_response`).
- A malformed HTTP request is logged as one line naming the client's mistake,
  not as a traceback that reads like a crash.
- Work for the threads that drive the ranks goes through ``requests``, a
  bounded queue, so a client that misbehaves never touches them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import queue
import threading

__all__ = ["HttpServerThread", "LOOPBACK"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class _OneLineBadRequests(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        from aiohttp.http_exceptions import HttpProcessingError

        if isinstance(exc, HttpProcessingError):
            reason = " ".join(str(getattr(exc, "message", exc)).split())
            record.msg = f"megatronapp http: rejected a malformed request ({exc.code}: {reason})"
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_BAD_REQUESTS = _OneLineBadRequests()


class HttpServerThread:
    """Subclasses add routes (:meth:`routes`) and name their client errors
    (``client_errors``: exception types answered with 400 and their text)."""

    client_errors: tuple = (ValueError,)
    thread_name = "mapp-http"

    def __init__(self, host: str, port: int, token: str | None, *, max_request_bytes: int,
                 queue_size: int = 64, refuse=ValueError):
        if host not in LOOPBACK and not token:
            raise refuse(f"binding {host} exposes the model beyond this machine: give "
                         "--token T (clients send 'Authorization: Bearer T')")
        self.host, self.port, self.token = host, port, token
        self.max_request_bytes = max_request_bytes
        self.requests: queue.Queue = queue.Queue(maxsize=queue_size)
        self._loop = None
        self._runner = None
        self._ready = threading.Event()
        self._error = None
        self._thread = threading.Thread(target=self._main, name=self.thread_name, daemon=True)

    # ---- what subclasses give ----------------------------------------------
    def routes(self, app) -> None:
        raise NotImplementedError

    def error_response(self, status: int, text: str):
        from aiohttp import web

        return web.json_response({"error": text}, status=status)

    def client_error(self, e: Exception):
        """The answer to one of ``client_errors``."""
        return self.error_response(400, str(e))

    async def before_shutdown(self) -> None:
        """Runs on the server's loop before the listener closes."""

    # ---- lifecycle --------------------------------------------------------
    def start(self):
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Closes the listener; never raises (a client that does not go away
        cannot hold the process's exit: the thread is a daemon)."""
        if self._loop is None:
            return

        async def shutdown():
            await self.before_shutdown()
            await self._runner.cleanup()
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        except Exception:  # noqa: BLE001 - see the docstring
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop = None

    def write_port_file(self, path: str | None) -> None:
        """Writes the bound port to `path` atomically (for launchers and tests
        that start the server with --port 0)."""
        if path:
            with open(path + ".tmp", "w") as f:
                f.write(str(self.port))
            os.replace(path + ".tmp", path)

    def call_soon(self, fn, *args) -> None:
        """Runs fn(*args) on the server's loop (from any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn, *args)

    def _main(self) -> None:
        from aiohttp import web

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            app = web.Application(client_max_size=self.max_request_bytes,
                                  middlewares=[self._errors, self._auth])
            self.routes(app)
            server_log = logging.getLogger("aiohttp.server")
            if _BAD_REQUESTS not in server_log.filters:
                server_log.addFilter(_BAD_REQUESTS)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
            self._loop = loop
        except Exception as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()

    # ---- middleware -------------------------------------------------------
    async def _errors(self, app, handler):
        from aiohttp import web

        async def wrapped(request):
            try:
                return await handler(request)
            except web.HTTPRequestEntityTooLarge:
                return self.error_response(
                    413, f"request larger than {self.max_request_bytes} bytes")
            except web.HTTPException as e:
                if e.status >= 400:
                    return self.error_response(e.status, e.reason)
                raise
            except json.JSONDecodeError as e:
                return self.error_response(400, f"malformed JSON: {e}")
            except self.client_errors as e:
                return self.client_error(e)
        return wrapped

    async def _auth(self, app, handler):
        async def wrapped(request):
            if self.token is None:
                return await handler(request)
            given = request.query.get("token") or request.headers.get(
                "Authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                return self.error_response(401, "missing or wrong token (send 'Authorization: "
                                                "Bearer T' or ?token=T)")
            return await handler(request)
        return wrapped
