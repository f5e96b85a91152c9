"""What every command is handed: the `Context` (arguments, streams, settings, the client),
the named exit codes, and `CliError`, the failure a command reports in one line.

`Context.client()` is the one way a command reaches the server: it connects, or
starts the server once when none is running and says so.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What `localrt` exits with."""

    OK = 0
    ERROR = 1            # the server answered with an error
    USAGE = 2            # bad arguments; argparse's own code
    UNAVAILABLE = 3      # the server is not running and could not be started
    SETTINGS = 4         # the settings file cannot be used
    INTERRUPTED = 130    # Ctrl-C
    BROKEN_PIPE = 141    # the reader of stdout left (`| head`): 128 + SIGPIPE, as others exit


class CliError(Exception):
    """A failure to report in one line, with its exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.ERROR):
        super().__init__(message)
        self.code = code


def isatty(stream) -> bool:
    """Whether a stream is a terminal (False for one without isatty, or closed)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Context:
    """What a command needs: its arguments, its streams, the settings and a client."""

    def __init__(self, args, stdout, stderr, stdin=None):
        self.args, self.stdout, self.stderr = args, stdout, stderr
        self.stdin = stdin
        self._settings = None
        self._client = None

    @property
    def settings(self):
        """The settings file's values, read on first use (--config, or the default file)."""
        if self._settings is None:
            from localrt import settings

            self._settings = settings.load(self.args.config)
        return self._settings

    def out(self, text: str) -> None:
        """Print a line of the command's result on stdout."""
        print(text, file=self.stdout, flush=True)

    def err(self, text: str) -> None:
        """Print a line of news, a question or an error on stderr."""
        print(text, file=self.stderr, flush=True)

    @property
    def interactive(self) -> bool:
        """Whether a person can answer questions: stdin is a terminal."""
        return self.stdin is not None and isatty(self.stdin)

    def ask(self, prompt: str) -> str | None:
        """Ask on stderr, read one line from stdin; None at end of input."""
        self.stderr.write(prompt)
        self.stderr.flush()
        line = self.stdin.readline()
        return line.rstrip("\r\n") if line else None

    @property
    def api_key(self) -> str | None:
        """The key the CLI sends: $LOCALRT_API_KEY, else the first of apiKeys."""
        keys = self.settings["apiKeys"]
        return keys[0] if keys else None

    def connect(self, address, timeout: float = 30.0, start=None):
        """A client for the server at `address` (a localrt.server.Address); no request yet.

        `start` is the client's hook for when its first request finds no server.
        """
        from localrt.client import Client

        return Client(address.url, timeout=timeout, api_key=self.api_key, start=start)

    def client(self):
        """The client of this settings file's server, made once per command.

        Its first request connects; if nothing answers and no server process exists,
        it starts the server, says so, and makes the request again there.
        """
        if self._client is None:
            from localrt import server

            self._client = self.connect(server.locate(self.settings),
                                        start=self._start_missing_server)
        return self._client

    def _start_missing_server(self) -> str | None:
        """Start the server for client(), unless a server process exists; its URL, or None."""
        from localrt import server

        if server.read_pid_file(self.settings):
            return None  # a server process exists but does not answer; starting another won't help
        address = self.start_server(self.settings["apiServerHost"],
                                    self.settings["apiServerPort"])
        self.err(f"The localrt server was not running; started it at {address.url}")
        return address.url

    def start_server(self, host: str, port: int):
        """Spawn a detached server and wait until it answers; return its Address."""
        from localrt import server

        try:
            server.check_port_free(host, port)
            child = server.spawn(self.settings, host, port)
            return server.wait_started(self.settings, child)
        except (server.PortInUse, RuntimeError) as exc:
            raise CliError(str(exc), ExitCode.UNAVAILABLE) from None
