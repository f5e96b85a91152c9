"""The terminal chat of `localrt run`: the conversation kept, replies streamed as they come.

It reads lines with readline's editing when stdin is the real terminal, and from the
given stdin otherwise (tests, pipes). Ctrl-C stops a reply without leaving. A path to
an image file in a line attaches the image (localrt.cli.images).
"""

from __future__ import annotations

import sys

from localrt.cli.context import CliError, Context, ExitCode
from localrt.cli.images import find_images, image_part
from localrt.client import ApiError


class Chat:
    """The terminal chat of `localrt run`: history kept, replies streamed as they come."""

    HELP = ("Type a message and press Enter. /exit or Ctrl-D leaves; Ctrl-C stops a reply. "
            "A path to an image file in a message attaches the image.")

    def __init__(self, ctx: Context, client, model_id: str):
        self.ctx, self.client, self.model_id = ctx, client, model_id
        self.history: list[dict] = []

    def loop(self) -> int:
        """Read a message, stream the reply; until /exit or end of input."""
        self.ctx.err(self.HELP)
        while True:
            try:
                line = self._read()
            except KeyboardInterrupt:  # at the prompt: say how to leave, as Ollama does
                self.ctx.err("\nUse /exit or Ctrl-D to leave.")
                continue
            if line is None or line.strip() in ("/exit", "/bye", "/quit"):
                self.ctx.err("")
                return ExitCode.OK
            if not line.strip():
                continue
            if line.strip() in ("/help", "/?"):
                self.ctx.err(self.HELP)
                continue
            try:
                content = self._content(line)
            except OSError as exc:
                self.ctx.err(f"Error: the image cannot be read: {exc}")
                continue
            self.history.append({"role": "user", "content": content})
            try:
                reply = self._reply()
            except (ApiError, CliError) as exc:  # e.g. the conversation outgrew the context
                self.history.pop()
                self.ctx.err(f"Error: {exc}")
                continue
            self.history.append({"role": "assistant", "content": reply})

    def _content(self, line: str):
        """A user message's content: the line, or, when it names image files, their
        image_url parts and then the rest of the line, as Ollama's CLI attaches them."""
        text, paths = find_images(line)
        if not paths:
            return line
        parts = [image_part(path) for path in paths]
        for path in paths:
            self.ctx.err(f"Added image '{path}'")
        return parts + ([{"type": "text", "text": text}] if text else [])

    def _read(self) -> str | None:
        """One line from the user; None at end of input (Ctrl-D)."""
        ctx = self.ctx
        if ctx.stdin is sys.stdin and ctx.interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
            try:
                return input(">>> ")
            except EOFError:
                return None
        return ctx.ask(">>> ")

    def _reply(self) -> str:
        """Stream one reply to stdout; Ctrl-C ends it early and keeps what came."""
        pieces: list[str] = []
        stream = None
        try:
            # Opening waits for the model's turn (and reads the prompt): Ctrl-C may come here.
            stream = self.client.chat_stream({"model": self.model_id,
                                              "messages": self.history})
            for chunk in stream:
                if "error" in chunk:
                    raise CliError(f"The reply failed: {chunk['error'].get('message')}")
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        pieces.append(piece)
                        self.ctx.stdout.write(piece)
                        self.ctx.stdout.flush()
        except KeyboardInterrupt:  # the server stops generating when the stream closes
            self.ctx.stdout.write(" [interrupted]")
        finally:
            if stream is not None:
                stream.close()
        self.ctx.out("")
        return "".join(pieces)
