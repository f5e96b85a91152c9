"""What the dialects share: their names for native fields in errors, the check of a
translated body against the native schema, and their named-event streams.

A dialect turns its request into a native body (chat's, a completion's or an
embedding's), checks that body against the native route's schema with `native`, and
calls the native service. A 400 from either names the native field
(`tools[0].function.parameters`); `Fields` renames it to the dialect's own
(`tools[0].input_schema`), so a client reads the name it sent; a translation that
moves parts about (images) gives exact paths for one request (`Fields.with_paths`).
A translation that went wrong is a 400 naming a field, never a 500.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

from localrt.errors import HTTPError
from localrt.routing import sse


class Fields:
    """A dialect's names for native fields: (pattern, replacement) rules, each a regular
    expression matched at the start of an error's `param`; the first that matches
    replaces what it matched (the rest of the param stays)."""

    def __init__(self, *rules: tuple[str, str]):
        self._given = rules
        self._rules = tuple((re.compile(pattern), name) for pattern, name in rules)

    def with_paths(self, paths: dict) -> "Fields":
        """These rules after exact ones for one request: each native path in `paths`
        (an image part, say: messages[2].content[1]) becomes the dialect's path of
        what the translation made it from (messages[1].content[0].content[1])."""
        exact = tuple((re.escape(native) + r"(?![\w\[])", ours.replace("\\", "\\\\"))
                      for native, ours in paths.items())
        return Fields(*exact, *self._given)

    def rename(self, err: HTTPError) -> HTTPError:
        """`err` with the dialect's name in its param and message (changed in place)."""
        if err.param is None:
            return err
        for pattern, name in self._rules:
            if pattern.match(err.param):
                new = pattern.sub(name, err.param, count=1)
                err.message = err.message.replace(f"'{err.param}", f"'{new}")
                err.args = (err.message,)
                err.param = new
                break
        return err

    @contextlib.contextmanager
    def named(self):
        """Errors raised inside, with the dialect's field names."""
        try:
            yield
        except HTTPError as err:
            raise self.rename(err) from None


def native(validators, schema: str, body: dict, fields: Fields) -> dict:
    """`body`, a translation, once it passed the native route's schema (`schema`, a file
    of schemas/): what the native route would have let in; a 400 in the dialect's names."""
    with fields.named():
        validators.validate(schema, body)
    return body


class NamedEvents:
    """A dialect's streamed reply: Server-Sent Events with an `event:` name each, made
    from a native stream's chunks. Subclasses give `named()`, (name, data) pairs;
    close() closes the native stream, which frees the model."""

    content_type = "text/event-stream"

    def __init__(self, native_stream):
        self._native = native_stream

    def __iter__(self) -> Iterator[bytes]:
        for name, data in self.named():
            yield sse(data, event=name)

    def named(self) -> Iterator[tuple[str, dict]]:
        """The events, as (name, data)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called by the server when the reply ends or the client goes away."""
        self._native.close()
