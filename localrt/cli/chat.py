"""The terminal chat of `localrt run`: the conversation kept, replies streamed as they come,
and the session's commands, as `ollama run` has them.

A session reads lines with readline's editing when stdin is the real terminal, and
from the given stdin otherwise (tests). Ctrl-C stops a reply without leaving. A line
that begins with \"\"\" begins a message of several lines, which a line that ends with
\"\"\" ends. A line that begins with / is a command (`COMMANDS`, /help lists them); an
unknown one is an error and nothing is sent, unless the word is the path of an image
file: a path to an image file in a message attaches the image (localrt.cli.images).
`Chat.once` answers one prompt, for `localrt run ID PROMPT` and for a prompt piped in.

A reasoning model's thinking is shown apart from its answer, as `ollama run` shows it:
a "Thinking…" line, the trace dimmed, "…done thinking." before the answer. It goes to
stdout when stdout is a terminal, else to stderr, so that a redirected reply is the
answer alone. --hidethinking (or /set hidethinking) hides it; --think / --think=false
/ --think=LEVEL (or /set think, /set nothink) turn thinking on or off for the
session: off is `reasoning_effort: "none"`, on a level (medium when none is given).
A conversation's earlier thinking is sent back with its answer (`reasoning_content`),
so the model's template keeps or drops it as its authors wrote it.

With --verbose (or /set verbose) a readout on stderr follows each reply: the prompt's
tokens (those the prompt cache held too) and the reply's, from the stream's usage, each
with its rate as Ollama measures it: the prompt from the request to the reply's first
piece, the reply from there to its end. Everything but the replies goes to stderr.
"""

from __future__ import annotations

import sys
import time

from localrt.cli.context import CliError, Context, ExitCode, isatty
from localrt.cli.images import find_images, image_part, is_audio
from localrt.client import ApiError
from localrt.fsutil import human_size

PROMPT, MORE = ">>> ", "... "  # Ollama's prompts: a message, the next line of a long one
QUOTES = '"""'  # begins and ends a message of several lines
LEAVE = ("/exit", "/bye", "/quit")

WELCOME = ("Type a message and press Enter. /? lists the commands; /exit or Ctrl-D leaves, "
           "Ctrl-C stops a reply.")
HELP = f"""Available commands:
  /set system TEXT           set the system message ({QUOTES}...{QUOTES} for several lines)
  /set parameter NAME VALUE  set a sampling parameter for this session (/set parameter lists them)
  /set verbose, /set quiet   show the tokens and tok/s after each reply, or not
  /set think [LEVEL]         let a reasoning model think (LEVEL: low, medium, high)
  /set nothink               tell a reasoning model not to think
  /set hidethinking          do not show the model's thinking (/set nohidethinking shows it)
  /show info                 show the model's details
  /clear                     clear the conversation; the system message stays
  /load ID                   switch to another model (an id, or ./model.gguf)
  /exit, /bye                leave (Ctrl-D too)
  /?, /help                  this help

Use {QUOTES} to begin a message of several lines, and {QUOTES} to end it.
A path to an image file in a message attaches the image. Ctrl-C stops a reply."""

# /set parameter NAME: the chat request field it sets (Ollama's names, and the API's).
# The field's type and range come from schemas/chat-completion.json.
PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "min_p": "min_p", "seed": "seed", "num_predict": "max_tokens",
              "max_tokens": "max_tokens", "repeat_penalty": "repeat_penalty",
              "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
              "stop": "stop"}
# Ollama's parameters that are start options here: a session cannot change them.
START_ONLY = {"num_ctx": "--ctx_len", "num_gpu": "--ngl", "num_thread": "--cpu_threads",
              "num_batch": "--n_batch"}

# Thinking's levels (Ollama's `think` levels); True is the default level's "on".
THINK_LEVELS = ("low", "medium", "high")
THINKING, DONE_THINKING = "Thinking…", "…done thinking."
DIM, RESET = "\x1b[2m", "\x1b[0m"


def think_value(text: str):
    """--think's value as the session keeps it: True, False or a level."""
    word = text.strip().lower()
    if word in ("", "true", "on", "yes"):
        return True
    if word in ("false", "off", "no"):
        return False
    if word in THINK_LEVELS:
        return word
    raise ValueError(f"'{text}' is not true, false, {', '.join(THINK_LEVELS)}")


def think_fields(think) -> dict:
    """The chat request fields that say `think` (None: nothing, the model's default)."""
    if think is None:
        return {}
    if think is False:
        return {"reasoning_effort": "none"}
    return {"reasoning_effort": "medium" if think is True else think}


class Chat:
    """The terminal chat of `localrt run`: history kept, replies streamed as they come.

    `load(given)` makes another model ready for /load and returns its id (see
    localrt.cli.commands.run); `verbose` prints the readout after each reply; `think`
    True, False or a level says whether the model thinks (None: its default);
    `hide_thinking` hides the thinking.
    """

    def __init__(self, ctx: Context, client, model_id: str, load=None, verbose: bool = False,
                 think=None, hide_thinking: bool = False):
        self.ctx, self.client, self.model_id = ctx, client, model_id
        self.load, self.verbose = load, verbose
        self.think, self.hide_thinking = think, hide_thinking
        self.history: list[dict] = []  # the conversation, without the system message
        self.system: str | None = None
        self.parameters: dict = {}  # request fields from /set parameter
        self.commands = {"/set": self._set, "/show": self._show, "/clear": self._clear,
                         "/load": self._load, "/help": self._help, "/?": self._help}

    def once(self, prompt: str) -> int:
        """Answer one prompt and return; a failed reply is an error."""
        try:
            content = self._content(prompt)
        except OSError as exc:
            raise CliError(f"The image cannot be read: {exc}") from None
        self.history.append({"role": "user", "content": content})
        return ExitCode.OK if self._reply() else ExitCode.INTERRUPTED

    def loop(self) -> int:
        """Read a message, stream the reply; until /exit or end of input."""
        self.ctx.err(WELCOME)
        while True:
            try:
                text = self._next_message()
            except KeyboardInterrupt:  # at the prompt: say how to leave, as Ollama does
                self.ctx.err("\nUse /exit or Ctrl-D to leave.")
                continue
            if text is None:
                self.ctx.err("")
                return ExitCode.OK
            self._send(text)

    def messages(self) -> list[dict]:
        """What the next request sends: the system message, then the conversation."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    # --- reading --------------------------------------------------------------------

    def _next_message(self) -> str | None:
        """The next message typed, after running the commands typed before it; None to
        leave (end of input, /exit)."""
        while True:
            line = self._read(PROMPT)
            if line is None:
                return None
            stripped = line.strip()
            if stripped.startswith(QUOTES):
                line = self._lines(stripped[len(QUOTES):])
                if line is None:
                    return None
            elif stripped.startswith("/") and not _starts_with_image(stripped):
                word, _, rest = stripped.partition(" ")
                if word in LEAVE:
                    return None
                command = self.commands.get(word)
                if command is None:
                    self.ctx.err(f"Error: unknown command '{word}'; /help lists the commands")
                else:
                    command(rest.strip())
                continue
            if line.strip():
                return line

    def _lines(self, first: str) -> str | None:
        """A message of several lines: `first` (what followed the opening quotes) and
        the lines after it, up to the one that ends with the quotes; None at end of input."""
        lines = []
        while not first.endswith(QUOTES):
            if lines or first:
                lines.append(first)
            first = self._read(MORE)
            if first is None:
                return None
        lines.append(first[:-len(QUOTES)])
        return "\n".join(lines)

    def _read(self, prompt: str) -> str | None:
        """One line from the user; None at end of input (Ctrl-D)."""
        ctx = self.ctx
        if ctx.stdin is sys.stdin and ctx.interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
            try:
                return input(prompt)
            except EOFError:
                return None
        return ctx.ask(prompt)

    def _content(self, line: str):
        """A user message's content: the line, or, when it names image or audio files,
        their image_url and input_audio parts and then the rest of the line, as
        Ollama's CLI attaches them."""
        text, paths = find_images(line)
        if not paths:
            return line
        parts = [image_part(path) for path in paths]
        for path in paths:
            self.ctx.err(f"Added {'audio' if is_audio(path) else 'image'} '{path}'")
        return parts + ([{"type": "text", "text": text}] if text else [])

    # --- the session's commands ---------------------------------------------------

    def _set(self, rest: str) -> None:
        """/set system TEXT, /set parameter NAME VALUE..., /set verbose, /set quiet."""
        what, _, value = rest.partition(" ")
        value = value.strip()
        if what == "system" and value:
            if value.startswith(QUOTES):
                value = self._lines(value[len(QUOTES):])
                if value is None:
                    return
            self.system = value
            self.ctx.err("Set system message.")
        elif what == "parameter":
            self._set_parameter(value.split())
        elif what in ("verbose", "quiet") and not value:
            self.verbose = what == "verbose"
            self.ctx.err(f"Set '{what}' mode.")
        elif what in ("think", "nothink") and not (what == "nothink" and value):
            self._set_think(what, value)
        elif what in ("hidethinking", "nohidethinking") and not value:
            self.hide_thinking = what == "hidethinking"
            self.ctx.err("Set 'hidethinking' mode." if self.hide_thinking
                         else "Set 'nohidethinking' mode.")
        elif not what or what == "system":
            self.ctx.err("\n".join(line for line in HELP.splitlines()
                                   if line.startswith("  /set")))
        else:
            self.ctx.err(f"Error: unknown command '/set {what}'; /help lists the commands")

    def _set_think(self, what: str, value: str) -> None:
        """/set think [LEVEL], /set nothink: thinking on (at a level) or off."""
        try:
            think = False if what == "nothink" else think_value(value)
        except ValueError as exc:
            self.ctx.err(f"Error: cannot set think: {exc}")
            return
        if think is not False:
            try:
                reasons = reasons_of(self.client, self.model_id)
            except ApiError as exc:
                self.ctx.err(f"Error: {exc}")
                return
            if not reasons:
                self.ctx.err(f"Error: model '{self.model_id}' does not support thinking")
                return
        self.think = think
        self.ctx.err("Set 'nothink' mode." if think is False else
                     f"Set 'think' mode{'' if think is True else f' ({think})'}.")

    def _set_parameter(self, words: list[str]) -> None:
        """Set a request field for the rest of the session, checked as the API checks it."""
        if len(words) < 2:
            self.ctx.err("Usage: /set parameter NAME VALUE; NAME is one of "
                         + ", ".join(PARAMETERS))
            return
        name, values = words[0], words[1:]
        if name in START_ONLY:
            self.ctx.err(f"Error: {name} is set when the model starts: leave, and run it "
                         f"again with {START_ONLY[name]} N")
            return
        if name not in PARAMETERS:
            self.ctx.err(f"Error: unknown parameter '{name}'; one of "
                         + ", ".join(PARAMETERS))
            return
        try:
            value = _parameter_value(PARAMETERS[name], values)
        except ValueError as exc:
            self.ctx.err(f"Error: cannot set parameter '{name}': {exc}")
            return
        self.parameters[PARAMETERS[name]] = value
        self.ctx.err(f"Set parameter '{name}' to '{', '.join(values)}'")

    def _show(self, rest: str) -> None:
        """/show info: the model's record, how it runs, and this session's settings."""
        if rest != "info":
            self.ctx.err("Usage: /show info" if not rest else
                         f"Error: unknown command '/show {rest}'; /help lists the commands")
            return
        try:
            record = self.client.get_model(self.model_id)
            running = {row["id"]: row for row in self.client.models_status()["data"]}
        except ApiError as exc:
            self.ctx.err(f"Error: {exc}")
            return
        meta = record.get("metadata") or {}
        count = meta.get("parameter_count")
        rows = [("id", record["id"]), ("engine", record.get("engine")),
                ("architecture", meta.get("architecture")),
                ("parameters", _count(count) if isinstance(count, int) else None),
                ("context length", meta.get("context_length")),
                ("quantization", meta.get("quantization")),
                ("size", human_size(record.get("size") or 0))]
        options = (running.get(self.model_id) or {}).get("options") or {}
        sections = [("Model", rows),
                    ("Running", [("context (ctx_len)", options.get("ctx_len"))]
                     if self.model_id in running else [("status", "not running")]),
                    ("Capabilities", [(c, "") for c in record.get("capabilities") or ()]),
                    ("Session parameters", sorted(self.parameters.items())),
                    ("System", [(self.system, "")] if self.system else [])]
        lines = []
        for title, pairs in sections:
            pairs = [(k, v) for k, v in pairs if v is not None]
            if pairs:
                lines.append(f"  {title}")
                lines += [f"    {k:<20}{v}".rstrip() for k, v in pairs] + [""]
        self.ctx.err("\n".join(lines))

    def _clear(self, rest: str) -> None:
        """/clear: forget the conversation; the system message and parameters stay."""
        self.history = []
        self.ctx.err("Cleared session context")

    def _load(self, rest: str) -> None:
        """/load ID: chat with another model from here on, the conversation cleared."""
        if not rest or " " in rest or self.load is None:
            self.ctx.err("Usage: /load ID")
            return
        self.ctx.err(f"Loading model '{rest}'")
        try:
            model_id = self.load(rest)
        except (ApiError, CliError) as exc:
            self.ctx.err(f"Error: {exc}")
            return
        self.model_id, self.history = model_id, []

    def _help(self, rest: str) -> None:
        """/help, /?: the commands."""
        self.ctx.err(HELP)

    # --- replies --------------------------------------------------------------------

    def _send(self, line: str) -> None:
        """Send a message and show the reply; a refused message leaves the conversation."""
        try:
            content = self._content(line)
        except OSError as exc:
            self.ctx.err(f"Error: the image cannot be read: {exc}")
            return
        self.history.append({"role": "user", "content": content})
        try:
            self._reply()
        except (ApiError, CliError) as exc:  # e.g. the conversation outgrew the context
            self.history.pop()
            self.ctx.err(f"Error: {exc}")

    def _reply(self) -> bool:
        """Stream one reply to stdout and keep it; Ctrl-C ends it early and keeps what
        came (then False)."""
        shown = Shown(self.ctx, hidden=self.hide_thinking)
        stream, usage, first, whole = None, None, None, True
        request = {"model": self.model_id, "messages": self.messages(), **self.parameters,
                   **think_fields(self.think)}
        if self.verbose:
            request["stream_options"] = {"include_usage": True}
        started = time.monotonic()
        try:
            # Opening waits for the model's turn (and reads the prompt): Ctrl-C may come here.
            stream = self.client.chat_stream(request)
            for chunk in stream:
                if "error" in chunk:
                    raise CliError(f"The reply failed: {chunk['error'].get('message')}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    # Servers write the thinking as reasoning_content, reasoning or both
                    # (the same text): one of them is read.
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    piece = delta.get("content")
                    if thought or piece:
                        first = first or time.monotonic()
                    if thought:
                        shown.thinking(thought)
                    if piece:
                        shown.answer(piece)
        except KeyboardInterrupt:  # the server stops generating when the stream closes
            shown.interrupted()
            whole = False
        finally:
            if stream is not None:
                stream.close()
            shown.end()
        self.ctx.out("")
        message = {"role": "assistant", "content": "".join(shown.pieces)}
        if shown.thoughts:
            message["reasoning_content"] = "".join(shown.thoughts)
        self.history.append(message)
        if self.verbose and usage:
            self.ctx.err(readout(usage, started, first, time.monotonic()))
        return whole


class Shown:
    """A reply as the terminal shows it: the thinking apart (a "Thinking…" line, the
    trace dimmed on a terminal, "…done thinking." before the answer), on stdout when
    stdout is a terminal and on stderr otherwise, or not at all when `hidden`; the
    answer on stdout. Keeps both for the history."""

    def __init__(self, ctx: Context, hidden: bool):
        self.ctx, self.hidden = ctx, hidden
        self.stream = ctx.stdout if isatty(ctx.stdout) else ctx.stderr
        self.dim = isatty(self.stream)
        self.pieces: list[str] = []
        self.thoughts: list[str] = []
        self._open = False  # the thinking is being shown

    def thinking(self, text: str) -> None:
        """A piece of the thinking."""
        self.thoughts.append(text)
        if self.hidden:
            return
        if not self._open:
            if self.stream is self.ctx.stdout and self.pieces:
                self._write("\n")
            self._write(f"{THINKING}\n" + (DIM if self.dim else ""))
            self._open = True
        self._write(text)

    def answer(self, text: str) -> None:
        """A piece of the answer."""
        self._close()
        self.pieces.append(text)
        self.ctx.stdout.write(text)
        self.ctx.stdout.flush()

    def interrupted(self) -> None:
        """Ctrl-C ended the reply."""
        self._close()
        self.ctx.stdout.write(" [interrupted]")

    def end(self) -> None:
        """The reply ended (a stream that ended inside the thinking ends it here)."""
        self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            self._write((RESET if self.dim else "") + f"\n{DONE_THINKING}\n\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def reasons_of(client, model_id: str) -> bool:
    """Whether the model may think: its capabilities say "reasoning", or it is remote
    (its upstream's model is not known here: the upstream decides)."""
    record = client.get_model(model_id)
    return "reasoning" in (record.get("capabilities") or ()) or \
        (record.get("source") or {}).get("type") == "remote"


def readout(usage: dict, started: float, first: float | None, ended: float) -> str:
    """--verbose's lines: the prompt's and the reply's tokens, each with its tok/s."""
    prompt, reply = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    first = first or ended  # no piece came: the whole time was the prompt's

    def rate(tokens: int, seconds: float) -> str:
        return f", {tokens / seconds:.1f} tok/s" if tokens and seconds > 0 else ""

    held = f" ({cached} from the prompt cache)" if cached else ""
    return (f"prompt tokens: {prompt}{held}{rate(prompt - cached, first - started)}\n"
            f"reply tokens:  {reply}{rate(reply, ended - first)}\n"
            f"total time:    {ended - started:.2f} s")


def _parameter_value(field: str, words: list[str]):
    """A /set parameter value for a chat request field, read and checked as the field's
    schema says; ValueError says why not."""
    from localrt import schemas  # plain JSON reading; jsonschema stays unloaded

    if field == "stop":
        return words
    if len(words) != 1:
        raise ValueError(f"expected one value, got {len(words)}")
    spec = schemas.load("chat-completion.json")["properties"][field]
    kind = "integer" if "integer" in spec["type"] else "number"
    low, high = spec.get("minimum"), spec.get("maximum")
    try:
        value = int(words[0]) if kind == "integer" else float(words[0])
    except ValueError:
        value = None
    if value is None or low is not None and value < low or high is not None and value > high:
        span = f" from {low:g} to {high:g}" if kind == "number" else f" from {low} to {high}"
        raise ValueError(f"expected {'a whole number' if kind == 'integer' else 'a number'}"
                         f"{span}, got '{words[0]}'")
    return value


def _count(count: int) -> str:
    """A parameter count as Ollama shows it: 7.6B, 494.0M, 22.7K."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def _starts_with_image(line: str) -> bool:
    """Whether a line that begins with / begins with the path of an image file (a
    message with an image), not a command."""
    text, paths = find_images(line)
    return bool(paths) and not text.startswith(line.split()[0])
