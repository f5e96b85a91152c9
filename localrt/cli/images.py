"""Images and audio clips typed into `localrt run`: a path to an image or audio file
in a line attaches it, as Ollama's CLI does.

A path is absolute, or starts with ./, ../ or ~/, and ends in .png, .jpg, .jpeg,
.bmp or .gif (the formats llama.cpp reads; WebP is not one), or .wav, .mp3 or .flac
(the clips an audio projector's decoder reads); a space in it is escaped with a
backslash, or the whole path is quoted ('...' or "..."). Only a path to a file that
exists attaches; the text sent is the line without it. Each image goes as an OpenAI
`image_url` part holding a data URL, each clip as an `input_audio` part (base64 and
its format), before the text, as multimodal templates put media before the question.
"""

from __future__ import annotations

import base64
import os
import re

AUDIO = {"wav": "wav", "mp3": "mp3", "flac": "flac"}  # extension -> input_audio format
EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "gif", *AUDIO)
_EXT = "|".join(EXTENSIONS)
_START = r"(?:~|\.{1,2})?/"  # /abs, ./rel, ../rel, ~/home
# A quoted path (any characters but its quote), or an unquoted one: no blanks unless
# escaped. The extension ends the word: a blank or punctuation follows.
_PATH = re.compile(rf"""(?P<q>['"])(?P<quoted>{_START}[^'"]*?\.(?:{_EXT}))(?P=q)"""
                   rf"""|(?<![\w\\])"""
                   rf"""(?P<bare>{_START}(?:\\.|[^\s'"\\])*?\.(?:{_EXT}))(?!\w)""",
                   re.IGNORECASE)
# The data URL's type, by the extension; the server reads the bytes for what they are.
_BY_EXTENSION = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg",
                 "bmp": "image/bmp", "gif": "image/gif"}


def find_images(line: str) -> tuple[str, list[str]]:
    """(the line without the paths of existing image files in it, those paths), each
    path as the file system knows it: unquoted, unescaped, ~ expanded."""
    paths: list[str] = []

    def take(match: re.Match) -> str:
        typed = match.group("quoted") or _unescape(match.group("bare"))
        path = os.path.expanduser(typed)
        if not os.path.isfile(path):
            return match.group(0)  # not a file: the text stays as typed
        paths.append(path)
        return ""

    text = _PATH.sub(take, line)
    if not paths:
        return line, paths
    return re.sub(r"\s+([?!.,;:])", r"\1", " ".join(text.split())), paths


def is_audio(path: str) -> bool:
    """Whether a path found in a line is an audio clip's (by its extension)."""
    return path.rsplit(".", 1)[-1].lower() in AUDIO


def image_part(path: str) -> dict:
    """An OpenAI chat content part for the image (or audio) file at `path`: a data URL
    of an image's bytes, or an input_audio part of a clip's. Raises OSError when the
    file cannot be read."""
    with open(path, "rb") as f:
        data = f.read()
    if is_audio(path):
        return {"type": "input_audio", "input_audio": {
            "data": base64.b64encode(data).decode("ascii"),
            "format": AUDIO[path.rsplit(".", 1)[-1].lower()]}}
    mime = _BY_EXTENSION[path.rsplit(".", 1)[-1].lower()]
    url = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    return {"type": "image_url", "image_url": {"url": url}}


def _unescape(typed: str) -> str:
    r"""A shell-style path as the file system knows it: "\ " is a space, "\(" a "("."""
    return re.sub(r"\\(.)", r"\1", typed)
