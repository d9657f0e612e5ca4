"""The stall watchdog's liveness probes where there is no MPI (torch.distributed): one small TCP
listener per rank, one JSON line per message. A stopped process still has its connections accepted
by the kernel but never answers, which is what the watchdog (`dynamix_hvd.comm.StallWatchdog`)
detects; a dead one refuses them. Plain sockets: nothing here waits on the process group, so the
watchdog can stop at any time and never holds up the process's exit.
"""
from __future__ import annotations

import json
import queue
import socket
import threading
from typing import Any, Callable


class SocketProbes:
    """Ping, pong and closing messages, (kind, sender, number, probe, status), between the ranks.

    `exchange` is an allgather (every rank calls it at the same point): each rank's (host, port)."""

    def __init__(self, rank: int, exchange: Callable[[tuple[str, int]], list[Any]],
                 connect_timeout_s: float = 1.0) -> None:
        self.rank, self.connect_timeout_s = rank, connect_timeout_s
        self._server = socket.create_server(("", 0))
        self._server.settimeout(0.2)
        self._stop = threading.Event()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._listen, name="dx-watchdog-listener", daemon=True)
        self._thread.start()
        self.addresses = [tuple(a) for a in exchange((socket.gethostname(), self._server.getsockname()[1]))]

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:  # a timeout (check the stop flag) or the server closed
                continue
            with conn:
                conn.settimeout(self.connect_timeout_s)
                try:
                    line = conn.makefile("r", encoding="utf-8").readline()
                    kind, sender, number, probe, status = json.loads(line)
                except (OSError, ValueError):
                    continue  # a sender that stopped mid-message, or not one of ours
                self._inbox.put((str(kind), int(sender), (int(number), int(probe), status)))

    def alive(self) -> bool:
        return not self._stop.is_set()

    def send(self, kind: str, dst: int, message: tuple) -> None:
        """Deliver one message; a peer that refuses the connection (it has exited) gets none."""
        number, probe, status = message
        try:
            with socket.create_connection(self.addresses[dst], timeout=self.connect_timeout_s) as conn:
                conn.sendall((json.dumps([kind, self.rank, number, probe, status]) + "\n").encode())
        except OSError:
            pass  # no answer then: the watchdog names a peer that answers nothing

    def poll(self) -> list[tuple[str, int, tuple]]:
        got = []
        while not self._inbox.empty():
            got.append(self._inbox.get_nowait())
        return got

    def abandon(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._server.close()
