"""The connections the API server holds: a waitress server and channel that bound them.

waitress closes a connection after one idle time (channel_timeout), and any byte
counts as activity, so a client that sends its request line a byte a second is never
closed. Here each connection has one of two clocks, as nginx has
(client_header_timeout and keepalive_timeout):

- ``requestTimeout``: from the accept, or from the first byte of a later request, to
  the end of that request. A client slower than that is closed, however many bytes
  it dribbles.
- ``keepAliveTimeout``: from the end of a reply (its last byte sent) to the first
  byte of the next request.

A connection whose request is being served has no clock: a stream lasts as long as
its reply (its kind's admission bounds how many there are). waitress keeps reading
such a connection (`channel_request_lookahead`), so a client that hangs up is seen at
once: the app's `disconnected()` (waitress.client_disconnected) turns true, and a
request waiting for its turn gives its place back (localrt.admission). A client that
half-closes its side after its request is taken as gone too.

When the server listens beyond loopback, one client address may hold at most
``maxConnectionsPerClient`` connections; a connection past that is closed as soon as
it is accepted, and counted (`on_refused`).

The worker threads (`Dispatcher`) start as requests need them: the ones the kinds'
limits need at once, and up to one more for each request that may wait for a place
(maxQueuedRequests, localrt.admission), only when one comes, since hundreds of
threads started with every server would double its start time; those end again
once idle.

Everything here runs in waitress's loop thread (accept, read, the sweep, handing a
request to a worker), except `Channel.service` and `Dispatcher.handler_thread`, which
run in worker threads. waitress is imported only by the server, so the CLI stays light.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher

from localrt import security
from localrt.settings import Settings

log = logging.getLogger(__name__)

SWEEP_INTERVAL = 1  # seconds between sweeps for timed-out connections (waitress wants an int)
FD_RESERVE = 512    # open files kept for models, logs, downloads and engines, not connections
MIN_CONNECTIONS = 100  # waitress's own default, for a process stuck with a tiny files limit
# Seconds a worker thread past the standing ones waits for a task before it ends: a
# burst's threads are gone soon after it, and one started again costs a millisecond.
EXTRA_IDLE = 5.0


def per_client_limit(settings: Settings, host: str) -> int | None:
    """How many connections one client address may hold: None (no limit) on loopback,
    where every client is this machine; maxConnectionsPerClient beyond it."""
    return None if security.is_loopback(host) else settings["maxConnectionsPerClient"]


def connection_limit(open_files: int, threads: int = 0) -> int:
    """waitress's connection_limit for a process that may hold `open_files` files and
    run `threads` worker threads: a connection for each of them, each held by a
    request that lasts or waits, and MIN_CONNECTIONS more for the short ones, whose
    connections would otherwise wait unaccepted."""
    return max(MIN_CONNECTIONS + threads, open_files - FD_RESERVE)


class _Request(HTTPRequestParser):
    """waitress's request parser, knowing when the request's first byte came."""

    def __init__(self, adj):
        super().__init__(adj)
        self.started = time.time()


class Channel(HTTPChannel):
    """One client connection, closed by `Server.sweep` when its clock runs out."""

    parser_class = _Request
    replied = False  # whether a reply has ended on it: keep-alive's clock applies from then

    def __init__(self, server, sock, addr, adj, map=None):
        super().__init__(server, sock, addr, adj, map=map)
        self._client = server.connected(addr)

    def service(self):
        # Set first: once the request is popped the sweep must see the keep-alive clock.
        self.replied = True  # a plain bool, read by the loop thread's sweep
        super().service()

    def deadline(self, request_timeout: float, keep_alive: float) -> float | None:
        """When this connection is closed unless a request completes first; None while
        a request of it is being served."""
        if self.requests:
            return None
        if not self.replied:
            return self.creation_time + request_timeout
        if self.request is not None:  # the next request has begun
            return self.request.started + request_timeout
        return self.last_activity + keep_alive  # the end of the reply, or its last byte sent

    def del_channel(self, map=None):
        client, self._client = getattr(self, "_client", None), None
        super().del_channel(map)
        if client is not None:
            self.server.disconnected(client)


class Dispatcher(ThreadedTaskDispatcher):
    """waitress's worker threads: `threads` standing ones, started at once, and one more
    whenever a request comes and none is idle, up to `most`; each of those ends once it
    has idled `idle` seconds, so a server's threads come back to the standing ones.

    waitress's `lock` guards its threads, queue and counts, as in waitress. Threads are
    started only in waitress's loop thread (`add_task`), and none once `shutdown` has
    begun. The standing threads are numbered from 0, the others after them.
    """

    def __init__(self, threads: int, most: int, idle: float = EXTRA_IDLE):
        super().__init__()
        self.standing, self.most, self.idle = threads, most, idle
        self._closing = False  # set by shutdown: no thread starts after it
        self._starting = 0  # threads started for a task that have not looked for one yet
        self.set_thread_count(threads)

    def add_task(self, task):
        super().add_task(task)
        with self.lock:
            running = len(self.threads) - self.stop_count
            # the tasks that no idle thread, nor one on its way, will take
            wanted = len(self.queue) - (running - self.active_count) - self._starting
            for _ in range(min(wanted, self.most - running) if not self._closing else 0):
                number = next(n for n in itertools.count(self.standing)
                              if n not in self.threads)
                try:
                    self.start_new_thread(self.handler_thread, number)
                except RuntimeError as exc:  # out of threads: the running ones take it
                    log.warning("cannot start a worker thread (%s); %d run", exc, running)
                    break
                self.threads.add(number)
                self.active_count += 1  # as set_thread_count counts one started
                self._starting += 1

    def handler_thread(self, thread_no):
        """waitress's worker loop, for a standing thread; another also ends once it has
        waited `idle` seconds for a task."""
        if thread_no < self.standing:
            return super().handler_thread(thread_no)
        started = True
        while True:
            with self.lock:
                if started:  # it takes a task now, or waits as an idle thread
                    self._starting -= 1
                    started = False
                while not self.queue and self.stop_count == 0:
                    self.active_count -= 1
                    woken = self.queue_cv.wait(self.idle)
                    self.active_count += 1
                    if not woken and not self.queue and self.stop_count == 0:
                        self.active_count -= 1
                        self.threads.discard(thread_no)
                        return
                if self.stop_count > 0:  # shutdown, as waitress's own threads leave
                    self.active_count -= 1
                    self.stop_count -= 1
                    self.threads.discard(thread_no)
                    self.thread_exit_cv.notify()
                    return
                task = self.queue.popleft()
            try:
                task.service()
            except BaseException:
                self.logger.exception("Exception when servicing %r", task)

    def shutdown(self, cancel_pending=True, timeout=5):
        with self.lock:
            self._closing = True
        return super().shutdown(cancel_pending, timeout)


class Server(TcpWSGIServer):
    """waitress's TCP server with the two clocks of `Channel` and a per-address limit.

    `_clients` (client address -> connections it holds) is touched only in the loop
    thread, so it needs no lock.
    """

    channel_class = Channel

    def __init__(self, application, adj: Adjustments, request_timeout: float,
                 keep_alive: float, per_client: int | None = None,
                 on_refused: Callable[[], None] = lambda: None,
                 dispatcher: Dispatcher | None = None):
        self.request_timeout, self.keep_alive = request_timeout, keep_alive
        self.per_client, self.on_refused = per_client, on_refused
        self._clients: dict[str, int] = {}
        super().__init__(application, adj=adj, dispatcher=dispatcher)

    def handle_accept(self):
        try:
            pair = self.accept()
        except OSError:  # the client left before its accept
            return
        if pair is None:
            return
        conn, addr = pair
        if self.per_client is not None and \
                self._clients.get(addr[0], 0) >= self.per_client:
            conn.close()
            self.on_refused()
            return
        try:
            self.set_socket_options(conn)
        except OSError:
            conn.close()
            return
        self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)

    def connected(self, addr) -> str:
        """Count a connection of this client address; the key to give `disconnected`."""
        client = addr[0] if isinstance(addr, tuple) else str(addr)
        self._clients[client] = self._clients.get(client, 0) + 1
        return client

    def disconnected(self, client: str) -> None:
        """A connection `connected` counted has closed."""
        left = self._clients.get(client, 0) - 1
        if left > 0:
            self._clients[client] = left
        else:
            self._clients.pop(client, None)

    def maintenance(self, now):
        """Close each connection whose clock ran out (replaces waitress's idle sweep)."""
        for channel in list(self.active_channels.values()):
            deadline = channel.deadline(self.request_timeout, self.keep_alive)
            if deadline is not None and now > deadline:
                channel.will_close = True


def make_server(app, host: str, port: int, threads: int, open_files: int,
                request_timeout: float, keep_alive: float, per_client: int | None = None,
                on_refused: Callable[[], None] = lambda: None, queued: int = 0) -> Server:
    """The API server bound to `host`:`port` (its first address, if it has several),
    accepting as many connections as `open_files` allows, polled with poll(2), with
    `threads` worker threads and up to `queued` more as requests wait (`Dispatcher`)."""
    most = threads + queued
    adj = Adjustments(host=host, port=port, threads=most, ident="localrt",
                      connection_limit=connection_limit(open_files, most),
                      # select() cannot watch descriptors past 1024
                      asyncore_use_poll=True,
                      # read on while a request is served, to see its client hang up
                      channel_request_lookahead=1,
                      cleanup_interval=SWEEP_INTERVAL)
    dispatcher = Dispatcher(threads, most)
    try:
        return Server(app, adj, request_timeout, keep_alive, per_client, on_refused,
                      dispatcher)
    except BaseException:  # the address is taken: no thread outlives the server
        dispatcher.shutdown()
        raise
