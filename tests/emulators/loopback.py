"""Test support: the listening side shared by the loopback emulators (hubemu, pkgindex).

Not a test module. `LoopbackHandler` is the emulators' request handler base, quiet and
calm about clients that hang up. `LoopbackServer` binds 127.0.0.1 on a port the OS picks, serves
each connection in a daemon thread, optionally over TLS, and remembers the open
connections so an emulator's stop() can cut transfers still in progress.
"""

from __future__ import annotations

import socket
import socketserver
import ssl
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

# Errors a client causes by hanging up; the emulators stay quiet about them.
DISCONNECTS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError,
               socket.timeout, ssl.SSLError)


class LoopbackServer(ThreadingHTTPServer):
    """One listening socket on 127.0.0.1, port 0; connections are served by daemon threads."""

    daemon_threads = True

    def __init__(self, handler, ssl_context: Optional[ssl.SSLContext] = None):
        self.ssl_context = ssl_context
        self.connections: set = set()
        self.connections_lock = threading.Lock()  # guards connections
        super().__init__(("127.0.0.1", 0), handler)

    def server_bind(self):
        # HTTPServer.server_bind calls socket.getfqdn(), a reverse DNS lookup that can
        # stall on machines without a network; the name is not needed.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def finish_request(self, request, client_address):
        # The TLS handshake runs here, in the connection's own thread, so a client that
        # stalls or rejects the certificate cannot block accept().
        # Headers and body go out in separate writes; without TCP_NODELAY, Nagle plus
        # delayed ACKs would add ~40 ms to every keep-alive response.
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.ssl_context is not None:
            try:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return
        with self.connections_lock:
            self.connections.add(request)
        try:
            self.RequestHandlerClass(request, client_address, self)
        finally:
            with self.connections_lock:
                self.connections.discard(request)
            if self.ssl_context is not None:
                try:
                    request.close()
                except OSError:
                    pass

    def handle_error(self, request, client_address):
        # Disconnects are expected and stay quiet; anything else is an emulator bug
        # (already answered with a 500), so show the traceback.
        if not isinstance(sys.exc_info()[1], DISCONNECTS):
            traceback.print_exc()

    def close_connections(self):
        """Shut down every open connection (their threads then end on a socket error)."""
        with self.connections_lock:
            conns = list(self.connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class LoopbackHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing and takes a client's hang-up as the end."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the real hub and index do
    sys_version = ""

    def log_message(self, format, *args):
        pass

    def handle(self):
        try:
            super().handle()
        except DISCONNECTS:
            self.close_connection = True
