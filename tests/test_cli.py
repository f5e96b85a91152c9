"""The CLI through main([...]) in process, against real servers on free ports."""

import io
import json
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
import yaml
from support import REPO
from support.cli import run
from support.servers import run_foreground_server, subprocess_env

from localrt import server
from localrt.cli import ExitCode, build_parser, main

pytestmark = pytest.mark.live


def assert_port_free(port):
    """A new server could bind it (TIME_WAIT allowed, as for any server with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def get_json(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_help_on_every_command():
    code, out, err = run("--help")
    assert code == 0 and "start" in out and "config" in out
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in sub.choices:
        code, out, _ = run(name, "-h")
        assert code == 0 and out.startswith("usage: localrt " + name)


def test_no_command_prints_help():
    code, out, _ = run()
    assert code == 0 and "usage:" in out


def test_python_m_localrt_is_the_same_program(home):
    _, in_process, _ = run("--help")
    proc = subprocess.run([sys.executable, "-m", "localrt", "--help"], capture_output=True,
                          text=True, env=subprocess_env(home), cwd=str(REPO))
    assert proc.returncode == 0
    assert proc.stdout == in_process
    proc = subprocess.run([sys.executable, "-m", "localrt", "config", "--cors", "maybe"],
                          capture_output=True, text=True, env=subprocess_env(home))
    assert proc.returncode == 2


def test_invalid_on_off_is_a_usage_error_and_sends_nothing(thread_server):
    code, out, err = run("config", "--cors", "maybe")
    assert code == ExitCode.USAGE == 2
    assert "expected on or off" in err and "maybe" in err
    assert thread_server.calls == []


@pytest.mark.parametrize("argv", [["start", "--port", "70000"], ["start", "--port", "x"],
                                  ["config", "--verify_peer_ssl", "yes please"]])
def test_other_usage_errors(home, argv):
    assert run(*argv)[0] == 2


def test_config_status_table(thread_server):
    code, out, err = run("config", "status")
    assert code == 0, err
    lines = out.splitlines()
    assert "Config name" in lines[1] and "Value" in lines[1]
    origins = [line for line in lines if line.startswith("| allowed_origins ")]
    assert len(origins) == 3
    assert f"http://127.0.0.1:{thread_server.port}" in origins[1]
    for name in ("cors", "no_proxy", "proxy_password", "verify_proxy_ssl", "modelhub_token"):
        assert any(line.startswith(f"| {name} ") for line in lines), name
    assert any("| cors" in line and "true" in line for line in lines)


def test_config_status_hides_credentials_in_the_proxy_url(thread_server):
    code, out, err = run("config", "--proxy_url", "http://me:s3cr3t@proxy.lan:3128")
    assert code == 0, err
    code, out, err = run("config", "status")
    assert "s3cr3t" not in out and "http://***@proxy.lan:3128" in out


def test_config_sets_many_fields_with_one_patch(thread_server):
    code, out, err = run("config", "--cors", "off", "--allowed_origins", "http://a:1,http://b:2",
                         "--proxy_url", "http://proxy:3128", "--proxy_username", "me",
                         "--proxy_password", "pw", "--no_proxy", "x,y",
                         "--verify_proxy_ssl", "off", "--verify_proxy_host_ssl", "off",
                         "--verify_peer_ssl", "off", "--verify_host_ssl", "on",
                         "--modelhub_token", "hf_x")
    assert code == 0, err
    assert out.strip() == "Configuration updated successfully!"
    assert [c for c in thread_server.calls if c[0] == "PATCH"] == [("PATCH", "/v1/configs")]
    assert len(thread_server.calls) == 1
    config = get_json(thread_server.url + "/v1/configs")
    assert config["cors"] is False and config["allowed_origins"] == ["http://a:1", "http://b:2"]
    assert config["proxy_url"] == "http://proxy:3128" and config["modelhub_token"] == "hf_x"
    assert config["verify_host_ssl"] is True and config["verify_peer_ssl"] is False


def test_config_flags_are_the_schema():
    from localrt import schemas
    from localrt.cli.flags import config_options
    from localrt.config import FIELDS

    flags = [flag[2:] for flag, _ in config_options()]
    assert flags == list(schemas.load("config-update.json")["properties"])
    assert set(flags) == set(FIELDS)


def test_server_error_is_one_line_on_stderr(thread_server):
    # The schema's pattern lets the port through; only the server reads it as a number.
    code, out, err = run("config", "--proxy_url", "http://proxy:99999")
    assert code == ExitCode.ERROR
    assert err.count("\n") == 1 and "proxy_url" in err and out == ""


@pytest.mark.parametrize("flag, value", [("--allowed_origins", "http://a b"),
                                         ("--allowed_origins", "http://a:1,not-an-origin"),
                                         ("--proxy_url", "ftp://proxy"),
                                         ("--modelhub_token", "has space")])
def test_a_value_the_schema_refuses_is_a_usage_error_and_nothing_is_sent(thread_server, flag,
                                                                         value):
    """localrt(1): an invalid value is a usage error (exit 2) and nothing is sent."""
    code, out, err = run("config", flag, value)
    assert code == ExitCode.USAGE and flag in err and out == ""
    assert thread_server.calls == []
    assert "has space" not in err  # a secret is never echoed


def test_start_status_stop_lifecycle(cli_home):
    port = cli_home["apiServerPort"]
    code, out, err = run("start")
    assert code == 0, err
    assert out.strip() == f"Server started at http://127.0.0.1:{port}"
    assert get_json(f"http://127.0.0.1:{port}/healthz")["status"] == "ok"
    pid = server.read_pid_file(cli_home).pid

    code, out, _ = run("start")
    assert code == 0 and "already running" in out

    code, out, _ = run("stop")
    assert code == 0 and out.strip() == "Server stopped"
    assert not server.pid_alive(pid)
    assert not (cli_home.data_dir / "localrt.pid").exists()
    assert_port_free(port)

    code, out, _ = run("stop")
    assert code == 0 and out.strip() == "Server is not running"
    log = (cli_home.log_dir / "localrt.log").read_text()
    assert "serving on" in log and "localrt stopped" in log


def test_start_on_port_zero_is_found_by_later_commands(cli_home):
    code, out, err = run("start", "--port", "0")
    assert code == 0, err
    address = server.read_pid_file(cli_home)
    assert out.strip() == f"Server started at {address.url}"
    code, out, err = run("config", "status")
    assert code == 0 and "The localrt server was not running" not in err
    assert run("stop")[0] == 0


def test_start_when_port_is_taken(cli_home):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, out, err = run("start", "--port", str(port))
        assert code == ExitCode.UNAVAILABLE
        assert "in use" in err and str(port) in err
        assert not (cli_home.data_dir / "localrt.pid").exists()
        code, _, err = run("start", "--foreground", "--port", str(port))
        assert code == ExitCode.UNAVAILABLE and "in use" in err
        assert not (cli_home.data_dir / "localrt.pid").exists()


def test_command_that_needs_the_server_starts_it(cli_home):
    code, out, err = run("config", "status")
    assert code == 0
    port = cli_home["apiServerPort"]
    assert err.strip() == (f"The localrt server was not running; started it at "
                           f"http://127.0.0.1:{port}")
    assert "Config name" in out
    assert server.read_pid_file(cli_home) is not None


def test_corrupt_rc_refuses_to_start_and_is_left_alone(home):
    rc = home / ".localrtrc"
    text = "apiServerPort: 4000\ncors: {oops\n"
    rc.write_text(text)
    for argv in (["start"], ["start", "--foreground"], ["config", "status"]):
        code, out, err = run(*argv)
        assert code == ExitCode.SETTINGS
        assert str(rc) + ":" in err
    assert rc.read_text() == text


def test_foreground_server_stops_cleanly_on_sigterm(home):
    srv = run_foreground_server(home)
    assert srv.stop(signal.SIGTERM) == 0
    assert not (srv.settings.data_dir / "localrt.pid").exists()
    assert_port_free(srv.port)


def test_stop_over_http_answers_then_exits(home):
    srv = run_foreground_server(home)
    req = urllib.request.Request(srv.url + "/v1/system", method="DELETE")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert json.loads(r.read())["message"] == "Server is shutting down"
    assert srv.process.wait(timeout=10) == 0
    srv.process.stdout.close()
    srv.process.stderr.close()


def test_config_change_persists_across_restart(cli_home):
    assert run("config", "--proxy_username", "alice")[0] == 0
    assert run("stop")[0] == 0
    assert yaml.safe_load(cli_home.path.read_text())["proxyUsername"] == "alice"
    code, out, _ = run("config", "status")
    assert code == 0 and any("alice" in line for line in out.splitlines())


def test_run_starts_the_server_too(cli_home, quantized):
    code, _, err = run("models", "import", "--path", str(quantized["Q8_0"]), "--id", "tiny")
    assert code == ExitCode.OK, err
    assert run("stop")[0] == ExitCode.OK
    out, err = io.StringIO(), io.StringIO()
    code = main(["run", "tiny", "--cpu_threads", "1"], stdout=out, stderr=err,
                stdin=io.StringIO("/exit\n"))
    assert code == ExitCode.OK, err.getvalue()
    assert "The localrt server was not running; started it" in err.getvalue()
    assert "Model tiny started successfully" in err.getvalue()
