"""MegaScope attached to a training run (``pretrain_gpt.py --scope-port P``).

Rank 0 serves the page; at the start of each iteration it takes the
commands clients sent meanwhile (watch, unwatch, perturb, clear, info) and
broadcasts them, and every rank applies them in the same order, so the
ranks never disagree on what is watched or perturbed. Idle, the cost is one
one-element broadcast per iteration. While something is watched, each
iteration's records are collected to rank 0 and pushed to WebSocket
clients with the loss (``{"type": "step", ...}``; tensors packed as base64
float32, :func:`~megatronapp.scope.session.to_packed`); a perturbed iteration
carries ``perturbed`` in its record, so ``loss.csv`` shows it.

Clients only ever reach the server thread and a queue: one that connects,
disconnects or misbehaves cannot stall or change the training loop.
"""

from __future__ import annotations

import os
import queue
import time

import torch.distributed as dist

import torch

from . import Scope, ScopeError
from .session import describe, to_packed

__all__ = ["TrainingScope"]

MAX_COMMANDS_PER_STEP = 16


class TrainingScope:
    """The scope's side of a training run; ``megatronapp.training.hooks.ScopeHook``
    calls it at the loop's hook points (the training package depends on the
    scope, not the reverse)."""

    def __init__(self, port: int, host: str = "127.0.0.1", token: str | None = None,
                 output_dir: str | None = None):
        self.port, self.host, self.token, self.output_dir = port, host, token, output_dir
        self.scope = None
        self.server = None
        self.rank, self.world = 0, 1
        self._spent, self._previous = 0.0, None

    def on_start(self, run):
        from .server import ScopeServer

        self.scope = Scope(run.chunks, run.state)
        self.scope.training = True
        self.rank, self.world = run.rank, run.world
        if self.rank == 0:
            self.server = ScopeServer(self.host, self.port, self.token).start()
            print(f"[megatronapp] MegaScope: http://{self.host}:{self.server.port}/ "
                  "(watching the training run)", flush=True)
            if self.output_dir:
                os.makedirs(self.output_dir, exist_ok=True)
                path = os.path.join(self.output_dir, "scope.port")
                with open(path + ".tmp", "w") as f:
                    f.write(str(self.server.port))
                os.replace(path + ".tmp", path)

    def _pending(self) -> list:
        cmds = []
        while self.server is not None and len(cmds) < MAX_COMMANDS_PER_STEP:
            try:
                cmds.append(self.server.requests.get_nowait())
            except queue.Empty:
                break
        return cmds

    def _broadcast(self, cmds: list) -> list:
        if self.world == 1:
            return cmds
        n = torch.tensor([len(cmds)], dtype=torch.int64)
        dist.broadcast(n, src=0)
        if int(n) == 0:
            return []
        box = [cmds if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def execute(self, cmd: dict) -> dict:
        sc = self.scope
        op = cmd["op"]
        if op == "info":
            return describe(sc, self.world, "training")
        if op == "watch":
            args = {k: cmd[k] for k in ("reduce", "bins", "dim", "k") if k in cmd}
            sc.watch(cmd["site"], cmd.get("layers"), **args)
            return {"watching": sorted(sc.probes)}
        if op == "unwatch":
            sc.unwatch(cmd.get("site"))
            return {"watching": sorted(sc.probes)}
        if op == "perturb":
            args = {k: cmd[k] for k in ("layers", "std", "scale", "bit", "fraction", "head",
                                        "name", "steps", "seed") if k in cmd}
            pid = sc.perturb(cmd["site"], cmd["kind"], **args)
            return {"id": pid, "perturbations": [p.describe() for p in sc.perturbations]}
        if op == "clear":
            sc.clear_perturbations()
            return {"perturbations": []}
        raise ScopeError(f"{op!r} is not available while training (generation runs under "
                         "python -m megatronapp.scope serve)")

    def on_iteration_begin(self, run, it):
        t0 = time.perf_counter()
        pending = self._pending()
        cmds = self._broadcast([cmd for cmd, _ in pending])
        for i, cmd in enumerate(cmds):
            try:
                result = self.execute(cmd)
            except (ScopeError, KeyError, TypeError) as e:
                result = {"error": str(e)}
            if self.rank == 0:
                pending[i][1](result)
        self._previous = self.scope.begin_step()
        self._spent = time.perf_counter() - t0

    def on_iteration_end(self, run, it, record):
        t0 = time.perf_counter()
        sc = self.scope
        sc.end_step(self._previous)
        perturbed = sc.perturbed_last_step()
        if perturbed:
            record["perturbed"] = perturbed
        internals = sc.collect() if sc.probes else None  # collective: same probes everywhere
        if self.server is not None and self.server.has_clients:
            self.server.publish({"type": "step", "iteration": it + 1, "loss": record["loss"],
                                 "perturbed": perturbed,
                                 "internals": None if internals is None else to_packed(internals)})
        # the scope's own time this iteration, outside the step ("seconds")
        record["scope_seconds"] = self._spent + time.perf_counter() - t0

    def close(self, error=None):
        if self.server is not None:
            self.server.stop()
            self.server = None
