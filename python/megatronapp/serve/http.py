"""The OpenAI-style HTTP API of the generation server (rank 0's thread).

- ``POST /v1/completions``: OpenAI's completion request (``prompt`` a string,
  a list of strings, a token-id list or a list of them; ``max_tokens``,
  ``temperature``, ``top_p``, ``stop``, ``seed``, ``stream``, ``logprobs`` 0,
  ``n`` 1) plus ``top_k`` and ``ignore_eos`` (vLLM's extensions). Each prompt
  is a choice. With ``stream`` the reply is server-sent events, one per new
  piece of text, then ``data: [DONE]``.
- ``GET /v1/models``, ``GET /health``.

Every error is OpenAI's JSON ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad request (an unknown field is one), 401 without the
token, 404 for another model's name or an unknown path, 413 for a body over
the cap, 503 when the queue is full. Generation runs on the ranks, driven by
the main thread of rank 0 (:mod:`megatronapp.serve`); a request waits in
``requests`` for the next batch.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
import uuid

from .._http import HttpServerThread
from ..inference.sampling import SamplingParams

__all__ = ["CompletionServer", "RequestError", "Job", "TextStream", "parse_completion"]

#: the fields a completion request may carry (OpenAI's, and top_k / ignore_eos)
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
          "stop", "seed", "logprobs", "echo", "ignore_eos", "user", "presence_penalty",
          "frequency_penalty", "best_of", "suffix", "stream_options"}
MAX_STOP = 4


class RequestError(ValueError):
    """A client's mistake: 400 (or `status`) with this message."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _typed(body, key, types, default):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        want = " or ".join(t.__name__ for t in types)
        raise RequestError(f"{key}: expected {want}, got {type(v).__name__}", key)
    return v


def parse_completion(body, tokenize, *, seq_length: int, vocab: int, model: str) -> dict:
    """A /v1/completions body checked: {"prompts": [token lists], "params":
    SamplingParams, "stream", "logprobs", "model"}. RequestError names the
    field that is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    name = body.get("model")
    if name is not None and name != model:
        raise RequestError(f"model {name!r} is not served here (this server serves {model!r})",
                           "model", status=404)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not 1 <= len(prompt) <= 64:
        raise RequestError("prompt: expected a string, a list of 1 to 64 strings, a list of "
                           "token ids or a list of such lists", "prompt")
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            ids = tokenize(p)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
            if any(not 0 <= t < vocab for t in p):
                raise RequestError(f"prompt: token ids must be in [0, {vocab})", "prompt")
            ids = list(p)
        else:
            raise RequestError("prompt: each prompt is a string or a list of token ids",
                               "prompt")
        if not ids:
            raise RequestError("prompt: an empty prompt (give at least one token)", "prompt")
        prompts.append(ids)
    for key, allowed in (("n", 1), ("best_of", 1)):
        if _typed(body, key, (int,), 1) != allowed:
            raise RequestError(f"{key}: only {allowed} is supported (send the prompt again, "
                               "with another seed, for more)", key)
    for key in ("presence_penalty", "frequency_penalty"):
        if _typed(body, key, (int, float), 0) != 0:
            raise RequestError(f"{key}: penalties are not supported (leave it 0)", key)
    if _typed(body, "echo", (bool,), False):
        raise RequestError("echo: not supported (the prompt is yours already)", "echo")
    if body.get("suffix") is not None:
        raise RequestError("suffix: insertion is not supported", "suffix")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or logprobs != 0):
        raise RequestError("logprobs: only 0 (the chosen tokens' log-probabilities) or null "
                           "is supported", "logprobs")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(
            isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop: a non-empty string or a list of up to {MAX_STOP}", "stop")
    longest = max(len(p) for p in prompts)
    params = SamplingParams(
        max_tokens=_typed(body, "max_tokens", (int,), 16),
        temperature=float(_typed(body, "temperature", (int, float), 1.0)),
        top_p=float(_typed(body, "top_p", (int, float), 1.0)),
        top_k=max(0, _typed(body, "top_k", (int,), 0)),  # -1 (vLLM's "off") too
        seed=_typed(body, "seed", (int,), None), stop=stop,
        ignore_eos=_typed(body, "ignore_eos", (bool,), False))
    try:
        params.check(seq_length - longest)
    except ValueError as e:
        raise RequestError(f"{e} (the model's seq_length is {seq_length}; the longest prompt "
                           f"has {longest} tokens)", str(e).split()[0]) from None
    return {"prompts": prompts, "params": params, "stream": _typed(body, "stream", (bool,), False),
            "logprobs": logprobs is not None, "model": model}


class TextStream:
    """The text of a growing token list, released safely: never a stop
    string or what may become one, never half of a UTF-8 character."""

    def __init__(self, detokenize, stop: list):
        self.detokenize, self.stop = detokenize, stop
        self.sent = 0

    def text(self, tokens: list, finished: bool) -> str:
        """The completion's text so far that may be shown (all of it, cut at
        a stop string, once `finished`)."""
        text = self.detokenize(tokens)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut]
        if finished:
            return text
        text = text.rstrip("\ufffd")  # an incomplete character (byte-level tokens)
        hold = max((k for s in self.stop for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        return text[:len(text) - hold]

    def delta(self, tokens: list, finished: bool) -> str:
        text = self.text(tokens, finished)
        piece, self.sent = text[self.sent:], max(self.sent, len(text))
        return piece


class Job:
    """One prompt of a request: its tokens and parameters for the ranks, and
    the queue its events reach the handler through (from the driving thread)."""

    def __init__(self, server, prompt: list, params: SamplingParams):
        self.server, self.prompt, self.params = server, prompt, params
        self.events: asyncio.Queue = asyncio.Queue()

    def push(self, event: dict) -> None:
        """(driving thread) {"token", "logprob", "finish_reason"} or {"error"}."""
        self.server.call_soon(self.events.put_nowait, event)


class CompletionServer(HttpServerThread):
    """`tokenizer` (tokenize / detokenize), `model`: the served name;
    `seq_length`, `vocab`: the model's limits."""

    client_errors = (RequestError,)
    thread_name = "mapp-serve-http"

    def __init__(self, host: str, port: int, token: str | None, *, tokenizer, model: str,
                 seq_length: int, vocab: int, max_request_bytes: int = 1 << 20,
                 queue_size: int = 256):
        super().__init__(host, port, token, max_request_bytes=max_request_bytes,
                         queue_size=queue_size)
        self.tokenizer, self.model = tokenizer, model
        self.seq_length, self.vocab = seq_length, vocab

    def routes(self, app) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)

    def error_response(self, status: int, text: str, param: str | None = None):
        from aiohttp import web

        kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                503: "server_busy"}.get(status, "invalid_request_error" if status < 500
                                          else "server_error")
        return web.json_response({"error": {"message": text, "type": kind, "param": param,
                                            "code": None}}, status=status)

    def client_error(self, e):
        return self.error_response(getattr(e, "status", 400), str(e), getattr(e, "param", None))

    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok"})

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "megatronapp",
             "max_model_len": self.seq_length}]})

    async def _completions(self, request):
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"malformed JSON: {e}") from None
        req = parse_completion(body, self.tokenizer.tokenize, seq_length=self.seq_length,
                               vocab=self.vocab, model=self.model)
        jobs = [Job(self, p, req["params"]) for p in req["prompts"]]
        for job in jobs:
            try:
                self.requests.put_nowait(job)
            except queue.Full:
                raise RequestError("the server is busy (its queue is full): retry shortly",
                                   status=503) from None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model}
        if req["stream"]:
            return await self._stream(request, jobs, head, req)
        choices, used = [], 0
        for i, job in enumerate(jobs):
            try:
                tokens, logprobs, reason = await self._collect(job)
            except RuntimeError as e:
                return self.error_response(500, f"generation failed: {e}")
            text = TextStream(self.tokenizer.detokenize, job.params.stop).text(tokens, True)
            choices.append({"text": text, "index": i, "finish_reason": reason,
                            "logprobs": self._logprobs(tokens, logprobs) if req["logprobs"]
                            else None})
            used += len(tokens)
        from aiohttp import web

        prompt_tokens = sum(len(p) for p in req["prompts"])
        return web.json_response({**head, "choices": choices, "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": used,
            "total_tokens": prompt_tokens + used}})

    async def _collect(self, job):
        tokens, logprobs = [], []
        while True:
            ev = await job.events.get()
            if "error" in ev:
                raise RuntimeError(ev["error"])
            tokens.append(ev["token"])
            logprobs.append(ev["logprob"])
            if ev["finish_reason"] is not None:
                return tokens, logprobs, ev["finish_reason"]

    def _logprobs(self, tokens, logprobs):
        return {"tokens": [self.tokenizer.detokenize([t]) for t in tokens],
                "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}

    async def _stream(self, request, jobs, head, req):
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        async def follow(i, job):
            stream = TextStream(self.tokenizer.detokenize, job.params.stop)
            tokens = []
            while True:
                ev = await job.events.get()
                if "error" in ev:
                    await send({**head, "error": {"message": ev["error"],
                                                  "type": "server_error"}})
                    return
                tokens.append(ev["token"])
                done = ev["finish_reason"] is not None
                piece = stream.delta(tokens, done)
                if piece or done:
                    await send({**head, "choices": [{
                        "text": piece, "index": i, "finish_reason": ev["finish_reason"],
                        "logprobs": self._logprobs([ev["token"]], [ev["logprob"]])
                        if req["logprobs"] else None}]})
                if done:
                    return
        try:
            await asyncio.gather(*(follow(i, j) for i, j in enumerate(jobs)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass  # the client left; the batch finishes without it
        return resp
