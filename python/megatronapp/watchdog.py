"""Dead-rank detection: a heartbeat through the c10d store.

Every rank publishes a counter under ``mapp_hb/<rank>`` every `interval`
seconds from a daemon thread and watches everyone else's. A rank whose counter
has not moved for `timeout` seconds (or the store becoming unreachable: its
host died) is declared dead: the watchdog prints an error naming the dead
rank(s) and what this rank was doing (``set_phase``; the C++ collective in
flight), and ends the process with exit code 1 — the training thread may be
blocked inside a collective that will never complete, so it cannot be asked
nicely. Counters, not clocks, are compared, so hosts need no synchronized
time.

``pretrain_gpt.py`` starts it on multi-rank runs (``--watchdog-timeout``,
``--no-watchdog``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch.distributed as dist

__all__ = ["Watchdog", "set_phase", "phase"]

_PHASE = {"text": "starting"}


def set_phase(text: str) -> None:
    """What this rank is doing (for the dead-rank message)."""
    _PHASE["text"] = text


def phase() -> str:
    return _PHASE["text"]


def _store():
    from . import _collectives

    try:
        return _collectives.default_store()
    except Exception:  # noqa: BLE001 - fall back to the env rendezvous
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=__import__("datetime").timedelta(seconds=30))


class Watchdog:
    #: The running watchdog of this process, if any.
    current: Watchdog | None = None
    _generation = 0

    def __init__(self, timeout: float = 30.0, interval: float = 1.0, *, exit_on_death=True):
        if timeout <= 2 * interval:
            raise ValueError(f"watchdog timeout ({timeout}s) must exceed twice the heartbeat "
                             f"interval ({interval}s)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout, self.interval, self.exit_on_death = timeout, interval, exit_on_death
        Watchdog._generation += 1  # every rank creates its watchdogs in the same order
        self.store = dist.PrefixStore(f"mapp_hb/{Watchdog._generation}/", _store())
        self.dead: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mapp-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.store.set(str(self.rank), "0")
        self._thread.start()
        Watchdog.current = self
        return self

    def stop(self) -> None:
        """Stops watching; peers treat this rank as finished, not dead."""
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if Watchdog.current is self:
            Watchdog.current = None

    def explain_failure(self) -> None:
        """After a collective failed (e.g. a peer's socket closed): give the
        heartbeat up to `timeout` seconds to name the dead rank (the watchdog
        then exits the process); returns if every rank is alive."""
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        while time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(self.interval / 2)

    def _loop(self) -> None:
        beat = 0
        start = time.monotonic()
        seen = {}  # rank -> (value, local time it last changed)
        while not self._stop.wait(self.interval / 2 if beat else self.interval):
            beat += 1
            now = time.monotonic()
            try:
                self.store.set(str(self.rank), str(beat))
                if self.store.check(["verdict"]):  # another rank already found the dead one
                    self._declare(json.loads(self.store.get("verdict")), publish=False)
                    return
                dead = []
                for r in range(self.world):
                    if r == self.rank:
                        continue
                    key = str(r)
                    if self.store.check([f"done/{r}"]):
                        continue  # finished its run normally
                    if not self.store.check([key]):
                        if now - start > self.timeout:
                            dead.append((r, "never started its heartbeat"))
                        continue
                    v = self.store.get(key)
                    if r not in seen or seen[r][0] != v:
                        seen[r] = (v, now)
                    elif now - seen[r][1] > self.timeout:
                        dead.append((r, f"no heartbeat for {now - seen[r][1]:.0f}s"))
            except Exception as e:  # noqa: BLE001 - the store host itself died
                dead = [(0, f"the rendezvous store (hosted by rank 0 or the launcher) is "
                            f"unreachable: {type(e).__name__}: {str(e)[:120]}")]
            if dead:
                self._declare(dead)
                return

    def _declare(self, dead, publish: bool = True) -> None:
        self.dead = dead
        if publish:
            try:  # tell the others (they may only see the store vanish otherwise)
                self.store.set("verdict", json.dumps(dead))
            except Exception:  # noqa: BLE001
                publish = False
        from . import _C

        in_flight = _C.trace.in_flight() if hasattr(_C.trace, "in_flight") else ""
        who = "; ".join(f"rank {r} ({why})" for r, why in dead)
        msg = (f"[megatronapp] rank {self.rank}: dead rank detected: {who}. This rank was in "
               f"'{phase()}'" + (f", collective in flight: {in_flight}" if in_flight else "")
               + ". Exiting (restart from the last checkpoint with --load).")
        print(msg, file=sys.stderr, flush=True)
        try:
            self.store.set(f"ack/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass
        if self.exit_on_death:
            if self.rank == 0:  # rank 0 may host the store: wait until the others read it
                dead_ranks = {r for r, _ in dead}
                others = [f"ack/{r}" for r in range(self.world)
                          if r != 0 and r not in dead_ranks]
                deadline = time.monotonic() + self.timeout
                while time.monotonic() < deadline:
                    try:
                        if not others or self.store.check(others):
                            break
                    except Exception:  # noqa: BLE001
                        break
                    time.sleep(self.interval / 4)
            os._exit(1)
