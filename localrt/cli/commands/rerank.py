"""`localrt rerank --model ID QUERY DOC...`: the documents ranked against the query."""

from __future__ import annotations

from localrt.cli.context import Context, ExitCode


def cmd_rerank(ctx: Context) -> int:
    """Print the ranking, best first: each document's score, index and text, by tabs."""
    args = ctx.args
    reply = ctx.client().rerank(args.model, args.query, args.documents, top_n=args.top_n)
    for result in reply["results"]:
        index = result["index"]
        ctx.out(f"{result['relevance_score']:.6f}\t{index}\t{args.documents[index]}")
    return ExitCode.OK
