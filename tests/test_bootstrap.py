"""The bootstrap (README's two commands) runs the right commands, in a dry run or with a
recording stand-in for subprocess: nothing is installed or compiled here."""

import io
import os
import subprocess
import sys
from pathlib import Path

from support import REPO

from localrt.bootstrap import (AMX_OFF, NO_COMMON, Host, build_env, cache_folder,
                               compiler_accepts, lean_cmake_args, main, restore_test_caches,
                               save_test_caches)

AMX = " ".join(AMX_OFF)
LEAN = f"CMAKE_ARGS=-DCMAKE_PROJECT_llama.cpp_INCLUDE={NO_COMMON}"
VENV_PKG = "python3.%d-venv" % sys.version_info[1]


def host(**changes) -> Host:
    """A Debian x86-64 machine, as root, with every command and file, a compiler that
    knows AMX, and Python's ensurepip, and the test caches off (LOCALRT_TEST_CACHE: no
    test reads or writes the real home's); `changes` overrides any of that."""
    answers = dict(arch="x86_64", euid=0, environ={"PATH": "/usr/bin",
                                                   "LOCALRT_TEST_CACHE": "off"},
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


def test_llama_cpp_python_builds_leave_llama_cpps_common_library_out():
    # llama-cpp-python forces LLAMA_BUILD_COMMON on; the include, run after llama.cpp's
    # project(), turns it off (the wheel never loads libllama-common).
    assert NO_COMMON.is_file() and "set(LLAMA_BUILD_COMMON OFF" in NO_COMMON.read_text()
    include = f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={NO_COMMON}"
    assert lean_cmake_args({}) == {"CMAKE_ARGS": include}
    # the user's own CMAKE_ARGS come first, on every machine
    assert lean_cmake_args({"CMAKE_ARGS": "-DGGML_BLAS=ON"}) == {
        "CMAKE_ARGS": f"-DGGML_BLAS=ON {include}"}


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
        f"CFLAGS='{AMX}' CXXFLAGS='{AMX}' {LEAN} {venv}/bin/python -m pip install "
        f"--no-cache-dir .",
        f"{venv}/bin/localrt start --port 0",
    ]
    assert f'export PATH="{venv}/bin:$PATH"' in out


def expected_downloads(venv) -> list:
    """The downloads `--test` makes before pytest, in order: the onnx-runtime wheel, the
    llama-cpp-python sdist and its build wheels, the CUDA toolkit."""
    return [
        f"{venv}/bin/python -m pip download --only-binary=:all: -d tests/.engine-wheels "
        "onnxruntime-genai==0.18.0",
        f"{venv}/bin/python -m pip download --no-deps --no-binary=:all: -d "
        "tests/.rpc-build/sources llama-cpp-python==0.3.36",
        f"{venv}/bin/python -m pip download --only-binary=:all: -d tests/.rpc-build/sources "
        "scikit-build-core cmake ninja",
        f"{venv}/bin/python -m pip download --only-binary=:all: -d tests/.cuda-build/toolkit "
        "nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cublas nvidia-cuda-cccl",
    ]


def test_test_installs_the_extras_and_engine_wheels_then_runs_pytest(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()  # an existing venv is reused
    rc, commands, out, err = dry_run(["--test", "--venv", str(venv), "--", "-x"],
                                     arch="aarch64")
    assert rc == 0
    assert commands == [
        f"{venv}/bin/python -m pip install --upgrade pip",
        f"{LEAN} {venv}/bin/python -m pip install --no-cache-dir '.[test]'",
        *expected_downloads(venv),
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


# --- the test caches kept between runs (LOCALRT_TEST_CACHE) --------------------------

CACHED = ["tests/.rpc-build/built", "tests/.vulkan-build/built", "tests/.cuda-build/toolkit"]


def test_test_restores_the_caches_before_the_downloads_and_saves_them_after_pytest(tmp_path):
    venv = tmp_path / "venv"
    rc, commands, out, err = dry_run(["--test", "--venv", str(venv), "--", "-x"],
                                     environ={"PATH": "/usr/bin", "HOME": "/home/ci"})
    assert rc == 0
    assert commands[3:] == [
        "restore test caches from /home/ci/.cache/localrt-tests",
        *expected_downloads(venv),
        f"{venv}/bin/python -m pytest -x",
        "save test caches to /home/ci/.cache/localrt-tests",
    ]
    # Only --test has them.
    rc, commands, out, err = dry_run(["--venv", str(venv)],
                                     environ={"PATH": "/usr/bin", "HOME": "/home/ci"})
    assert rc == 0 and "test caches" not in out


def test_the_cache_folder_follows_xdg_cache_home_and_localrt_test_cache():
    assert cache_folder({"HOME": "/home/ci"}) == Path("/home/ci/.cache/localrt-tests")
    assert cache_folder({"HOME": "/home/ci", "XDG_CACHE_HOME": "/var/cache/ci"}) == \
        Path("/var/cache/ci/localrt-tests")
    assert cache_folder({"HOME": "/home/ci", "XDG_CACHE_HOME": "/var/cache/ci",
                           "LOCALRT_TEST_CACHE": "/srv/keep"}) == Path("/srv/keep")
    for off in ("off", "", "0", "no"):
        assert cache_folder({"HOME": "/home/ci", "LOCALRT_TEST_CACHE": off}) is None
    rc, commands, out, err = dry_run(["--test", "--venv", "/tmp/v"],
                                     environ={"PATH": "/usr/bin", "LOCALRT_TEST_CACHE": "off"})
    assert rc == 0 and "test caches" not in out


def write(path: Path, text: str, mtime: int = 1_700_000_000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))
    return path


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_restore_copies_what_the_checkout_lacks_and_keeps_its_own(tmp_path):
    cache, root = tmp_path / "cache", tmp_path / "clone"
    write(cache / CACHED[0] / "k1" / "a.whl", "rpc wheel")
    write(cache / CACHED[2] / "nvcc.whl", "toolkit")
    write(root / CACHED[2] / "nvcc.whl", "the checkout's own")
    out = io.StringIO()
    restore_test_caches(cache, root, out)
    assert tree(root / "tests") == {".rpc-build/built/k1/a.whl": "rpc wheel",
                                    ".cuda-build/toolkit/nvcc.whl": "the checkout's own"}
    assert (root / CACHED[0] / "k1" / "a.whl").stat().st_mtime == 1_700_000_000
    assert f"{CACHED[0]}: 1 file(s) from {cache / CACHED[0]}" in out.getvalue()
    assert not list(root.rglob(".partial-*"))
    restore_test_caches(tmp_path / "nothing-yet", root, io.StringIO())  # a fresh machine


def test_save_mirrors_the_checkouts_folders_and_copies_only_what_changed(tmp_path):
    cache, root = tmp_path / "cache", tmp_path / "clone"
    kept = write(cache / CACHED[1] / "k1" / "v.whl", "vulkan, key 1")
    same = write(cache / CACHED[2] / "nvcc.whl", "toolkit")
    write(cache / CACHED[0] / "k1" / "a.whl", "rpc, kept while the checkout has no folder")
    write(root / CACHED[1] / "k2" / "v.whl", "vulkan, key 2")  # the build's new key
    write(root / CACHED[2] / "nvcc.whl", "toolkit")
    write(root / CACHED[2] / "cccl.whl", "cccl")
    inode = same.stat().st_ino
    save_test_caches(root, cache, io.StringIO())
    assert tree(cache / "tests") == {
        ".rpc-build/built/k1/a.whl": "rpc, kept while the checkout has no folder",
        ".vulkan-build/built/k2/v.whl": "vulkan, key 2",
        ".cuda-build/toolkit/nvcc.whl": "toolkit", ".cuda-build/toolkit/cccl.whl": "cccl"}
    assert not kept.parent.exists()  # the stale key's folder went with its wheel
    assert same.stat().st_ino == inode  # unchanged: not copied again
    assert not list(cache.rglob(".partial-*"))
    # A changed file of the same name is replaced whole.
    write(root / CACHED[2] / "nvcc.whl", "toolkit, rebuilt", mtime=1_800_000_000)
    save_test_caches(root, cache, io.StringIO())
    assert (cache / CACHED[2] / "nvcc.whl").read_text() == "toolkit, rebuilt"


def test_a_failing_pytest_still_saves_and_a_broken_cache_is_only_a_note(tmp_path, monkeypatch):
    # A real run, its commands recorded: the checkout is a temporary folder.
    import localrt.bootstrap as bootstrap

    root, cache = tmp_path / "clone", tmp_path / "cache"
    monkeypatch.setattr(bootstrap, "ROOT", root)
    write(root / CACHED[1] / "k1" / "v.whl", "vulkan")
    calls = []

    def call(argv, **kwargs):
        calls.append(argv)
        return 1 if argv[1:3] == ["-m", "pytest"] else 0

    out, err = io.StringIO(), io.StringIO()
    rc = main(["--test", "--venv", str(tmp_path / "venv")], stdout=out, stderr=err,
              call=call, host=host(environ={"PATH": "/usr/bin",
                                            "LOCALRT_TEST_CACHE": str(cache)}))
    assert rc == 1 and calls[-1][1:3] == ["-m", "pytest"]
    assert tree(cache / "tests") == {".vulkan-build/built/k1/v.whl": "vulkan"}
    # A cache that cannot be written (a file where its folder should be): a note.
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    err = io.StringIO()
    rc = main(["--test", "--venv", str(tmp_path / "venv")], stdout=io.StringIO(),
              stderr=err, call=lambda argv, **kwargs: 0,
              host=host(environ={"PATH": "/usr/bin", "LOCALRT_TEST_CACHE": str(blocked)}))
    assert rc == 0
    assert f"note: save test caches to {blocked} failed" in err.getvalue()


def test_the_bootstrap_needs_only_the_standard_library():
    # -S: no site-packages, as on a machine where nothing is installed yet.
    code = "import localrt.bootstrap, sys; print(sys.modules['localrt.bootstrap'].ROOT)"
    out = subprocess.run([sys.executable, "-S", "-E", "-c", code], cwd=str(REPO),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(REPO)



def test_a_kept_wheel_is_taken_only_under_the_key_of_its_sdist_flags_and_patches(tmp_path):
    # The other half of the cache: what the tests take from tests/.*-build/built.
    from dataclasses import replace

    from support.variants import keep_wheel, key, kept_wheel

    from localrt.engines.catalog import VULKAN_CMAKE, VULKAN_PATCHES, Variant

    sdist = write(tmp_path / "llama_cpp_python-0.3.36.tar.gz", "an sdist")
    other = write(tmp_path / "other" / "llama_cpp_python-0.3.36.tar.gz", "another sdist")
    vulkan = Variant("linux-amd64-vulkan", "llama-cpp-python", "vulkan", "vulkan",
                     cmake=VULKAN_CMAKE, patches=VULKAN_PATCHES)
    keys = {key(vulkan, sdist), key(vulkan, other), key(replace(vulkan, patches=()), sdist),
            key(replace(vulkan, cmake=VULKAN_CMAKE + ("-DGGML_VULKAN_DEBUG=ON",)), sdist)}
    assert len(keys) == 4 and key(vulkan, sdist) == key(vulkan, sdist)
    built, name = tmp_path / "built", "llama_cpp_python-0.3.36+vulkan-py3-none-linux_x86_64.whl"
    write(built / name, "kept before there were keys")
    write(built / key(vulkan, other) / name, "built from another sdist")
    rpc = write(built / "k" / "llama_cpp_python-0.3.36+avx2.rpc-py3-none-linux_x86_64.whl",
                "another variant's")
    assert kept_wheel(built, key(vulkan, sdist), "0.3.36", "vulkan") is None  # so: compile
    made = write(tmp_path / "made" / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl",
                 "built now")
    kept = keep_wheel(built, key(vulkan, sdist), made, name, "vulkan")
    assert kept_wheel(built, key(vulkan, sdist), "0.3.36", "vulkan") == kept
    assert tree(built) == {f"{key(vulkan, sdist)}/{name}": "built now",
                           str(rpc.relative_to(built)): "another variant's"}
