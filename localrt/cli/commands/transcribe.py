"""`localrt transcribe FILE --model ID [--format text|srt|vtt|json]`: a clip's text."""

from __future__ import annotations

import json
import os

from localrt.cli.context import CliError, Context, ExitCode, isatty

# A clip this large (about 30 seconds of 16 kHz 16-bit WAV) takes long enough to show
# how far it has got: its text streams in, counted on a progress line on stderr.
PROGRESS_BYTES = 1024 * 1024


def cmd_transcribe(ctx: Context) -> int:
    """Print the transcription (or with --translate the English translation) of FILE in
    the chosen format; for a long clip in text or json, a progress line on stderr."""
    args = ctx.args
    try:
        with open(os.path.expanduser(args.file), "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CliError(f"Cannot read {args.file}: {exc.strerror or exc}") from None
    client = ctx.client()
    fmt = "json" if args.format == "json" else args.format
    name = os.path.basename(args.file)
    options = {"language": args.language, "prompt": args.prompt,
               "translate": args.translate}
    if len(data) >= PROGRESS_BYTES and fmt in ("text", "json"):
        return _streamed(ctx, client, data, name, fmt, options)
    reply = client.transcribe(args.model, data, name, response_format=fmt, **options)
    if fmt == "json":
        ctx.out(json.dumps(reply, indent=2, ensure_ascii=False))
    else:
        ctx.out(reply.rstrip("\n") if fmt == "text" else reply.rstrip("\n") + "\n")
    return ExitCode.OK


def _streamed(ctx: Context, client, data: bytes, name: str, fmt: str, options) -> int:
    """A long clip's transcription streamed, a progress line on stderr as it comes."""
    ctx.err(f"Transcribing {name} ({len(data) / (1024 * 1024):.1f} MiB)...")
    done, live = None, isatty(ctx.stderr)
    with client.transcribe(ctx.args.model, data, name, response_format=fmt, stream=True,
                           **options) as events:
        count = 0
        for event in events:
            if "error" in event:
                raise CliError(event["error"].get("message", "the transcription failed"))
            if event.get("type") == "transcript.text.delta":
                count += len(event.get("delta", ""))
                if live:  # one line, rewritten: a log file gets the first line only
                    ctx.stderr.write(f"\r{count} characters of text so far")
                    ctx.stderr.flush()
            elif event.get("type") == "transcript.text.done":
                done = event
    if live and count:
        ctx.stderr.write("\n")
    if done is None:
        raise CliError("The transcription ended before its text was done")
    if fmt == "json":
        ctx.out(json.dumps({"text": done["text"], "usage": done.get("usage")}, indent=2,
                           ensure_ascii=False))
    else:
        ctx.out(done["text"])
    return ExitCode.OK
