"""Dead-rank detection: a heartbeat through the c10d store, with a second
channel for when the store's host is the one that died.

Every rank publishes a counter under ``mapp_hb/<rank>`` every `interval`
seconds from a daemon thread and watches everyone else's. A rank whose counter
has not moved for `timeout` seconds is declared dead: the watchdog prints an
error naming the dead rank(s) and what this rank was doing (``set_phase``; the
C++ collective in flight), and ends the process with exit code 1 — the
training thread may be blocked inside a collective that will never complete,
so it cannot be asked nicely. Counters, not clocks, are compared, so hosts
need no synchronized time.

The store lives in one process: rank 0 under a plain per-rank launch (SLURM,
``RANK``/``WORLD_SIZE`` by hand), the launcher's agent under torchrun. If it
dies, "store unreachable" says nothing about *who* died. So a backup store is
hosted by rank 1 (its address published through the main store at start), and
every rank beats on both. When the main store becomes unreachable the
watchdog says so, keeps beating on the backup and keeps watching there: the
rank that is silent on the backup too is named (rank 0, the store's host),
within `timeout`. Only if both stores are gone (ranks 0 and 1 died together)
are both named as unreachable hosts.

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


def _routable_address() -> str:
    """This host's address on the interface that reaches MASTER_ADDR (what the
    other ranks can connect to); loopback on a single machine."""
    import socket

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sk:
            sk.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return sk.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _store():
    from .. import _collectives

    try:
        return _collectives.default_store()
    except Exception:  # noqa: BLE001 - fall back to the env rendezvous
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=__import__("datetime").timedelta(seconds=30))


class Watchdog:
    #: The running watchdog of this process, if any.
    current: Watchdog | None = None
    _generation = 0

    #: The rank that hosts the backup store.
    BACKUP_HOST = 1

    def __init__(self, timeout: float = 30.0, interval: float = 1.0, *, exit_on_death=True,
                 backup: bool = True):
        if timeout <= 2 * interval:
            raise ValueError(f"watchdog timeout ({timeout}s) must exceed twice the heartbeat "
                             f"interval ({interval}s)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout, self.interval, self.exit_on_death = timeout, interval, exit_on_death
        Watchdog._generation += 1  # every rank creates its watchdogs in the same order
        self.prefix = f"mapp_hb/{Watchdog._generation}/"
        self.store = dist.PrefixStore(self.prefix, _store())
        self.use_backup = backup and self.world > 1
        self.backup = None  # PrefixStore on the backup store
        self._backup_server = None  # the TCPStore rank BACKUP_HOST hosts
        self.dead: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mapp-watchdog", daemon=True)

    @staticmethod
    def store_host() -> str:
        """Who hosts the main rendezvous store."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return "the launcher (torchrun agent)"
        return "rank 0"

    def _start_backup(self) -> None:
        import datetime

        timeout = datetime.timedelta(seconds=max(5.0, 2 * self.interval))
        if self.rank == Watchdog.BACKUP_HOST:
            addr = _routable_address()
            self._backup_server = dist.TCPStore(addr, 0, is_master=True,
                                                wait_for_workers=False, timeout=timeout)
            self.store.set("backup_store", f"{addr}:{self._backup_server.port}")
            raw = self._backup_server
        else:
            self.store.wait(["backup_store"], datetime.timedelta(seconds=self.timeout))
            host, port = self.store.get("backup_store").decode().rsplit(":", 1)
            raw = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        self.backup = dist.PrefixStore(self.prefix, raw)
        self.backup.set(str(self.rank), "0")

    def start(self) -> Watchdog:
        self.store.set(str(self.rank), "0")
        if self.use_backup:
            try:
                self._start_backup()
            except Exception as e:  # noqa: BLE001 - watch through the main store only
                self.backup = None
                print(f"[megatronapp] rank {self.rank}: watchdog without a backup store (rank "
                      f"{Watchdog.BACKUP_HOST}'s is not reachable: {type(e).__name__}: "
                      f"{str(e)[:120]}); a dead store host will be reported as 'store "
                      "unreachable'", file=sys.stderr, flush=True)
        self._thread.start()
        Watchdog.current = self
        return self

    def stop(self, wait_for_peers: bool = True) -> None:
        """Stops watching; peers treat this rank as finished, not dead.

        A rank that hosts a store (the backup's host; rank 0 when it hosts the
        rendezvous store) then waits, at most `timeout` seconds, until every
        other rank has stopped too (``wait_for_peers``, the normal end of a
        run): its store dies with it, and a peer still beating on it would get
        a broken pipe that c10d prints as a stack trace."""
        self._stop.set()  # first: no beat after the done mark below
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        hosted = []
        for st, host in ((self.store, self.rank == 0 and self.store_host() == "rank 0"),
                         (self.backup, self._backup_server is not None)):
            if st is None:
                continue
            try:
                st.set(f"done/{self.rank}", "1")
                if host:
                    hosted.append(st)
            except Exception:  # noqa: BLE001
                pass
        if wait_for_peers and hosted:
            dead = {r for r, _ in self.dead}
            others = [f"done/{r}" for r in range(self.world) if r != self.rank and r not in dead]
            deadline = time.monotonic() + self.timeout
            for st in hosted:
                try:
                    while others and not st.check(others) and time.monotonic() < deadline:
                        time.sleep(0.02)
                except Exception:  # noqa: BLE001 - nothing left to protect
                    pass
        self.backup = self._backup_server = None
        if Watchdog.current is self:
            Watchdog.current = None

    def explain_failure(self) -> None:
        """After a collective failed (e.g. a peer's socket closed): give the
        heartbeat up to `timeout` seconds to name the dead rank (the watchdog
        then exits the process); returns if every rank is alive."""
        deadline = time.monotonic() + 2 * self.timeout + 2 * self.interval
        while time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(self.interval / 2)

    def _silent(self, store, seen: dict, now: float, since: float) -> list:
        """Ranks whose counter on `store` has not moved for `timeout`."""
        dead = []
        for r in range(self.world):
            if r == self.rank or store.check([f"done/{r}"]):
                continue  # finished its run normally
            key = str(r)
            if not store.check([key]):
                if now - since > self.timeout:
                    dead.append((r, "never started its heartbeat"))
                continue
            v = store.get(key)
            if r not in seen or seen[r][0] != v:
                seen[r] = (v, now)
            elif now - seen[r][1] > self.timeout:
                dead.append((r, f"no heartbeat for {now - seen[r][1]:.0f}s"))
        return dead

    def _loop(self) -> None:
        beat = 0
        start = time.monotonic()
        seen, seen_backup = {}, {}  # rank -> (value, local time it last changed)
        lost = None  # (time, error) once the main store is unreachable
        while not self._stop.wait(self.interval / 2 if beat else self.interval):
            beat += 1
            now = time.monotonic()
            if self.backup is not None:
                try:
                    self.backup.set(str(self.rank), str(beat))
                    if lost is None:
                        self._silent(self.backup, seen_backup, now, start)  # keep it current
                except Exception:  # noqa: BLE001 - rank 1 died: the main store names it
                    if lost is not None:
                        self._declare(self._both_stores_lost(seen_backup, now, lost),
                                      publish=False)
                        return
                    self.backup = None
            if lost is None:
                try:
                    self.store.set(str(self.rank), str(beat))
                    if self.store.check(["verdict"]):  # another rank found the dead one
                        self._declare(json.loads(self.store.get("verdict")), publish=False)
                        return
                    dead = self._silent(self.store, seen, now, start)
                except Exception as e:  # noqa: BLE001 - the store host itself died
                    why = f"{type(e).__name__}: {str(e)[:120]}"
                    if self.backup is None:
                        dead = [(0, f"the rendezvous store (hosted by {self.store_host()}) is "
                                    f"unreachable: {why}")]
                    else:
                        lost, dead = (now, why), []
                        print(f"[megatronapp] rank {self.rank}: the rendezvous store (hosted by "
                              f"{self.store_host()}) is unreachable ({why}); watching the ranks"
                              f" through the backup store on rank {Watchdog.BACKUP_HOST}",
                              file=sys.stderr, flush=True)
                if dead:
                    self._declare(dead)
                    return
                continue
            # The main store is gone: decide through the backup.
            try:
                if self.backup.check(["verdict"]):
                    self._declare(json.loads(self.backup.get("verdict")), publish=False,
                                  via_backup=True)
                    return
                dead = self._silent(self.backup, seen_backup, now, start)
                host = 0 if self.store_host() == "rank 0" else None
                finished_host = host is not None and self.backup.check([f"done/{host}"])
            except Exception:  # noqa: BLE001 - handled on the next beat
                continue
            dead = [(r, self._host_note(r, why, now, lost)) for r, why in dead]
            if not dead and not finished_host and now - lost[0] > self.timeout:
                dead = [(-1, f"the rendezvous store (hosted by {self.store_host()}) has been "
                             f"unreachable for {now - lost[0]:.0f}s ({lost[1]}) while every "
                             "rank is alive")]
            if dead:
                self._declare(dead, via_backup=True)
                return

    def _host_note(self, r: int, why: str, now: float, lost) -> str:
        if r == 0 and self.store_host() == "rank 0":
            return (f"{why}; it hosted the rendezvous store, unreachable since "
                    f"{now - lost[0]:.0f}s ({lost[1]})")
        return why

    def _both_stores_lost(self, seen_backup: dict, now: float, lost) -> list:
        """The backup store vanished after the main one. Its host may have
        exited right after naming the dead rank (its verdict then went with
        it): the ranks already silent on the backup for half the timeout,
        while their store is gone too, are the dead ones; otherwise both
        store hosts are named."""
        silent = [(r, now - t) for r, (_, t) in sorted(seen_backup.items())
                  if r not in (self.rank, Watchdog.BACKUP_HOST) and now - t > self.timeout / 2]
        if silent:
            return ([(r, self._host_note(r, f"no heartbeat for {s:.0f}s", now, lost))
                     for r, s in silent]
                    + [(-1, f"rank {Watchdog.BACKUP_HOST}, which hosted the backup store, "
                            "has exited since")])
        return [(0 if self.store_host() == "rank 0" else -1,
                 f"hosted the rendezvous store, unreachable: {lost[1]}"),
                (Watchdog.BACKUP_HOST, "hosted the backup store, unreachable")]

    def _declare(self, dead, publish: bool = True, via_backup: bool = False) -> None:
        self.dead = dead
        channel = self.backup if via_backup else self.store
        if publish:
            try:  # tell the others (they may only see the store vanish otherwise)
                channel.set("verdict", json.dumps(dead))
            except Exception:  # noqa: BLE001
                publish = False
        from .. import _C

        in_flight = _C.trace.in_flight() if hasattr(_C.trace, "in_flight") else ""
        who = "; ".join(f"rank {r} ({why})" if r >= 0 else why for r, why in dead)
        msg = (f"[megatronapp] rank {self.rank}: dead rank detected: {who}. This rank was in "
               f"'{phase()}'" + (f", collective in flight: {in_flight}" if in_flight else "")
               + ". Exiting (restart from the last checkpoint with --load).")
        print(msg, file=sys.stderr, flush=True)
        try:
            channel.set(f"ack/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass
        if self.exit_on_death:
            # The hosts of the stores wait until the others have read the verdict.
            if self.rank in (0, Watchdog.BACKUP_HOST):
                dead_ranks = {r for r, _ in dead}
                others = [f"ack/{r}" for r in range(self.world)
                          if r != self.rank and r not in dead_ranks]
                deadline = time.monotonic() + self.timeout
                while time.monotonic() < deadline:
                    try:
                        if not others or channel.check(others):
                            break
                    except Exception:  # noqa: BLE001
                        break
                    time.sleep(self.interval / 4)
            os._exit(1)
