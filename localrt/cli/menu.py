"""Numbered menus on stderr, answered on stdin: a model's variant or file for `pull`,
an engine's variant for `engines install --menu`.
"""

from __future__ import annotations

from localrt.cli.context import CliError, Context


def list_choices(ctx: Context, rows, right=()) -> None:
    """Numbered lines of cells (strings, "" for none) on stderr, each column aligned;
    the columns numbered in `right` (sizes) to the right."""
    widths = [max(len(cell) for cell in column) for column in zip(*rows)]
    for number, row in enumerate(rows, 1):
        cells = [cell.rjust(width) if column in right else cell.ljust(width)
                 for column, (cell, width) in enumerate(zip(row, widths))]
        ctx.err(f"  {number}. " + "  ".join(cells).rstrip())


def ask_number(ctx: Context, noun: str, ids: list, names: list,
               default: str | None = None) -> str:
    """Read a choice by number or name (Enter: the default, if any); its id."""
    hint = f", Enter for {names[ids.index(default)]}" if default in ids else ""
    while True:
        answer = ctx.ask(f"Choose a {noun} [1-{len(ids)}{hint}]: ")
        if answer is None:
            raise CliError(f"No {noun} chosen")
        answer = answer.strip()
        if not answer and default in ids:
            return default
        if answer in names:
            return ids[names.index(answer)]
        if answer.isdigit() and 1 <= int(answer) <= len(ids):
            return ids[int(answer) - 1]
        ctx.err(f"Please answer with a number from 1 to {len(ids)}")
