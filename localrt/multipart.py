"""multipart/form-data request bodies (RFC 7578), read whole and bounded: what OpenAI's
audio routes (/v1/audio/transcriptions, /v1/audio/translations) take.

`read(data, content_type, limits)` gives a Form: its text fields (name -> str; a name
ending in "[]" is a form array, which may be given again: name -> [str, ...], as
OpenAI's SDK sends timestamp_granularities[] and include[]) and its files (name ->
Upload: filename, content type, bytes). Everything is bounded before it is kept: at
most MAX_PARTS parts, MAX_HEADER bytes of headers a part, `limits.field` bytes a text
field (a 413 payload_too_large naming it), `limits.file(name)` bytes a file (a 413 of
the route's own kind, audio_too_large for a clip), and the body itself by its route's
max_body (localrt.app). A malformed body is a 400 naming what is wrong:
no boundary, a part without its closing boundary, a part with no Content-Disposition
or no name, a field that is not UTF-8, a name given twice (but an array's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from localrt.errors import BadRequest, HTTPError, PayloadTooLarge, shown

MAX_PARTS = 64           # parts a body may have; a form has a handful
MAX_HEADER = 8 * 1024    # bytes of a part's headers
FIELD_BYTES = 64 * 1024  # bytes of one text field (a prompt is the longest)


@dataclass(frozen=True)
class Upload:
    """A file part: the name the client gave it, its Content-Type, its bytes."""

    filename: str
    content_type: str
    data: bytes = field(repr=False)


@dataclass
class Form:
    """A multipart body: its text fields and its files, by name, in the order sent."""

    fields: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Limits:
    """The bounds of one route's form: `field` bytes a text field; `file(name, size)`
    gives the error for a file of `size` bytes past its limit, or None."""

    file: Callable[[str, int], HTTPError | None]
    field: int = FIELD_BYTES


def boundary_of(content_type: str) -> bytes:
    """The boundary a multipart/form-data Content-Type names; a 400 without one."""
    media, _, rest = content_type.partition(";")
    if media.strip().lower() != "multipart/form-data":
        raise BadRequest(f"Expected a multipart/form-data body, got {shown(media.strip())}")
    for param in rest.split(";"):
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "boundary":
            value = value.strip().strip('"')
            if 0 < len(value) <= 200:
                return value.encode("latin-1", "replace")
    raise BadRequest("Malformed multipart/form-data body: the Content-Type names no "
                     "boundary (1 to 200 characters)")


def read(data: bytes, content_type: str, limits: Limits) -> Form:
    """The Form of a whole multipart/form-data body; 400s and 413s as the module says."""
    delimiter = b"--" + boundary_of(content_type)
    start = data.find(delimiter)
    if start < 0:
        raise BadRequest("Malformed multipart/form-data body: the boundary the "
                         "Content-Type names never appears")
    form, at, count = Form(), start + len(delimiter), 0
    while True:
        if data[at:at + 2] == b"--":  # the closing delimiter
            return form
        if data[at:at + 2] != b"\r\n":
            raise BadRequest("Malformed multipart/form-data body: a boundary line is "
                             "not followed by CRLF")
        count += 1
        if count > MAX_PARTS:
            raise BadRequest(f"Malformed multipart/form-data body: more than {MAX_PARTS} "
                             f"parts")
        head_end = data.find(b"\r\n\r\n", at + 2, at + 2 + MAX_HEADER + 4)
        if head_end < 0:
            raise BadRequest(f"Malformed multipart/form-data body: part {count}'s headers "
                             f"do not end within {MAX_HEADER} bytes")
        headers = _headers(data[at + 2:head_end], count)
        body_start = head_end + 4
        end = data.find(b"\r\n" + delimiter, body_start)
        if end < 0:
            raise BadRequest(f"Malformed multipart/form-data body: part {count} has no "
                             f"closing boundary (the body is cut short)")
        _keep(form, headers, data[body_start:end], count, limits)
        at = end + 2 + len(delimiter)


def _headers(block: bytes, count: int) -> dict:
    """A part's headers, lower-cased names."""
    out = {}
    for line in block.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if not colon:
            raise BadRequest(f"Malformed multipart/form-data body: part {count} has a "
                             f"header line without a colon")
        out[name.strip().lower().decode("latin-1")] = value.strip().decode("utf-8",
                                                                           "replace")
    return out


def _disposition(value: str, count: int) -> dict:
    """The parameters of a form-data Content-Disposition (name, filename)."""
    kind, _, rest = value.partition(";")
    if kind.strip().lower() != "form-data":
        raise BadRequest(f"Malformed multipart/form-data body: part {count}'s "
                         f"Content-Disposition is not form-data")
    params, i = {}, 0
    while i < len(rest):  # key=value or key="quoted", separated by ;
        while i < len(rest) and rest[i] in " ;\t":
            i += 1
        eq = rest.find("=", i)
        if eq < 0:
            break
        key = rest[i:eq].strip().lower()
        i = eq + 1
        if i < len(rest) and rest[i] == '"':
            value, i = [], i + 1
            while i < len(rest) and rest[i] != '"':
                if rest[i] == "\\" and i + 1 < len(rest):
                    i += 1
                value.append(rest[i])
                i += 1
            i += 1
            params[key] = "".join(value)
        else:
            semi = rest.find(";", i)
            semi = len(rest) if semi < 0 else semi
            params[key] = rest[i:semi].strip()
            i = semi
    return params


def _keep(form: Form, headers: dict, body: bytes, count: int, limits: Limits) -> None:
    if "content-disposition" not in headers:
        raise BadRequest(f"Malformed multipart/form-data body: part {count} has no "
                         f"Content-Disposition")
    params = _disposition(headers["content-disposition"], count)
    name = params.get("name")
    if not name:
        raise BadRequest(f"Malformed multipart/form-data body: part {count} has no name")
    array = name.endswith("[]") and "filename" not in params
    if (name in form.fields and not array) or name in form.files:
        raise BadRequest(f"Malformed multipart/form-data body: the field {shown(name)} is "
                         f"given twice")
    if "filename" in params:
        error = limits.file(name, len(body))
        if error is not None:
            raise error
        form.files[name] = Upload(params["filename"], headers.get("content-type",
                                                                  "application/octet-stream"),
                                  body)
        return
    if len(body) > limits.field:
        raise PayloadTooLarge(f"The field {shown(name)} is {len(body)} bytes; the limit is "
                              f"{limits.field} bytes a field", param=name)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(f"The field {shown(name)} is not UTF-8 text",
                         param=name) from None
    if array:
        form.fields.setdefault(name, []).append(text)
    else:
        form.fields[name] = text
