"""`localrt embed ID TEXT...`: each text's embedding, one JSON array a line."""

from __future__ import annotations

import json

from localrt.cli.context import Context, ExitCode


def cmd_embed(ctx: Context) -> int:
    """Print each text's embedding as a JSON array of numbers, one line each, in order."""
    args = ctx.args
    reply = ctx.client().embeddings(args.model, args.text, dimensions=args.dimensions)
    for item in sorted(reply["data"], key=lambda d: d["index"]):
        ctx.out(json.dumps(item["embedding"]))
    return ExitCode.OK
