"""`localrt config`: set Config fields with one PATCH, or print them all.

Its flags are the properties of schemas/config-update.json (localrt.cli.flags).
"""

from __future__ import annotations

from localrt.cli.context import Context, ExitCode
from localrt.cli.flags import flag_values
from localrt.cli.output import show, table
from localrt.security import url_without_credentials


def cmd_config(ctx: Context) -> int:
    """Set Config fields with one PATCH, or print them all as a table."""
    changes = flag_values(ctx.args, ctx.args.config_fields)
    if changes:
        ctx.client().update_config(changes)
        ctx.out("Configuration updated successfully!")
    if not changes or ctx.args.action == "status":
        config = ctx.client().get_config()
        rows = []
        for name, value in config.items():
            values = value if isinstance(value, list) else [value]
            if name == "proxy_url":  # user:password@ in a URL is never shown
                values = [url_without_credentials(v) for v in values]
            rows += [(name, show(v)) for v in values] or [(name, "")]
        ctx.out(table(["Config name", "Value"], rows))
    return ExitCode.OK
