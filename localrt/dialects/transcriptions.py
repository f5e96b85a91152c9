"""Speech to text: OpenAI's POST /v1/audio/transcriptions and /v1/audio/translations,
each a chat with the clip (localrt.inference.chat) and the instruction the model's
family expects.

  FAMILIES   by the audio projector's type (its GGUF header, clip.projector_type): the
             instruction a transcription (or a translation into English) gives the
             model, and the marker its reply's text starts after (Qwen3-ASR writes
             "language English<asr_text>..."); a model whose family is not known here
             gets DEFAULT's plain "Transcribe the audio exactly."
  create     the form (localrt.multipart: file, model, prompt, language, temperature,
             response_format, stream) read and checked: the file is a clip as a chat's
             are (localrt.inference.media.clip: a 400 invalid_audio or audio_too_long,
             a 413 audio_too_large, naming `file`); the model's own checks
             (audio_not_supported) come from the chat. The reply: `json` {"text",
             "usage"}, `text` the text alone, `verbose_json` with task, language,
             duration and one segment over the whole clip (the model gives no
             timestamps), `srt` and `vtt` that segment as subtitles; with stream=true
             Server-Sent Events of transcript.text.delta and one transcript.text.done.
  usage      OpenAI's token form with the clip's length: {"type": "tokens",
             "input_tokens", "input_token_details": {"audio_tokens", "text_tokens"},
             "output_tokens", "total_tokens", "seconds"}.

OpenAI's `prompt` (text that came before the clip, or words to spell so) is given as
the chat's system message; `temperature` is 0 unless given, as OpenAI's default is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from localrt import native
from localrt.admission import Disconnected, never
from localrt.errors import InvalidField, shown
from localrt.inference import media as media_mod
from localrt.routing import Reply, STREAM_HEADERS, sse, stream_error

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
STREAMED_FORMATS = ("json", "text")  # the others need the whole text first
TEXT_TYPES = {"text": "text/plain; charset=utf-8", "srt": "text/plain; charset=utf-8",
              "vtt": "text/vtt; charset=utf-8"}


@dataclass(frozen=True)
class Family:
    """How a family of audio models is asked: the instruction of a transcription in a
    language (None: not given), of a translation into English, and the marker its
    reply's text starts after (None: the reply is the text)."""

    name: str
    transcribe: Callable[[str | None], str]
    translate: str
    marker: str | None = None


DEFAULT = Family("plain", lambda language: "Transcribe the audio exactly." + (
    f" It is in {language}." if language else ""), "Translate the audio into English.")

# Each family's instruction as its model card gives it. If you add a family, add its
# projector types here; the instruction goes after the clip in the user's message.
FAMILIES = {
    # Qwen3-ASR: the clip alone; it answers "language <Name><asr_text><text>"
    "qwen3a": Family("qwen3-asr", lambda language: "",
                     "Translate the audio into English.", marker="<asr_text>"),
    # Voxtral's transcription request (mistral_common's TranscriptionRequest)
    "voxtral": Family("voxtral", lambda language: f"lang:{language}[TRANSCRIBE]"
                      if language else "[TRANSCRIBE]",
                      "Translate this audio into English."),
    # Gemma 3n's and Gemma 4's speech prompts
    **{kind: Family("gemma", lambda language: (
        f"Transcribe the following speech segment in {language} into {language} text."
        if language else "Transcribe the following speech segment into text."),
        "Translate the following speech segment into English text.")
       for kind in ("gemma3na", "gemma4a", "gemma4ua")},
}


def family_of(record: dict) -> Family:
    """The family a model's audio projector says it is of (DEFAULT when not known)."""
    from localrt.engines import ggufinfo
    from localrt.models.roles import PROJECTOR

    path = PROJECTOR.path(record)
    if path is None:
        return DEFAULT
    try:
        found = ggufinfo.projector(path)
    except (OSError, ggufinfo.GGUFError):
        return DEFAULT
    return FAMILIES.get(found.audio_type, DEFAULT)


@dataclass(frozen=True)
class Task:
    """One transcription or translation, read from its form."""

    model: str
    clip: object          # contract.Audio
    task: str             # "transcribe" or "translate"
    language: str | None
    prompt: str | None
    temperature: float
    response_format: str
    stream: bool


def read(form: dict, task: str, policy: media_mod.Policy) -> Task:
    """A form's Task, its clip checked as a chat's clips are, each error naming its
    field."""
    upload = form.get("file")
    if upload is None or not hasattr(upload, "data"):
        raise InvalidField("Invalid field 'file': expected the audio as a file part",
                           param="file")
    clip = media_mod.clip(upload.data, "file", policy.max_audio_seconds)
    fmt = form.get("response_format") or "json"
    try:
        temperature = float(form.get("temperature") or 0)
    except ValueError:
        raise InvalidField(f"Invalid field 'temperature': expected a number, got "
                           f"{shown(form['temperature'])}", param="temperature") from None
    if not 0 <= temperature <= 2:
        raise InvalidField("Invalid field 'temperature': expected 0 to 2",
                           param="temperature")
    stream = (form.get("stream") or "false").lower() == "true"
    if stream and fmt not in STREAMED_FORMATS:
        raise InvalidField(f"Invalid field 'stream': a {fmt} reply is not streamed; "
                           f"stream json or text", param="stream")
    language = (form.get("language") or "").strip() or None
    return Task(form["model"], clip, task, language if task == "transcribe" else None,
                form.get("prompt") or None, temperature, fmt, stream)


def chat_request(task: Task, family: Family) -> native.Request:
    """The chat a Task is: the context prompt as a system message, then the user's
    clip and the family's instruction."""
    instruction = family.transcribe(task.language) if task.task == "transcribe" \
        else family.translate
    parts = [native.Media(task.clip.data, f"audio/{task.clip.format}", "file")]
    if instruction:
        parts.append(native.Text(instruction))
    messages = [native.Message("system", [native.Text(task.prompt)])] if task.prompt else []
    messages.append(native.Message("user", parts))
    return native.Request(model=task.model, messages=messages,
                          sampling={"temperature": task.temperature}, stream=task.stream)


def split(text: str, family: Family) -> tuple[str | None, str]:
    """(the language a reply names, its text) by the family's marker."""
    if family.marker and family.marker in text:
        head, _, rest = text.partition(family.marker)
        head = head.strip()
        language = head[len("language"):].strip() if head.lower().startswith("language") \
            else None
        return language or None, rest.strip()
    return None, text.strip()


def usage(u: native.Usage | None, seconds: float) -> dict:
    """OpenAI's token usage of a transcription, with the clip's length."""
    u = u or native.Usage()
    return {"type": "tokens", "input_tokens": u.prompt_tokens,
            "input_token_details": {"audio_tokens": u.audio_tokens,
                                    "text_tokens": u.prompt_tokens - u.audio_tokens},
            "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "seconds": round(seconds, 3)}


def create(chats, record_of: Callable[[str], dict], form: dict, task: str,
           disconnected: Disconnected = never):
    """POST /v1/audio/transcriptions (task "transcribe") or /v1/audio/translations
    ("translate") on `chats` (localrt.inference.chat.Chats), `record_of` giving a
    model's record (or ModelNotFound): a dict, a Reply of text, or a stream (see the
    module's docstring)."""
    job = read(form, task, chats.images.policy())
    family = family_of(record_of(job.model))
    reply = chats.create(chat_request(job, family), disconnected)
    if job.stream:
        return Events(reply, job, family)
    try:
        whole = native.collect(reply.events())
    finally:
        reply.close()
    language, text = split(whole.text, family)
    return written(job, text, language or job.language, usage(whole.usage, job.clip.seconds))


def written(job: Task, text: str, language: str | None, used: dict):
    """A whole transcription in the Task's response_format."""
    fmt, seconds = job.response_format, job.clip.seconds
    if fmt == "json":
        return {"text": text, "usage": used}
    if fmt == "verbose_json":
        return {"task": job.task, "language": language or "unknown",
                "duration": round(seconds, 3), "text": text,
                "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": round(seconds, 3),
                              "text": text, "tokens": [], "temperature": job.temperature}],
                "usage": used}
    if fmt == "srt":
        body = f"1\n{_stamp(0, ',')} --> {_stamp(seconds, ',')}\n{text}\n\n"
    elif fmt == "vtt":
        body = f"WEBVTT\n\n{_stamp(0, '.')} --> {_stamp(seconds, '.')}\n{text}\n\n"
    else:
        body = text
    data = body.encode("utf-8")
    return Reply([data], content_type=TEXT_TYPES[fmt],
                 headers=[("Content-Length", str(len(data)))])


def _stamp(seconds: float, comma: str) -> str:
    """HH:MM:SS,mmm (SubRip) or HH:MM:SS.mmm (WebVTT)."""
    ms = int(round(seconds * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}" \
           f"{comma}{ms % 1000:03d}"


class Events:
    """A streamed transcription: Server-Sent Events of {"type": "transcript.text.delta",
    "delta"} as the text comes (a family's metadata before its marker held back), then
    one {"type": "transcript.text.done", "text", "usage"}; an {"error"} event ends one
    that broke part way. close() frees the model."""

    content_type = "text/event-stream"

    def __init__(self, reply: native.Reply, job: Task, family: Family):
        self._reply, self._job, self._family = reply, job, family

    def __iter__(self) -> Iterator[bytes]:
        held, started, out, used = "", self._family.marker is None, [], None
        for event in self._reply.events():
            if isinstance(event, native.Text):
                if not started:
                    held += event.text
                    if self._family.marker in held:
                        started = True
                        piece = held.partition(self._family.marker)[2].lstrip()
                    else:
                        continue
                else:
                    piece = event.text
                if piece:
                    out.append(piece)
                    yield sse({"type": "transcript.text.delta", "delta": piece})
            elif isinstance(event, native.Usage):
                used = event
            elif isinstance(event, native.Failed):
                yield sse(stream_error(event.error, self._job.model))
                return
        if not started and held:  # no marker came: the reply was the text
            out.append(held)
            yield sse({"type": "transcript.text.delta", "delta": held})
        yield sse({"type": "transcript.text.done", "text": "".join(out).strip(),
                   "usage": usage(used, self._job.clip.seconds)})

    def close(self) -> None:
        """Called by the server when the reply ends or the client goes away."""
        self._reply.close()


def streamed(result):
    """A handler's result as a Reply: a stream as Server-Sent Events proxies must not
    buffer; a dict or Reply as it is."""
    if isinstance(result, Events):
        return Reply(result, content_type=result.content_type, headers=list(STREAM_HEADERS))
    return result


def file_too_large(name: str, size: int):
    """The 413 audio_too_large of a form's file past one clip's limit, else None."""
    if size > media_mod.AUDIO_MAX_BYTES:
        return media_mod.audio_too_large(name, size)
    return None
