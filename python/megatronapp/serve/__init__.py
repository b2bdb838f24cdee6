"""The generation server: a checkpoint's model over tensor- and
pipeline-parallel ranks behind an OpenAI-style ``/v1/completions``.

    torchrun --nproc-per-node 4 -m megatronapp.serve --load ckpt/ \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --port 8000
    curl -s localhost:8000/v1/completions -d '{"prompt": "In the beginning", "max_tokens": 20}'

Rank 0 hosts the HTTP thread (:mod:`.http`) and drives the ranks: it takes
the queued prompts (up to ``--max-batch-size``, waiting ``--batch-wait-ms``
for more once one is there), broadcasts them, and every rank runs
:class:`~megatronapp.inference.InferenceEngine` on them together: one batch,
KV-cached, each prompt with its own sampling parameters and seed. Tokens
reach the clients as they are chosen (``"stream": true``). A prompt that
arrives while a batch runs joins it before the next decoding step
(continuous batching; ``--max-batch-size`` bounds the sequences in flight):
rank 0 broadcasts the newcomers at every step, each rank prefills them and
they decode with the others.
"""

from __future__ import annotations

import dataclasses
import queue
import time

import torch.distributed as dist

__all__ = ["Driver"]

KEEPALIVE_S = 30.0  #: an idle rank 0 broadcasts a no-op this often


class Driver:
    """Runs batches of jobs on every rank of the replica (rank 0 drives,
    the others follow :meth:`follow`)."""

    def __init__(self, engine, *, max_batch_size: int = 16, batch_wait_s: float = 0.005):
        self.engine = engine
        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.batches = 0  #: batches run (rank 0)
        self.joined = 0  #: jobs that joined a running batch (rank 0)

    def _broadcast(self, cmd):
        if self.world == 1:
            return cmd
        box = [cmd]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def take(self, requests: queue.Queue, timeout: float) -> list:
        """Up to max_batch_size jobs: the first waited for up to `timeout`
        seconds, then what arrives within batch_wait_s."""
        try:
            jobs = [requests.get(timeout=timeout)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.batch_wait_s
        while len(jobs) < self.max_batch_size:
            left = deadline - time.monotonic()
            try:
                jobs.append(requests.get(timeout=left) if left > 0 else requests.get_nowait())
            except queue.Empty:
                break
        return jobs

    def run_once(self, requests: queue.Queue, timeout: float = KEEPALIVE_S) -> int:
        """(rank 0) One batch, or a keep-alive no-op when none came: the
        number of jobs run (those that joined it included)."""
        jobs = self.take(requests, timeout)
        if not jobs:
            self._broadcast({"op": "noop"})
            return 0
        self._broadcast({"op": "generate", "prompts": [j.prompt for j in jobs],
                         "params": [dataclasses.asdict(j.params) for j in jobs]})

        def on_token(i, token, logprob, reason):
            jobs[i].push({"token": token, "logprob": logprob, "finish_reason": reason})

        def admit(active: int):
            joining = []
            while active + len(joining) < self.max_batch_size:
                try:
                    joining.append(requests.get_nowait())
                except queue.Empty:
                    break
            jobs.extend(joining)
            self.joined += len(joining)
            return self._join_command(joining)
        try:
            self.engine.generate([j.prompt for j in jobs], [j.params for j in jobs], on_token,
                                 admit)
        except Exception as e:  # noqa: BLE001 - the clients hear of it; the server goes on
            for j in jobs:
                j.push({"error": f"{type(e).__name__}: {e}"})
        self.batches += 1
        return len(jobs)

    def _join_command(self, joining: list):
        """Broadcasts the jobs joining the running batch (rank 0), or
        receives them (the others): the engine's (prompts, params)."""
        from ..inference import SamplingParams

        cmd = self._broadcast(None if joining is None else {
            "prompts": [j.prompt for j in joining],
            "params": [dataclasses.asdict(j.params) for j in joining]})
        if joining is not None:
            return [j.prompt for j in joining], [j.params for j in joining]
        return cmd["prompts"], [SamplingParams(**p) for p in cmd["params"]]

    def stop(self) -> None:
        """(rank 0) Tells the other ranks to return from :meth:`follow`."""
        self._broadcast({"op": "stop"})

    def follow(self) -> None:
        """(ranks other than 0) Runs what rank 0 broadcasts until it stops."""
        from ..inference import SamplingParams

        while True:
            cmd = self._broadcast(None)
            if cmd is None or cmd["op"] == "stop":
                return
            if cmd["op"] == "generate":
                try:
                    self.engine.generate(cmd["prompts"],
                                         [SamplingParams(**p) for p in cmd["params"]],
                                         admit=lambda active: self._join_command(None))
                except Exception:  # noqa: BLE001 - rank 0 reports it to the clients
                    pass
