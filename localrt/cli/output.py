"""How the CLI shows things: boxed tables, values, durations, and a task's progress.

tqdm is imported only when a progress bar is drawn, so `--help` stays light.
"""

from __future__ import annotations

import time

from localrt.cli.context import isatty


def table(headers, rows) -> str:
    """A boxed text table, as cortex prints them."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([rule, line(headers), rule, *(line(r) for r in rows), rule])


def show(value) -> str:
    """A Config value as the settings file spells it (true/false for booleans)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def duration(seconds: float) -> str:
    """An up time: 42s, 3m 5s, 2h 7m."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60}m"


class Progress:
    """A download's progress: a tqdm bar on a terminal, otherwise one line at the end."""

    def __init__(self, stream, label: str, task: dict):
        self.stream, self.label = stream, label
        self.total, self.done = _task_bytes(task)
        self.started = time.monotonic()
        self.bar = None
        self.closed = False
        if isatty(stream):
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, desc=label, unit="B",
                            unit_scale=True, unit_divisor=1024, file=stream,
                            dynamic_ncols=True)

    def update(self, task: dict) -> None:
        """Move to the task's position (it goes back when a damaged file restarts)."""
        self.total, done = _task_bytes(task)
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.update(done - self.done)
            build = task.get("build")  # an engine variant compiled from source
            if build:
                self.bar.set_postfix_str(f"compiling {build['step']}/{build['steps']}"
                                         if build["stage"] == "compile" else build["stage"])
        self.done = done

    def close(self) -> None:
        """End the bar, or write the one line a log file gets."""
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
            return
        from tqdm import tqdm

        line = tqdm.format_meter(self.done, self.total, time.monotonic() - self.started,
                                 prefix=self.label, unit="B", unit_scale=True,
                                 unit_divisor=1024, ascii=True, ncols=80)
        print(line, file=self.stream, flush=True)


def _task_bytes(task: dict) -> tuple[int, int]:
    """(total, downloaded) bytes over a task's items."""
    items = task.get("items") or []
    return (sum(i.get("bytes") or 0 for i in items),
            sum(i.get("downloadedBytes") or 0 for i in items))
