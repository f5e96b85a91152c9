"""`localrt launch` (localrt.cli.commands.launch): the clients it knows, what each is
handed (--print), which model it picks and the context it starts it with; then the real
clients from npm's registry (tests/support/agents.py), Claude Code and Codex with its
default config, run through `localrt launch` against a server it starts.

The models are tiny llamas with Qwen 2.5's real chat template (tests/emulators/ggufgen.py),
scripted: "answer" always writes SCRIPT; "caller" calls Codex's exec_command, and after
the tool's result writes DONE. Its template is Qwen 2.5's with one change: a prompt whose
last message is a tool's result ends with the token AFTER, and the scripted weights answer
that token with DONE, so the model answers only once Codex has sent the result back.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tomllib

import gguf
import pytest
from emulators.chattemplates import TEMPLATES, TOKENS
from emulators.ggufgen import write_gguf
from support.cli import run
from support.models import KINDS, add_model
from support.servers import send

from localrt.cli.commands.launch import CLIENTS, Target
from localrt.cli.commands.models import context_for
from localrt.cli.parser import LAUNCH_CLIENTS, build_parser

USER = gguf.TokenType.USER_DEFINED
SCRIPT = ["Scripted", " reply from localrt"]
CALL = ["<tool_call>", '{"name": "exec_command", "arguments": {"cmd": "echo hi-from-tool"}}',
        "</tool_call>"]
AFTER, DONE = "<|result|>", "Codex ran the command"
CLIENT_TIMEOUT = 400  # seconds: a client's whole run, its long first prompt included


def _after_tool_results(template: str) -> str:
    """Qwen 2.5's template, ending a prompt whose last message is a tool's result with AFTER."""
    prompt = "{{- '<|im_start|>assistant\\n' }}"
    at = template.rindex(prompt) + len(prompt)
    return (template[:at] + "{%- if messages[-1].role == 'tool' %}{{- '" + AFTER + "' }}"
            "{%- endif %}" + template[at:])


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    family = [(t, KINDS[k]) for t, k in TOKENS["qwen25"]]
    # A 64k-token context: Claude Code's (65,536) fits it exactly.
    return {"answer": write_gguf(root / "answer.gguf", name="answer", vocab_size=1700,
                                 context_length=65536, chat_template=TEMPLATES["qwen25"],
                                 added_tokens=family + [(t, USER) for t in SCRIPT],
                                 script=SCRIPT),
            "caller": write_gguf(root / "caller.gguf", name="caller", vocab_size=1700,
                                 context_length=65536,
                                 chat_template=_after_tool_results(TEMPLATES["qwen25"]),
                                 added_tokens=family + [(t, USER) for t in
                                                        (CALL[1], AFTER, DONE)],
                                 script=CALL, branches=[(AFTER, [DONE])]),
            "short": write_gguf(root / "short.gguf", name="short", context_length=2048),
            "long": write_gguf(root / "long.gguf", name="long", vocab_size=1700,
                               context_length=8192)}


# --- what each client is handed, and the context -----------------------------------------


def test_the_parser_knows_every_client_and_keeps_the_clients_arguments():
    assert set(LAUNCH_CLIENTS) == set(CLIENTS)
    parser = build_parser()
    args = parser.parse_args(["launch", "claude", "--model", "m", "--", "-p", "--model", "x"])
    assert (args.client, args.model, args.client_args) == ("claude", "m", ["-p", "--model", "x"])
    args = parser.parse_args(["launch", "codex", "--", "exec", "--json", "hi"])
    assert (args.client, args.model, args.client_args) == ("codex", None, ["exec", "--json", "hi"])


def test_the_context_holds_the_clients_prompt_within_what_the_model_was_trained_on():
    trained = {"metadata": {"context_length": 131072}, "ctx_len": 4096}
    assert context_for(trained, 65536) == 65536
    assert context_for({**trained, "ctx_len": 100000}, 65536) == 100000  # the user's choice
    assert context_for({"metadata": {"context_length": 8192}, "ctx_len": 4096}, 65536) == 8192
    assert context_for({"ctx_len": 2048}, 32768) == 32768  # no trained context known


def test_list_names_each_client_whether_it_is_installed_and_how_to_install_it(cli_home,
                                                                             monkeypatch,
                                                                             tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing installed
    code, out, err = run("launch", "--list")
    assert code == 0, err
    for agent in CLIENTS.values():
        line = next(row for row in out.splitlines() if f"| {agent.name} " in row)
        assert "| no " in line and agent.install in line


def test_a_missing_client_is_named_with_its_install_command_and_nothing_starts(
        cli_home, monkeypatch, tmp_path):
    from localrt import server

    monkeypatch.setenv("PATH", str(tmp_path))
    code, out, err = run("launch", "claude", "--model", "m")
    assert code == 2
    assert "Claude Code is not installed" in err
    assert "npm install -g @anthropic-ai/claude-code" in err
    assert server.read_pid_file(cli_home) is None


def test_print_without_a_server_needs_the_model_and_starts_nothing(cli_home):
    from localrt import server

    code, out, err = run("launch", "claude", "--print")
    assert code == 2 and "--model ID" in err
    code, out, err = run("launch", "claude", "--print", "--model", "qwen", "--", "-p", "hi")
    assert code == 0, err
    url = f"http://127.0.0.1:{cli_home['apiServerPort']}"
    assert f"export ANTHROPIC_BASE_URL={url}\n" in out
    for name in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                 "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL"):
        assert f"export {name}=qwen\n" in out
    # Claude Code's window for a model it does not know; it takes no compact window
    # below 100,000 tokens (it warns, and compacts as if it were 100,000).
    assert "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=65536\n" in out
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in out
    assert "export CLAUDE_CODE_TOTAL_TOKENS_REMINDER=off\n" in out
    assert "export ANTHROPIC_AUTH_TOKEN=localrt\n" in out  # keys off: any token
    assert "unset ANTHROPIC_API_KEY\n" in out
    assert out.rstrip().endswith("claude -p hi")
    assert server.read_pid_file(cli_home) is None


def test_claude_codes_compact_window_is_the_context_from_its_minimum_on(tmp_path):
    def env(ctx_len):
        return CLIENTS["claude"].setup(Target("http://h:1", "m", ctx_len, "sk-1", tmp_path)).env

    assert env(131072)["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "131072"
    assert env(131072)["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "131072"
    assert env(100000)["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "100000"
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in env(99999)
    assert env(None).keys().isdisjoint({"CLAUDE_CODE_AUTO_COMPACT_WINDOW",
                                        "CLAUDE_CODE_MAX_CONTEXT_TOKENS"})  # remote: unknown
    assert env(8192)["ANTHROPIC_AUTH_TOKEN"] == "sk-1"  # keys on: the key


def _codex_config(out: str) -> dict:
    """The TOML that the `-c` options of a printed codex command line make."""
    words = shlex.split(next(line for line in out.splitlines() if line.startswith("codex ")))
    return tomllib.loads("\n".join(words[i + 1] for i, w in enumerate(words) if w == "-c"))


def test_codex_gets_a_responses_provider_on_its_command_line_and_the_key_by_name(cli_home):
    code, out, err = run("launch", "codex", "--print", "--model", "qwen", "--", "exec", "hi")
    assert code == 0, err
    url = f"http://127.0.0.1:{cli_home['apiServerPort']}/v1"
    assert _codex_config(out) == {
        "model_provider": "localrt", "model": "qwen", "model_context_window": 32768,
        "model_providers": {"localrt": {"name": "localrt", "base_url": url,
                                        "wire_api": "responses"}}}
    assert out.rstrip().endswith(" exec hi") and "LOCALRT_API_KEY" not in out
    cli_home.update({"apiKeys": ["sk-local"]})
    code, out, err = run("launch", "codex", "--print", "--model", "qwen")
    assert code == 0, err
    assert _codex_config(out)["model_providers"]["localrt"]["env_key"] == "LOCALRT_API_KEY"
    assert "export LOCALRT_API_KEY=sk-local\n" in out


def test_opencode_aider_and_llm_are_pointed_at_the_openai_routes(cli_home):
    url = f"http://127.0.0.1:{cli_home['apiServerPort']}/v1"
    code, out, err = run("launch", "opencode", "--print", "--model", "qwen")
    assert code == 0, err
    line = next(line for line in out.splitlines() if "OPENCODE_CONFIG_CONTENT=" in line)
    config = json.loads(shlex.split(line.split("=", 1)[1])[0])
    assert config["model"] == "localrt/qwen"
    provider = config["provider"]["localrt"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": url}
    assert provider["models"]["qwen"]["limit"]["context"] == 32768
    code, out, err = run("launch", "aider", "--print", "--model", "qwen")
    assert code == 0, err
    assert f"export OPENAI_API_BASE={url}\n" in out and "export AIDER_MODEL=openai/qwen\n" in out
    code, out, err = run("launch", "llm", "--print", "--model", "qwen")
    assert code == 0, err
    folder = cli_home.data_dir / "launch" / "llm"
    assert f"export LLM_USER_PATH={folder}\n" in out
    models = json.loads(out.split("extra-openai-models.yaml:\n")[1].split("\n#")[0])
    assert models == [{"model_id": "qwen", "model_name": "qwen", "api_base": url,
                       "api_key_name": "localrt", "can_stream": True, "supports_tools": True}]
    assert not folder.exists()  # --print writes nothing


# --- which model, and its context, with a server -------------------------------------------


def test_without_model_the_one_running_is_used_else_the_models_are_listed(thread_server,
                                                                           weights):
    code, out, err = run("launch", "claude", "--print")
    assert code == 2 and "localrt pull ID" in err
    for name in ("answer", "short"):
        add_model(thread_server.url, weights[name], name)
    code, out, err = run("launch", "claude", "--print")
    assert code == 2 and "give one with --model ID:\n  answer\n  short" in err
    status, reply = send(thread_server.url, "POST", "/v1/models/short/start",
                         {"ctx_len": 1024, "cpu_threads": 1})
    assert status == 200, reply
    code, out, err = run("launch", "claude", "--print")
    assert code == 0, err
    # It runs with 1,024 tokens; launch would restart it with all it was trained on.
    assert out.startswith("# Claude Code pointed at localrt: model short, ctx_len 2048\n")
    assert "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=2048\n" in out
    code, out, err = run("ps")  # --print started nothing: the model runs as it did
    assert "| 1024 " in out, out


def test_run_starts_a_model_with_a_context_that_holds_a_long_prompt(thread_server, weights):
    """`localrt run` too: a piped prompt longer than the stored ctx_len (4,096, as imported)
    holds starts the model with a longer one, within the 8,192 it was trained on."""
    add_model(thread_server.url, weights["long"], "long",
              stored={"cpu_threads": 1, "max_tokens": 2})
    prompt = "ab " * 5000  # 5,000 tokens: each " ab" is one of the vocabulary's
    code, out, err = run("run", "long", stdin=prompt)
    assert code == 0, err
    status, reply = send(thread_server.url, "GET", "/v1/models/status")
    options = {row["id"]: row["options"] for row in reply["data"]}["long"]
    assert options["ctx_len"] == 7168  # 15,000 bytes / 3 + 2,048 for the reply, rounded up
    status, reply = send(thread_server.url, "POST", "/v1/models/long/stop", {})
    assert status == 200, reply
    code, out, err = run("run", "long", "--ctx_len", "4096", stdin=prompt)  # as told
    assert code == 1 and "ctx_len" in err


# --- the real clients --------------------------------------------------------------------


@pytest.fixture(scope="module")
def agents():
    from support.agents import require_agents

    return require_agents()


def launch(home, agents, *argv, timeout=CLIENT_TIMEOUT):
    """`localrt launch ARGV` in a child process, as a user types it: (code, out, err)."""
    from support.agents import agent_env

    proc = subprocess.run([sys.executable, "-m", "localrt", "launch", *argv],
                          capture_output=True, text=True, timeout=timeout,
                          env=agent_env(home, agents), cwd=home, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_claude_code_prints_the_models_answer_through_launch(cli_home, home, agents,
                                                             weights):
    # The model runs with too short a context for Claude Code's prompt: launch restarts it.
    for command in (["models", "import", "--path", str(weights["answer"]), "--id", "answer"],
                    ["models", "update", "answer", "--cpu_threads", "1"],
                    ["models", "start", "answer", "--ctx_len", "4096"]):
        code, out, err = run(*command)
        assert code == 0, err
    code, out, err = launch(home, agents, "claude", "--model", "answer", "--", "-p", "Hello?")
    assert code == 0, err
    assert out.strip() == "".join(SCRIPT)
    assert "Model answer is running with ctx_len 4096; restarting it with 65536" in err
    assert "CLAUDE_CODE" not in err  # no setting of launch's was refused
    code, out, err = run("ps")
    assert "answer" in out and "| 65536 " in out, out
    # The client's own exit status comes back.
    code, out, err = launch(home, agents, "claude", "--", "--no-such-option")
    assert code == 1 and "unknown option" in err


@pytest.mark.slow
def test_codex_with_its_default_config_answers_and_runs_a_tool_loop(cli_home, home, agents,
                                                                    weights):
    for name in ("answer", "caller"):
        for command in (["models", "import", "--path", str(weights[name]), "--id", name],
                        ["models", "update", name, "--cpu_threads", "1"]):
            code, out, err = run(*command)
            assert code == 0, err
    code, out, err = launch(home, agents, "codex", "--model", "answer", "--",
                            "exec", "--skip-git-repo-check", "Hello?")
    assert code == 0, err
    assert out.strip() == "".join(SCRIPT)
    code, out, err = launch(home, agents, "codex", "--model", "caller", "--",
                            "exec", "--json", "--skip-git-repo-check", "Say hi with echo")
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    done = [e["item"] for e in events if e["type"] == "item.completed"]
    commands = [item for item in done if item["type"] == "command_execution"]
    assert len(commands) == 1, events
    assert commands[0]["exit_code"] == 0 and "hi-from-tool" in commands[0]["aggregated_output"]
    assert [item["text"] for item in done if item["type"] == "agent_message"] == [DONE]
