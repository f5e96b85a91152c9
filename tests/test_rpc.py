"""llama.cpp RPC: a gguf-cpp model split across rpc-server hosts (localrt.engines.rpc).

The checks before a model loads run here on the build that ships with localrt (it has
no RPC backend). The model split across two real rpc-servers is test_rpc_live.py's.
"""

from __future__ import annotations

import pytest
from support.apps import bind, call

from localrt.engines import rpc
from localrt.engines.catalog import RPC_SUFFIX
from localrt.errors import HTTPError


def test_parse_servers_takes_llama_cpps_rpc_list():
    assert rpc.parse_servers("127.0.0.1:50052,gpu1:1") == [("127.0.0.1", 50052), ("gpu1", 1)]
    for bad, why in (("gpu1", "not host:port"), (":1", "not host:port"),
                     ("gpu1:0", "from 1 to 65535"), ("gpu1:65536", "from 1 to 65535"),
                     ("[::1]:50052", "IPv6"), ("fe80::1:50052", "IPv6"),
                     ("a:1,a:1", "named twice")):
        with pytest.raises(ValueError, match=why):
            rpc.parse_servers(bad)


def test_only_loopback_and_trusted_hosts_are_used():
    resolve = {"gpu1": ["10.1.2.3"], "both": ["10.1.2.3", "192.168.0.9"],
               "localhost": ["127.0.0.1", "::1"]}.__getitem__

    def untrusted(text, trusted=()):
        found = rpc.untrusted_host(rpc.parse_servers(text), trusted, resolve)
        return found and found[0]

    assert untrusted("127.0.0.1:1,127.5.5.5:2,localhost:3") is None
    assert untrusted("127.0.0.1:1,10.1.2.3:2") == "10.1.2.3"
    assert untrusted("gpu1:1") == "gpu1"
    assert untrusted("gpu1:1", ["gpu1"]) is None            # listed by name
    assert untrusted("GPU1.:1", ["gpu1"]) is None           # names compare as DNS does
    assert untrusted("gpu1:1", ["10.0.0.0/8"]) is None      # every address in a range
    assert untrusted("both:1", ["10.0.0.0/8"]) == "both"    # one address outside it
    assert untrusted("10.1.2.3:1", ["10.1.2.3"]) is None
    assert untrusted("10.1.2.4:1", ["10.1.2.3"]) == "10.1.2.4"
    _, why = rpc.untrusted_host([("gpu1", 1)], [], resolve)
    assert "rpcTrustedHosts" in why and "no authentication" in why


def test_a_host_that_does_not_resolve_is_refused_with_its_name():
    def resolve(host):
        raise OSError(-2, "Name or service not known")

    host, why = rpc.untrusted_host([("nowhere", 1)], [], resolve)
    assert host == "nowhere" and "cannot be resolved" in why


def test_rpcTrustedHosts_is_a_setting_of_hosts_and_cidr_ranges(settings):
    assert settings["rpcTrustedHosts"] == []
    assert settings.update({"rpcTrustedHosts": ["gpu1", "10.0.0.0/8"]})[
        "rpcTrustedHosts"] == ["gpu1", "10.0.0.0/8"]
    for bad in ("gpu1", ["10.0.0.0/33"], ["two words"], [3]):
        with pytest.raises(ValueError):
            settings.update({"rpcTrustedHosts": bad})


def test_a_build_without_rpc_is_a_400_that_names_the_variant_to_install(api, tiny):
    builtin = api("GET", "/v1/engines/gguf-cpp").json
    active = next(v for v in builtin if v["status"] == "Ready")["name"]
    r = api("POST", "/v1/models/tiny/start", {"rpc_servers": "127.0.0.1:50052"})
    assert r.status == 400 and r.json["error"]["param"] == "rpc_servers", r.body
    wanted = active + RPC_SUFFIX
    assert f"localrt engines install gguf-cpp --variant {wanted}" in r.json["message"]
    assert "has no RPC backend" in r.json["message"]
    assert api("GET", "/v1/models/status").json["data"] == []


def test_a_host_that_is_not_loopback_is_a_400_naming_it(api, tiny, settings):
    r = api("POST", "/v1/models/tiny/start", {"rpc_servers": "127.0.0.1:1,10.9.8.7:50052"})
    assert r.status == 400 and r.json["error"]["param"] == "rpc_servers", r.body
    assert "10.9.8.7 is not loopback and not in rpcTrustedHosts" in r.json["message"]
    # Trusted, it passes that check and meets the next one: this build has no RPC.
    settings.update({"rpcTrustedHosts": ["10.0.0.0/8"]})
    r = api("POST", "/v1/models/tiny/start", {"rpc_servers": "127.0.0.1:1,10.9.8.7:50052"})
    assert r.status == 400 and "has no RPC backend" in r.json["message"], r.body


@pytest.mark.parametrize("body, why", [
    ({"rpc_servers": "127.0.0.1"}, "host:port"),
    ({"rpc_servers": "127.0.0.1:1, 127.0.0.1:2"}, "host:port"),
    ({"rpc_servers": "127.0.0.1:99999"}, "from 1 to 65535"),
    ({"rpc_servers": "127.0.0.1:1", "embedding": True}, "on this machine only"),
])
def test_a_malformed_list_is_a_400(api, tiny, body, why):
    r = api("POST", "/v1/models/tiny/start", body)
    assert r.status == 400 and r.json["error"]["param"] == "rpc_servers", r.body
    assert why in r.json["message"]


def test_a_stored_rpc_servers_that_the_build_cannot_take_is_a_409(api, tiny):
    r = api("PATCH", "/v1/models/tiny", {"rpc_servers": "127.0.0.1:50052"})
    assert r.status == 200 and r.json["model"]["rpc_servers"] == "127.0.0.1:50052", r.body
    r = api("POST", "/v1/models/tiny/start")
    assert r.status == 409 and r.json["error"]["param"] == "rpc_servers", r.body
    assert "models update tiny --rpc_servers" in r.json["message"]


def test_onnx_runtime_cannot_split_a_model(app):
    problems = app.services.engines.check_options("onnx-runtime",
                                                  {"rpc_servers": "127.0.0.1:1"})
    assert problems == [("rpc_servers",
                         "engine onnx-runtime cannot split a model across rpc-server hosts")]


def test_an_unreachable_server_is_a_502_naming_it(tmp_path):
    # The builtin build has no RPC backend: the preflight child says so, and names the
    # first server. (The real failures are test_rpc_live.py's.)
    with pytest.raises(HTTPError) as caught:
        rpc.preflight(["127.0.0.1:1"], None)
    assert caught.value.status == 502 and caught.value.code == "rpc_server_error"
    assert "127.0.0.1:1" in caught.value.message
    assert "no RPC backend" in caught.value.message


# --- building a variant from an sdist (the real compile is test_rpc_live.py's) --------


def test_the_build_progress_comes_from_pips_and_ninjas_lines():
    from localrt.engines.builds import _progress

    progress = {"stage": "start", "step": 0, "steps": 0, "line": ""}
    seen = []
    for line in ("  Installing build dependencies: started",
                 "  Collecting scikit-build-core[pyproject]>=0.9.2",
                 "  Preparing metadata (pyproject.toml): started",
                 "  *** Configuring CMake...",
                 "  -- The C compiler identification is GNU 12.2.0",
                 "  *** Building project with Ninja...",
                 "  [12/197] /usr/bin/gcc -DGGML_USE_RPC -O3 -c ggml.c -o ggml/src/ggml.c.o",
                 "  [13/197] : && /usr/bin/cmake -E cmake_symlink_library bin/libggml.so",
                 "  *** Installing project into wheel...",
                 "  *** Making wheel..."):
        if _progress(progress, line):
            seen.append(dict(progress))
    assert [s["stage"] for s in seen] == ["requirements", "metadata", "configure", "compile",
                                          "compile", "compile", "install", "wheel"]
    assert seen[4] == {"stage": "compile", "step": 12, "steps": 197,
                       "line": "[12/197] ggml.c.o"}
    assert seen[5]["step"] == 13 and seen[5]["line"].startswith("[13/197] : && /usr/bin")


FAILING_BACKEND = '''
import os


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = os.path.join(metadata_directory, "llama_cpp_python-9.9.9.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\\nName: llama_cpp_python\\nVersion: 9.9.9\\n")
    return "llama_cpp_python-9.9.9.dist-info"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    print("*** Configuring CMake...", flush=True)
    print("CMAKE_ARGS=" + os.environ.get("CMAKE_ARGS", ""), flush=True)
    print("CFLAGS=" + os.environ.get("CFLAGS", ""), flush=True)
    print("[1/2] cc -c ggml.c -o ggml.c.o", flush=True)
    raise SystemExit("ggml.c:1:1: error: this sdist does not build")
'''


def write_sdist(folder, version="9.9.9"):
    """A llama-cpp-python sdist whose in-tree build backend fails as a compile does."""
    import io
    import tarfile

    top = f"llama_cpp_python-{version}"
    files = {"pyproject.toml": ('[build-system]\nrequires = []\nbuild-backend = '
                                '"failing_backend"\nbackend-path = ["."]\n\n[project]\n'
                                f'name = "llama_cpp_python"\nversion = "{version}"\n'),
             "failing_backend.py": FAILING_BACKEND,
             "PKG-INFO": f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n"}
    path = folder / f"{top}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.live
def test_a_build_that_fails_fails_its_task_with_the_end_of_its_output(settings, tmp_path):
    import shutil

    from support.tasks import wait_task
    from localrt.app import create_app
    from localrt.engines.hardware import detect_hardware
    from emulators.pkgindex import PackageIndex

    if shutil.which("cc") is None or shutil.which("c++") is None:
        pytest.skip("no C/C++ compiler: the install refuses to build (a 400)")
    hw = detect_hardware()
    if hw.cpu_level() is None:
        pytest.skip("no CPU level variant runs here")
    variant = f"{hw.platform}-{hw.cpu_level()}{RPC_SUFFIX}"
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    write_sdist(index_dir)
    with PackageIndex(index_dir) as index:
        settings.update({"engineIndexUrl": index.url})
        app = create_app(settings)
        try:
            api = bind(app)
            r = api("POST", "/v1/engines/gguf-cpp/install", {"variant": variant})
            assert r.status == 200, r.body
            assert "localrt compiles llama_cpp_python-9.9.9.tar.gz" in r.json["note"]
            task = wait_task(api, r.json["task"]["id"], timeout=120)
        finally:
            app.close()
    assert task["status"] == "Error", task
    assert "Building gguf-cpp " + variant + " v9.9.9 from llama_cpp_python-9.9.9.tar.gz " \
        "failed" in task["error"]
    assert "error: this sdist does not build" in task["error"]
    assert "-DGGML_RPC=ON" in task["error"]  # the flags reached the build
    if hw.arch == "amd64":
        assert "-mno-amx-tile" in task["error"]
    assert task["build"]["stage"] == "compile" and task["build"]["step"] == 1
    engines = settings.data_dir / "engines"
    assert not list((engines / ".builds").rglob("*.whl"))
    assert not list((engines / ".builds").rglob(".*.partial"))
    assert not (engines / "gguf-cpp" / variant).exists()


@pytest.mark.live
def test_an_index_with_neither_wheel_nor_sdist_is_a_400(settings, tmp_path):
    from localrt.app import create_app
    from localrt.engines.hardware import detect_hardware
    from emulators.pkgindex import PackageIndex

    hw = detect_hardware()
    if hw.cpu_level() is None:
        pytest.skip("no CPU level variant runs here")
    variant = f"{hw.platform}-{hw.cpu_level()}{RPC_SUFFIX}"
    (tmp_path / "index").mkdir()
    with PackageIndex(tmp_path / "index") as index:
        settings.update({"engineIndexUrl": index.url})
        app = create_app(settings)
        try:
            r = call(app, "POST", "/v1/engines/gguf-cpp/install", {"variant": variant})
        finally:
            app.close()
    assert r.status == 400 and r.json["error"]["param"] == "variant", r.body
    assert "nor an sdist to build it from" in r.json["message"]
