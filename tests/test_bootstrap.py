"""The bootstrap (README's two commands) runs the right commands, in a dry run or with a
recording stand-in for subprocess: nothing is installed or compiled here."""

import io
import subprocess
import sys

from support import REPO

from localrt.bootstrap import AMX_OFF, Host, build_env, compiler_accepts, main

AMX = " ".join(AMX_OFF)
VENV_PKG = "python3.%d-venv" % sys.version_info[1]


def host(**changes) -> Host:
    """A Debian x86-64 machine, as root, with every command and file, a compiler that
    knows AMX, and Python's ensurepip; `changes` overrides any of that."""
    answers = dict(arch="x86_64", euid=0, environ={"PATH": "/usr/bin"},
                   which=lambda cmd: f"/usr/bin/{cmd}", exists=lambda pattern: True,
                   find_spec=lambda name: object(),
                   accepts=lambda compiler, language, flags: True,
                   candidate=lambda package: True)
    answers.update(changes)
    return Host(**answers)


def dry_run(argv, **changes):
    out, err = io.StringIO(), io.StringIO()

    def call(*args, **kwargs):
        raise AssertionError("a dry run runs nothing")

    rc = main(["--dry-run"] + argv, stdout=out, stderr=err, call=call, host=host(**changes))
    commands = [line[2:] for line in out.getvalue().splitlines() if line.startswith("+ ")]
    return rc, commands, out.getvalue(), err.getvalue()


def test_x86_64_builds_without_amx_in_c_and_cxx():
    assert build_env({}, "x86_64", lambda *a: True) == {"CFLAGS": AMX, "CXXFLAGS": AMX}


def test_arm_and_others_get_no_flags():
    for arch in ("aarch64", "arm64", "ppc64le", "riscv64"):
        assert build_env({}, arch, lambda *a: True) == {}


def test_a_compiler_without_amx_gets_no_flags():
    # GCC 10 (Debian 11) does not know -mno-amx-*; it cannot emit AMX code either.
    assert build_env({}, "x86_64", lambda *a: False) == {}


def test_the_flags_follow_cc_cxx_and_keep_the_users_own():
    asked = []

    def accepts(compiler, language, flags):
        asked.append((compiler, language, tuple(flags)))
        return True

    environ = {"CC": "ccache gcc-12", "CFLAGS": "-O2", "CXXFLAGS": ""}
    assert build_env(environ, "x86_64", accepts) == {"CFLAGS": f"-O2 {AMX}",
                                                     "CXXFLAGS": AMX}
    assert asked == [("ccache gcc-12", "c", AMX_OFF), ("c++", "c++", AMX_OFF)]


def test_compiler_accepts_rejects_unknown_flags_and_missing_compilers():
    assert not compiler_accepts("cc", "c", ["-mno-such-flag-localrt"])
    assert not compiler_accepts("/nonexistent/cc", "c", [])


def test_install_then_start(tmp_path):
    venv = tmp_path / "venv"
    rc, commands, out, err = dry_run(["--venv", str(venv), "--", "--port", "0"])
    assert rc == 0 and err == ""
    assert commands == [
        f"{sys.executable} -m venv {venv}",
        f"{venv}/bin/python -m pip install --upgrade pip",
        f"CFLAGS='{AMX}' CXXFLAGS='{AMX}' {venv}/bin/python -m pip install --no-cache-dir .",
        f"{venv}/bin/localrt start --port 0",
    ]
    assert f'export PATH="{venv}/bin:$PATH"' in out


def test_test_installs_the_extras_and_engine_wheels_then_runs_pytest(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()  # an existing venv is reused
    rc, commands, out, err = dry_run(["--test", "--venv", str(venv), "--", "-x"],
                                     arch="aarch64")
    assert rc == 0
    assert commands == [
        f"{venv}/bin/python -m pip install --upgrade pip",
        f"{venv}/bin/python -m pip install --no-cache-dir '.[test]'",
        f"{venv}/bin/python -m pip download --only-binary=:all: -d tests/.engine-wheels "
        "onnxruntime-genai==0.18.0",
        f"{venv}/bin/python -m pip download --no-deps --no-binary=:all: -d "
        "tests/.rpc-build/sources llama-cpp-python==0.3.36",
        f"{venv}/bin/python -m pip download --only-binary=:all: -d tests/.rpc-build/sources "
        "scikit-build-core cmake ninja",
        f"{venv}/bin/python -m pip download --only-binary=:all: -d tests/.cuda-build/toolkit "
        "nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cublas nvidia-cuda-cccl",
        f"{venv}/bin/python -m pytest -x",
    ]


def test_missing_packages_come_from_apt_through_sudo(tmp_path):
    have = {"apt-get", "sudo", "chromium"}
    rc, commands, out, err = dry_run(
        ["--test", "--venv", str(tmp_path / "venv")], euid=1000,
        which=lambda cmd: f"/usr/bin/{cmd}" if cmd in have else None,
        find_spec=lambda name: None)
    assert rc == 0
    assert commands[:2] == [
        "sudo apt-get update -q",
        "sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "
        f"--no-install-recommends {VENV_PKG} build-essential groff-base chromium-driver "
        "tinyproxy nodejs npm glslc glslang-tools",
    ]


def test_test_installs_the_vulkan_loader_and_lavapipe_where_they_are_missing(tmp_path):
    rc, commands, out, err = dry_run(
        ["--test", "--venv", str(tmp_path / "venv")],
        exists=lambda pattern: "libvulkan" in pattern or "/include/" in pattern
        or "SPIRV" in pattern)
    assert rc == 0
    assert commands[1] == ("env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "
                           "--no-install-recommends mesa-vulkan-drivers")


def test_test_installs_what_the_vulkan_variant_compiles_with(tmp_path):
    # The headers, glslc and the SPIR-V headers (localrt.engines.builds.BUILD_NEEDS),
    # and glslang-tools, which the list names beside them.
    rc, commands, out, err = dry_run(
        ["--test", "--venv", str(tmp_path / "venv")],
        which=lambda cmd: None if cmd in ("glslc", "glslangValidator") else f"/usr/bin/{cmd}",
        exists=lambda pattern: "libvulkan" in pattern or "lvp_icd" in pattern)
    assert rc == 0
    assert commands[1] == ("env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "
                           "--no-install-recommends glslc glslang-tools libvulkan-dev "
                           "spirv-headers")
    rc, commands, out, err = dry_run(["--venv", str(tmp_path / "venv")],
                                     exists=lambda pattern: False)
    assert rc == 0 and "apt-get" not in out  # only --test needs them


def test_test_tools_apt_lacks_are_left_out_with_a_note(tmp_path):
    # Ubuntu has no chromium deb; the browser tests skip there.
    out, err = io.StringIO(), io.StringIO()
    calls = []

    def call(argv, **kwargs):
        calls.append(argv)
        return 5 if argv[-1] == "pytest" else 0

    rc = main(["--test", "--venv", str(tmp_path / "venv")], stdout=out, stderr=err, call=call,
              host=host(which=lambda cmd: "/usr/bin/apt-get" if cmd == "apt-get" else None,
                        candidate=lambda package: not package.startswith("chromium")))
    assert rc == 5  # pytest's exit code
    assert calls[1] == ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y",
                        "-q", "--no-install-recommends", "build-essential", "groff-base",
                        "tinyproxy", "nodejs", "npm", "glslc", "glslang-tools"]
    assert "apt has no chromium chromium-driver here" in err.getvalue()


def test_without_root_or_sudo_a_needed_package_stops_with_the_command_to_type(tmp_path):
    rc, commands, out, err = dry_run(
        ["--venv", str(tmp_path / "venv")], euid=1000,
        which=lambda cmd: "/usr/bin/apt-get" if cmd == "apt-get" else None)
    assert rc == 1 and commands == []
    assert "apt-get install build-essential" in err


def test_without_root_or_sudo_missing_test_tools_only_skip_their_tests(tmp_path):
    rc, commands, out, err = dry_run(
        ["--test", "--venv", str(tmp_path / "venv")], euid=1000,
        which=lambda cmd: None if cmd in ("sudo", "groff") else f"/usr/bin/{cmd}")
    assert rc == 0 and commands[-1].endswith("-m pytest")
    assert "groff-base cannot be installed here" in err


def test_a_failing_step_stops_the_rest_and_the_flags_reach_only_the_build(tmp_path):
    seen = []

    def call(argv, cwd, env):
        seen.append((argv, cwd, env))
        return 3 if "download" in argv else 0

    rc = main(["--test", "--venv", str(tmp_path / "venv")], stdout=io.StringIO(),
              stderr=io.StringIO(), call=call, host=host())
    assert rc == 3
    assert [argv[2:4] for argv, _, _ in seen] == [["venv", str(tmp_path / "venv")],
                                                  ["pip", "install"], ["pip", "install"],
                                                  ["pip", "download"]]
    assert {cwd for _, cwd, _ in seen} == {str(REPO)}
    assert [env.get("CFLAGS") for _, _, env in seen] == [None, None, AMX, None]
    assert all(env["PATH"] == "/usr/bin" for _, _, env in seen)


def test_the_bootstrap_needs_only_the_standard_library():
    # -S: no site-packages, as on a machine where nothing is installed yet.
    code = "import localrt.bootstrap, sys; print(sys.modules['localrt.bootstrap'].ROOT)"
    out = subprocess.run([sys.executable, "-S", "-E", "-c", code], cwd=str(REPO),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(REPO)

