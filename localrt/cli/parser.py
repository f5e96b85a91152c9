"""The `localrt` argparse tree: every command, subcommand and option, and their help.

The option lists of `config`, `models update`, `models start` and `run` are made
from the request schemas (localrt.cli.flags). If you add a command or option, also
add it to man/localrt.1 (tests/test_man.py checks).
"""

from __future__ import annotations

import argparse
import sys

from localrt import __version__
from localrt.cli.flags import config_options, model_update_options, port, positive_int

# The clients `launch` knows (localrt.cli.commands.launch.CLIENTS, which is imported only
# once the arguments are parsed): change both together.
LAUNCH_CLIENTS = ("claude", "codex", "opencode", "aider", "llm")
# Other names `models` subcommands answer to.
MODEL_ALIASES = {"rm": "remove", "delete": "remove"}


class _Parser(argparse.ArgumentParser):
    """argparse that prints to the streams main() was given."""

    streams = (sys.stdout, sys.stderr)

    def parse_args(self, args=None, namespace=None):
        """argparse's, except that words after `run`'s options join its PROMPT: argparse
        ends a positional list at the first option (`run ID --ctx_len 8 "a prompt"`);
        and `--think` takes a value only as `--think=VALUE`, as Ollama's does, so that
        `run ID --think "a prompt"` asks the prompt."""
        if args is None:
            args = sys.argv[1:]
        args = ["--think=true" if word == "--think" else word for word in args]
        args, extra = self.parse_known_args(args, namespace)
        if extra and isinstance(getattr(args, "prompt", None), list) \
                and not any(word.startswith("-") for word in extra):
            args.prompt.extend(extra)
        elif extra[:1] == ["--"] and isinstance(getattr(args, "client_args", None), list):
            # `launch claude --model ID -- -p hi`: argparse leaves what follows `--` over
            # once an option came between the positionals.
            args.client_args.extend(extra[1:])
        elif extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return args

    def _print_message(self, message, file=None):
        if message:
            out, err = self.streams
            (err if file is sys.stderr or file is None else out).write(message)


def build_parser(stdout=None, stderr=None) -> argparse.ArgumentParser:
    """The whole argparse tree."""
    parser_class = type("Parser", (_Parser,), {"streams": (stdout or sys.stdout,
                                                           stderr or sys.stderr)})
    parser = parser_class(prog="localrt", description="A local model runtime: an HTTP API "
                          "server and this command line for it.")
    parser.add_argument("--version", action="version", version=f"localrt {__version__}")
    parser.add_argument("--config", metavar="PATH",
                        help="settings file to use instead of ~/.localrtrc ($LOCALRT_CONFIG)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("start", help="start the API server", description="Start the API "
                       "server in the background and wait until it answers.")
    p.add_argument("--host", help="address to bind (default: apiServerHost, 127.0.0.1)")
    p.add_argument("--port", type=port, help="port to bind (default: apiServerPort, 39281; "
                   "0 picks a free one)")
    p.add_argument("--foreground", action="store_true",
                   help="run in the foreground, for systemd and containers; SIGTERM stops it")

    sub.add_parser("stop", help="stop the API server",
                   description="Stop the API server gracefully and wait until its port is free.")

    p = sub.add_parser("config", help="show or change the server's configuration",
                       description="Without options, or with `status`, print every setting. "
                       "With options, change those settings in one request.")
    p.add_argument("action", nargs="?", choices=["status"], help="print every setting")
    _add_schema_options(p, config_options(), "config_fields")

    pull_help = "download a model from the hub, with a progress bar"
    pull_description = ("Download a model from the model hub and register it, showing its "
                        "progress. ID is <name>, <name>:<variant>, <org>/<repo>, "
                        "<org>/<repo>:<file> or a hub URL. If the download is already "
                        "running, follow it. Ctrl-C asks whether to cancel it.")
    _add_pull_arguments(sub.add_parser("pull", help=pull_help, description=pull_description))

    run_help = "pull a model if needed, start it and chat with it"
    run_description = ("Download the model if it is not local yet (with progress), or "
                       "import the GGUF file ID names (./model.gguf), start it, then chat "
                       "with it in the terminal: replies stream as they are generated and "
                       "the conversation is kept; /help lists the session's commands. With "
                       "a PROMPT, or with standard input not a terminal, answer once and "
                       "exit.")
    _add_run_arguments(sub.add_parser("run", help=run_help, description=run_description))
    p = sub.add_parser("embed", help="print the embeddings of texts",
                       description="Print each TEXT's embedding from model ID as a JSON "
                       "array of numbers (unit length), one line per TEXT, in order. The "
                       "server starts the model if it is not running; a model running for chat "
                       "embeds too.")
    p.add_argument("model", metavar="ID", help="the model's id")
    p.add_argument("text", metavar="TEXT", nargs="+", help="a text to embed")
    p.add_argument("--dimensions", type=int, metavar="N", help="keep the first N numbers "
                   "of each embedding, scaled again to unit length")
    p = sub.add_parser("rerank", help="rank documents by their relevance to a query",
                       description="Score each DOC against QUERY with the reranker ID and "
                       "print the ranking, best first: one line per DOC with its score, its "
                       "place among the DOCs (from 0) and its text, separated by tabs. The "
                       "server starts the model if it is not running.")
    p.add_argument("--model", required=True, metavar="ID", help="the reranker's id")
    p.add_argument("query", metavar="QUERY", help="what the documents are scored against")
    p.add_argument("documents", metavar="DOC", nargs="+", help="a document to score")
    p.add_argument("--top-n", type=positive_int, metavar="N", help="print only the N best")
    p = sub.add_parser("transcribe", help="print the text of an audio file",
                       description="Transcribe FILE (WAV, MP3 or FLAC) with the audio model "
                       "ID and print the text, or subtitles (srt, vtt), or the reply as "
                       "JSON. A long clip (1 MiB or more) in text or json streams, with a "
                       "progress line on stderr. The server starts the model if it is not "
                       "running.")
    p.add_argument("file", metavar="FILE", help="the audio file")
    p.add_argument("--model", required=True, metavar="ID", help="an audio model's id")
    p.add_argument("--format", choices=("text", "srt", "vtt", "json"), default="text",
                   help="what to print (default: text)")
    p.add_argument("--language", metavar="LANG", help="the clip's language (en, de, ...)")
    p.add_argument("--prompt", metavar="TEXT", help="text that came before the clip")
    p.add_argument("--translate", action="store_true",
                   help="translate into English instead")
    p = sub.add_parser("launch", help="run a coding agent or chat client pointed at localrt",
                       description="Start the server if needed, make the model ready and "
                       "start it with a context that holds the client's prompt (restarting "
                       "it if it runs with less), then run CLIENT pointed at localrt with "
                       "ARGS, and exit with its exit status. Without --model: the one "
                       "running model, else the one launched last. The user's own "
                       "configuration of the client is never edited.")
    p.add_argument("client", metavar="CLIENT", nargs="?", choices=LAUNCH_CLIENTS,
                   help=f"the client: {', '.join(LAUNCH_CLIENTS)}")
    p.add_argument("client_args", metavar="ARGS", nargs="*",
                   help="the client's own arguments, after --")
    p.add_argument("--model", metavar="ID", help="the model's id, or the path of a GGUF "
                   "file to import (pulled if it is not local yet)")
    p.add_argument("--print", action="store_true", help="print the environment, options "
                   "and files the client would get, and start nothing")
    p.add_argument("--list", action="store_true", help="list the clients launch knows and "
                   "whether each is installed")
    sub.add_parser("ps", help="show the running models and the hardware",
                   description="Print the running models (engine, RAM, VRAM, up time, "
                   "context length) and this machine's CPU, memory and GPU.")

    p = sub.add_parser("models", help="list, inspect, change, import and pull models",
                       description="Manage the downloaded and imported models.")
    models = p.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)
    models.add_parser("list", help="list the models", description="Print a table of the "
                      "downloaded and imported models.")
    p = models.add_parser("get", help="print a model's record as JSON",
                          description="Print a model's whole record as JSON.")
    p.add_argument("model", metavar="ID", help="the model's id, as `models list` shows it")
    p = models.add_parser("remove", aliases=[a for a, n in MODEL_ALIASES.items()
                                             if n == "remove"],
                          help="delete a model", description="Delete a model's files and "
                          "definition. An imported model's own file is never deleted.")
    p.add_argument("model", metavar="ID", help="the model's id")
    p = models.add_parser("update", help="change a model's stored parameters",
                          description="Change the stored load and inference parameters "
                          "of a model in one request. Only the options given change.")
    p.add_argument("model", metavar="ID", help="the model's id")
    p.add_argument("--mmproj", metavar="PATH", help="a vision projector (mmproj GGUF) to "
                   "link in, as the GGUF model's projector; it replaces the one it has")
    p.add_argument("--lora", metavar="PATH[:SCALE]", action="append", help="a LoRA adapter "
                   "GGUF to apply at start, with its scale (default 1.0); repeat it for "
                   "several: they replace the adapters the model has (--lora '' drops "
                   "them all)")
    _add_schema_options(p, model_update_options(), "parameters")
    p = models.add_parser("import", help="register a local GGUF file or ONNX folder",
                          description="Register a local GGUF file, or an ONNX model folder "
                          "(one holding genai_config.json), as a model, without the hub. "
                          "It is linked, or copied with --copy.")
    # --model_path and --model_id are cortex's spellings of the same options.
    p.add_argument("--path", "--model_path", dest="path", required=True, metavar="PATH",
                   help="the GGUF file or ONNX model folder")
    p.add_argument("--id", "--model_id", dest="id", metavar="ID", help="the model's id "
                   "(default: the file name without .gguf)")
    p.add_argument("--mmproj", metavar="PATH", help="the GGUF model's vision projector "
                   "(mmproj GGUF), linked or copied as the model is")
    p.add_argument("--lora", metavar="PATH[:SCALE]", action="append", help="a LoRA adapter "
                   "GGUF of the model, linked or copied as the model is and applied at "
                   "start with its scale (default 1.0); repeat it for several (a request's "
                   "lora[].id counts them in this order)")
    p.add_argument("--copy", action="store_true", help="copy the file into the models "
                   "folder instead of linking to it")
    p = models.add_parser("add-remote", help="add a model served by other servers",
                          description="Register a remote model: its chats are forwarded "
                          "to OpenAI-compatible servers (vLLM, llama-server, "
                          "llama-cpp-python's server, another localrt), each request to the "
                          "healthy one with the fewest requests in flight.")
    p.add_argument("model", metavar="ID", help="the model id clients will ask for")
    p.add_argument("--url", action="append", required=True, metavar="URL",
                   help="an upstream's OpenAI base URL, such as http://gpu1:8000/v1; "
                   "repeat it for each replica")
    p.add_argument("--upstream-model", metavar="NAME", help="the model's name on the "
                   "upstreams (default: the one model each lists)")
    p.add_argument("--api-key-env", metavar="VAR", help="the environment variable that "
                   "holds the upstreams' API key")
    p.add_argument("--max-inflight", type=positive_int, metavar="N", help="requests "
                   "forwarded to each upstream at once; more wait their turn")
    _add_pull_arguments(models.add_parser("pull", help=pull_help,
                                          description=pull_description))
    _add_start_arguments(models.add_parser(
        "start", help="load a model", description="Load a model with its stored "
        "parameters; the options given override them for this run."))
    p = models.add_parser("stop", help="unload a running model",
                          description="Unload a running model and free its memory.")
    p.add_argument("model", metavar="ID", help="the model's id")
    _add_run_arguments(models.add_parser("run", help=run_help, description=run_description))

    p = sub.add_parser("engines", help="list, install and uninstall inference engines",
                       description="Manage the inference engines: gguf-cpp (GGUF, "
                       "llama.cpp), onnx-runtime (ONNX) and custom engines.")
    engines = p.add_subparsers(dest="engines_command", metavar="SUBCOMMAND", required=True)
    engines.add_parser("list", help="list the engines", description="Print a table of the "
                       "engines with their version, variant and status.")
    p = engines.add_parser("get", help="list an engine's installed variants",
                           description="Print a table of an engine's installed variants.")
    p.add_argument("engine", metavar="ENGINE", help="gguf-cpp, onnx-runtime, or a custom "
                   "engine's name")
    p = engines.add_parser("install", help="install an engine, with a progress bar",
                           description="Install an engine variant from the package index "
                           "(engineIndexUrl), or a custom engine from a wheel file or URL, "
                           "showing its progress. Ctrl-C asks whether to cancel it.")
    p.add_argument("engine", metavar="ENGINE", help="the engine's name, or the path or "
                   "URL of a custom engine's .whl file")
    _add_variant_arguments(p, "install (default: the newest)",
                           "install (default: the one recommended for this machine)",
                           short=True)
    p.add_argument("-m", "--menu", action="store_true", help="list the variants and "
                   "install the one chosen")
    p = engines.add_parser("uninstall", help="uninstall an engine variant",
                           description="Uninstall an engine variant, the active one unless "
                           "told. The gguf-cpp build that ships with localrt is deactivated, "
                           "not deleted; `engines install gguf-cpp` turns it back on.")
    p.add_argument("engine", metavar="ENGINE", help="the engine's name")
    _add_variant_arguments(p, "uninstall", "uninstall")
    p = engines.add_parser("use", help="choose which installed variant models load",
                           description="Make an installed variant the one the engine's "
                           "models load. If the engine is already loaded, restart the "
                           "server for it to take effect.")
    p.add_argument("engine", metavar="ENGINE", help="the engine's name")
    p.add_argument("--variant", required=True, metavar="VARIANT", help="the variant to use")
    p.add_argument("--version", required=True, metavar="VERSION", help="its version")
    return parser


def _add_variant_arguments(p: argparse.ArgumentParser, version_help: str,
                           variant_help: str, short: bool = False) -> None:
    """--version and --variant; `short` adds -v, cortex's name for --version."""
    p.add_argument(*(["-v"] if short else []), "--version", metavar="VERSION",
                   help=f"the version to {version_help}")
    p.add_argument("--variant", metavar="VARIANT", help=f"the variant to {variant_help}, "
                   f"such as linux-amd64-avx2")


def _add_start_arguments(p: argparse.ArgumentParser, skip=(),
                         model_help: str = "the model's id") -> None:
    """The model id and the start options, but those in `skip`."""
    p.add_argument("model", metavar="ID", help=model_help)
    _add_schema_options(p, model_update_options("model-start.json", skip=("model", *skip)),
                        "start_options")


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """`run`'s: the start options but `embedding` (it chats), a prompt, --verbose."""
    _add_start_arguments(p, skip=("embedding",), model_help="the model's id, or the path "
                         "of a GGUF file to import and run (./model.gguf)")
    p.add_argument("prompt", metavar="PROMPT", nargs="*", help="answer this once and exit "
                   "(after standard input's text, when that is not a terminal)")
    p.add_argument("--verbose", action="store_true", help="after each reply, print the "
                   "prompt's and the reply's tokens and their tok/s")
    p.add_argument("--think", default=None, type=_think,
                   metavar="true|false|low|medium|high",
                   help="let a reasoning model think (at a level), or not (--think=false); "
                   "without it, the model's default")
    p.add_argument("--hidethinking", action="store_true",
                   help="do not show a reasoning model's thinking, only its answer")


def _think(text: str):
    """--think's value: True, False or a level."""
    from localrt.cli.chat import think_value

    try:
        return think_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_pull_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="ID", help="the model to download")
    p.add_argument("--file", metavar="NAME", help="which GGUF file of an <org>/<repo> "
                   "repository to download (asked for on a terminal when it holds several)")


def _add_schema_options(p: argparse.ArgumentParser, options, names_dest: str) -> None:
    """Add flags made from a schema; `names_dest` lists their names for flag_values()."""
    names = []
    for flag, keywords in options:
        p.add_argument(flag, **keywords)
        names.append(flag[2:])
    p.set_defaults(**{names_dest: tuple(names)})
