"""Engines: the catalog and variants, the gguf-cpp probe, installs from a package index
emulator serving the real onnxruntime-genai wheels, custom engine wheels, and loading
real models (quantized GGUF through llama.cpp, a generated ONNX model, the echo engine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from emulators.enginepkg import build_wheel, write_echo_model
from emulators.onnxgen import write_onnx_model
from emulators.pkgindex import PackageIndex
from support.apps import bind, call
from support.tasks import wait_bytes, wait_task

from localrt.engines import catalog as engines_mod
from localrt.engines import probe as probe_mod
from localrt.app import create_app
from localrt.engines.catalog import Variant
from localrt.engines.hardware import Hardware, detect_hardware, recommended, runnable
from localrt.engines.probe import gguf_variant

AVX512 = frozenset({"avx", "avx2", "avx512f", "fma"})
HW = Hardware("linux", "amd64", "test cpu", AVX512)


# --- the machine and the catalog ---------------------------------------------------


def test_detect_hardware_reads_cpu_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx avx2 sse\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    hw = detect_hardware(cpuinfo)
    assert hw.cpu_model == "Some CPU"
    assert hw.cpu_flags == {"fpu", "avx", "avx2", "sse"}
    assert hw.cpu_level() == "avx2"


def test_variants_this_machine_cannot_run_say_why():
    avx2_only = Hardware("linux", "amd64", "", frozenset({"avx", "avx2"}))
    assert runnable(Variant("linux-amd64-avx2", "x", "avx2", "avx2"), avx2_only) is None
    assert "avx512f" in runnable(Variant("linux-amd64-avx512", "x", "avx512", "avx512f"),
                                 avx2_only)
    assert "NVIDIA" in runnable(Variant("linux-amd64-cuda-12", "x", None, "cuda-12"),
                                avx2_only)
    assert "CUDA 12" in runnable(Variant("linux-amd64-cuda-12", "x", None, "cuda-12"),
                                 Hardware("linux", "amd64", cuda="11.8"))
    assert "platform" in runnable(Variant("windows-amd64", "x"), avx2_only)


def test_recommended_variant_prefers_gpu_then_best_cpu():
    variants = engines_mod.CATALOG["gguf-cpp"].variants(HW)
    assert recommended(variants, HW).name == "linux-amd64-avx512"
    gpu = Hardware("linux", "amd64", "", AVX512, cuda="12.4")
    assert recommended(variants, gpu).name == "linux-amd64-cuda-12"


def test_each_catalog_row_says_what_its_adapter_says():
    for spec in engines_mod.CATALOG.values():
        adapter = spec.adapter()
        assert (adapter.name, adapter.format, adapter.description) == \
            (spec.name, spec.format, spec.description)


def test_the_contract_is_checked_where_engines_and_models_come_in():
    """A custom engine object is checked against contract.Engine when its entry point
    loads; a loaded model's capabilities are found once, a chat-only model's through
    its wrapper, which cannot batch."""
    from localrt.engines import contract, plugins

    class EntryPoint:
        value = "half:ENGINE"

        def load(self):
            return type("Half", (), {"name": "half"})

    with pytest.raises(plugins.PluginError, match=r"\(half:ENGINE\) lacks format, "
                                                  r"description, load$"):
        plugins.load("half", EntryPoint(), None)

    class ChatOnly:
        slots = 4

        def chat(self, messages, params, stream):
            return iter(["a", "b"])

        def step(self):
            pass

        def memory(self):
            return {"ram": 1, "vram": 0}

        def count_tokens(self, messages, params):
            return 3

        def unload(self):
            pass

    model = contract.generating(ChatOnly())
    assert isinstance(model, contract.Model) and model.count_tokens([], {}) == 3
    assert contract.capabilities(model) == {contract.Measured, contract.Counting}
    assert "".join(model.generate([], {})) == "ab"

    class Batching(ChatOnly):
        def generate(self, messages, params, wait=None):
            return iter(())

    batching = Batching()
    assert contract.generating(batching) is batching
    assert contract.capabilities(batching) == {contract.Batched, contract.Measured,
                                               contract.Counting}
    batching.slots = 0  # no slots: one request at a time
    assert contract.Batched not in contract.capabilities(batching)


def test_the_catalog_says_which_engine_loads_a_model():
    assert engines_mod.engine_for_files(["a/Model.Q8_0.GGUF", "genai_config.json"]) == \
        "gguf-cpp"
    assert engines_mod.engine_for_files(["model.onnx", "tokenizer.json"]) == "onnx-runtime"
    assert engines_mod.engine_for_files(["x.gguf"], folder=True) is None
    assert engines_mod.engine_for_files(["README.md"]) is None
    assert engines_mod.weights_file(["m/model.onnx", "m/genai_config.json"]) == \
        "m/genai_config.json"
    assert engines_mod.engine_alias("Llama.CPP") == "gguf-cpp"
    assert engines_mod.engine_alias("onnxruntime") == "onnx-runtime"
    assert engines_mod.engine_alias("vllm") is None


def test_gguf_variant_comes_from_system_info():
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | "
    assert gguf_variant(info, False, HW) == "linux-amd64-avx512"
    assert gguf_variant("CPU : AVX = 1 | AVX2 = 1 | AVX512 = 0 |", False, HW) == \
        "linux-amd64-avx2"
    assert gguf_variant("CUDA : ARCHS = 890 | CPU : AVX2 = 1 |", True,
                        Hardware("linux", "amd64", cuda="12.4")) == "linux-amd64-cuda-12"


# --- fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def probe_result():
    """The real probe of the llama.cpp build under test, run once per session."""
    hw = detect_hardware()
    return hw, probe_mod.run_probe(None, hw)


@pytest.fixture
def index(index_dir):
    with PackageIndex(index_dir) as emu:
        yield emu


@pytest.fixture
def app(settings, index, probe_result):
    """An app whose engine index is the emulator; the session's probe result is reused."""
    hw, result = probe_result

    def run_probe(path, hw):  # the shipped build's result is the session's
        return result if path is None else probe_mod.run_probe(path, hw)

    settings.update({"engineIndexUrl": index.url})
    app = create_app(settings, hardware=hw, run_probe=run_probe)
    yield app
    app.close()


@pytest.fixture
def clean_sys_path():
    """Engine folders that a test puts on sys.path are taken off again."""
    before = list(sys.path)
    yield
    sys.path[:] = before


def wait_install(api, task_id):
    """wait_task with room for unpacking some 35 MB of wheels on a slow machine."""
    return wait_task(api, task_id, timeout=60.0)


def engine(api, name):
    return {e["name"]: e for e in api("GET", "/v1/engines").json["data"]}[name]


def install_onnx(api):
    r = api("POST", "/v1/engines/onnx-runtime/install")
    assert r.status == 200, r.body
    assert r.json["message"] == "Engine onnx-runtime starts installing"
    task = wait_install(api, r.json["task"]["id"])
    assert task["status"] == "Success", task
    assert task["type"] == "Engine"
    return task


# --- listing -------------------------------------------------------------------------


def test_fresh_install_lists_gguf_ready_and_onnx_not_installed(api, probe_result):
    r = api("GET", "/v1/engines")
    assert r.status == 200
    assert r.json["object"] == "list" and r.json["result"] == "OK"
    by_name = {e["name"]: e for e in r.json["data"]}
    gguf = by_name["gguf-cpp"]
    assert set(gguf) >= {"name", "productName", "description", "format", "status",
                         "variant", "version"}
    assert gguf["format"] == "GGUF" and gguf["productName"] == "gguf-cpp"
    assert gguf["status"] == "Ready", gguf.get("reason")
    assert gguf["version"] == "v" + engines_mod.metadata.version("llama-cpp-python")
    assert gguf["variant"] == probe_result[1]["variant"]
    assert gguf["variant"].startswith("linux-amd64")
    onnx = by_name["onnx-runtime"]
    assert (onnx["format"], onnx["status"], onnx["version"], onnx["variant"]) == \
        ("ONNX", "Not Installed", "", "")


def test_get_engine_lists_installed_variants(api):
    for path in ("/engines/gguf-cpp", "/v1/engines/gguf-cpp"):
        r = api("GET", path)
        assert r.status == 200
        (row,) = r.json
        assert row["engine"] == "gguf-cpp" and row["status"] == "Ready"
        assert row["version"].startswith("v0.")
    assert api("GET", "/engines/onnx-runtime").json == []
    r = api("GET", "/engines/nope")
    assert r.status == 404 and r.json["error"]["code"] == "engine_not_found"


@pytest.mark.live  # the probe loads tiny models in a child process
def test_the_probe_runs_in_a_child_and_is_cached(settings, probe_result):
    hw, result = probe_result
    assert "reason" not in result, result
    assert result["decodeTokensPerSecond"] > 0
    app = create_app(settings, hardware=hw)  # no cached result: this one probes
    try:
        assert engine(bind(app), "gguf-cpp")["status"] == "Ready"
        probes = json.loads((settings.data_dir / "engines" / "probes.json").read_text())
        assert list(probes.values())[0]["variant"] == result["variant"]
    finally:
        app.close()
    # The server process itself never imported llama_cpp to answer this.
    assert "llama_cpp" not in _modules_after_listing(settings)


def _modules_after_listing(settings) -> list:
    code = textwrap.dedent("""
        import json, sys
        from localrt import settings
        from localrt.app import create_app
        app = create_app(settings.load())
        app.services.engines.list()
        print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in
                                ('llama_cpp', 'onnxruntime_genai'))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout)


# A stand-in llama_cpp that kills itself the way the miscompiled AMX build does on its
# first quantized decode. It tests the probe's parent side only; the real build is
# probed by test_the_probe_runs_in_a_child_and_is_cached.
CRASHING_LLAMA_CPP = textwrap.dedent("""
    import os, signal
    __version__ = "0.3.99"
    def llama_print_system_info(): return b"CPU : AVX = 1 | AVX2 = 1 | AVX512 = 1 |"
    def llama_supports_gpu_offload(): return False
    def llama_model_quantize_default_params():
        class P: ftype = 0
        return P()
    def llama_model_quantize(src, dst, params):
        open(dst, "wb").write(open(src, "rb").read()); return 0
    class Llama:
        def __init__(self, *a, **k): os.kill(os.getpid(), signal.SIGILL)
""")


def test_one_probe_runs_per_build_and_other_builds_do_not_wait(tmp_path):
    started, release, calls = threading.Event(), threading.Event(), []

    def run(path, hw):
        calls.append(path)
        if path.endswith("slow"):
            started.set()
            assert release.wait(10)
        return {"variant": hw.platform, "version": "1"}

    probes = probe_mod.Probes(tmp_path, HW, run)
    results = []
    slow = [threading.Thread(target=lambda: results.append(
        probes.result("gguf-cpp", str(tmp_path / "slow"), "1"))) for _ in range(3)]
    for t in slow:
        t.start()
    assert started.wait(10)
    assert probes.result("gguf-cpp", str(tmp_path / "fast"), "1")["variant"] == "linux-amd64"
    release.set()
    for t in slow:
        t.join(10)
    assert len(results) == 3 and calls.count(str(tmp_path / "slow")) == 1
    again = probe_mod.Probes(tmp_path, HW, run)  # kept in probes.json
    assert again.result("gguf-cpp", str(tmp_path / "slow"), "1") == results[0]
    assert len(calls) == 2


def test_listing_engines_does_not_wait_for_the_probe_of_another_build(settings, tmp_path):
    started, release = threading.Event(), threading.Event()

    def run(path, hw):
        if path is not None:
            started.set()
            assert release.wait(10)
        return {"variant": hw.platform, "version": "1"}

    app = create_app(settings, hardware=HW, run_probe=run)
    try:
        engines = app.services.engines
        probing = threading.Thread(target=engines.problem, args=(
            "gguf-cpp", {"path": str(tmp_path / "build"), "version": "0.3.99"}))
        probing.start()
        assert started.wait(10)
        r = call(app, "GET", "/v1/engines")
        assert r.status == 200 and r.json["data"][0]["status"] == "Ready"
        release.set()
        probing.join(10)
    finally:
        release.set()
        app.close()


def test_a_build_that_crashes_is_incompatible_with_the_reason(tmp_path):
    """The probe's parent side: a child killed by SIGILL is reported, not fatal.

    The llama_cpp here is a stand-in that kills itself the way the miscompiled AMX
    build does on its first quantized decode; the real build is probed above.
    """
    fake = tmp_path / "engine" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(CRASHING_LLAMA_CPP)
    result = probe_mod.run_probe(str(tmp_path / "engine"), HW)
    assert result["reason"] == ("the build crashes on this CPU: illegal instruction "
                                "(SIGILL) in a Q8_0 quantized model")
    assert result["variant"] == "linux-amd64-avx512"


# --- gguf-cpp runs quantized models -------------------------------------------------


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_gguf_cpp_runs_quantized_models(app, quantized, quant):
    model = app.services.engines.open("gguf-cpp", str(quantized[quant]),
                                      {"ctx_len": 256, "cpu_threads": 1})
    try:
        messages = [{"role": "user", "content": "hello"}]
        out = model.chat(messages, {"max_tokens": 6, "temperature": 0}, False)
        assert out["usage"]["completion_tokens"] >= 1
        assert out["finish_reason"] in ("stop", "length")
        again = model.chat(messages, {"max_tokens": 6, "temperature": 0}, False)
        assert again["content"] == out["content"]  # greedy is deterministic
        pieces = list(model.chat(messages, {"max_tokens": 6, "temperature": 0}, True))
        assert "".join(pieces) == out["content"]
    finally:
        model.unload()


def test_each_engine_has_one_adapter_made_with_its_settings(app, settings):
    """The catalog makes an engine's adapter once, with the engine settings its row
    names (gguf-cpp's prompt cache, promptCacheMiB in bytes), whether a request's checks
    or a load asks for it first."""
    engines = app.services.engines
    engines.check_request("gguf-cpp", {})
    adapter = engines.adapter("gguf-cpp")
    engines.check_options("gguf-cpp", {})
    assert engines.adapter("gguf-cpp") is adapter
    assert adapter.prompt_cache_bytes == settings["promptCacheMiB"] << 20 > 0


# --- installing onnx-runtime from the index emulator --------------------------------


def test_install_onnx_runtime_and_generate(api, app, index, settings, tmp_path,
                                           clean_sys_path):
    started = time.monotonic()
    task = install_onnx(api)
    elapsed = time.monotonic() - started
    names = {item["id"] for item in task["items"]}
    # The engine, and the requirement this environment lacks; numpy is already here.
    assert any(n.startswith("onnxruntime_genai-0.18.0") for n in names)
    assert any(n.startswith("onnxruntime-1.") for n in names)
    assert not any(n.startswith("numpy-") for n in names)
    print(f"onnx-runtime install: {elapsed:.2f}s for {len(names)} wheels")

    onnx = engine(api, "onnx-runtime")
    assert (onnx["status"], onnx["version"], onnx["variant"]) == \
        ("Ready", "v0.18.0", "linux-amd64")
    folder = settings.data_dir / "engines" / "onnx-runtime" / "linux-amd64" / "0.18.0"
    assert (folder / "onnxruntime_genai").is_dir()
    assert (folder / "onnxruntime" / "capi").is_dir()
    assert not list((settings.data_dir / "engines" / ".downloads").glob("*.whl"))
    rows = api("GET", "/engines/onnx-runtime").json
    assert rows == [{"engine": "onnx-runtime", "name": "linux-amd64", "version": "v0.18.0",
                     "status": "Ready"}]
    # Installing it again checks its files instead of fetching them (issue 15: was a 409).
    r = api("POST", "/v1/engines/onnx-runtime/install", {"variant": "linux-amd64"})
    assert r.status == 200 and "already installed" in r.json["message"]
    assert wait_install(api, r.json["task"]["id"])["status"] == "Success"

    model_dir = write_onnx_model(tmp_path / "onnx-model")
    model = app.services.engines.open("onnx-runtime", str(model_dir), {})
    messages = [{"role": "user", "content": "hi"}]
    out = model.chat(messages, {"max_tokens": 8, "temperature": 0.8, "seed": 7}, False)
    assert out["usage"]["completion_tokens"] == 8 and out["finish_reason"] == "length"
    again = model.chat(messages, {"max_tokens": 8, "temperature": 0.8, "seed": 7}, False)
    assert again["content"] == out["content"] and out["content"]
    streamed = "".join(model.chat(messages, {"max_tokens": 8, "seed": 7,
                                             "temperature": 0.8}, True))
    assert streamed == out["content"]
    import onnxruntime_genai
    assert Path(onnxruntime_genai.__file__).is_relative_to(folder)

    # A running model blocks the uninstall; after a stop it goes, folder and all.
    model.unload()
    r = api("POST", "/v1/models/import", {"path": str(model_dir), "id": "tiny-onnx"})
    assert r.status == 200, r.body
    assert r.json["model"]["engine"] == "onnx-runtime"
    r = api("POST", "/v1/models/tiny-onnx/start")
    assert r.status == 200, r.body
    # Chat completions answer the same way as for GGUF models, streamed and not.
    body = {"model": "tiny-onnx", "messages": messages, "max_tokens": 8, "seed": 7,
            "temperature": 0.8}
    r = api("POST", "/v1/chat/completions", body)
    assert r.status == 200, r.body
    assert r.json["choices"][0]["message"]["content"] == out["content"]
    assert r.json["usage"]["completion_tokens"] == 8
    assert r.json["choices"][0]["finish_reason"] == "length"
    # Anthropic's count_tokens reads the same prompt, without generating.
    count = api("POST", "/v1/messages/count_tokens", {"model": "tiny-onnx",
                                                      "messages": messages})
    assert count.json == {"input_tokens": r.json["usage"]["prompt_tokens"]}
    r = api("POST", "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(b[6:]) for b in r.body.decode().split("\n\n")
              if b.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        out["content"]
    assert r.body.endswith(b"data: [DONE]\n\n")
    r = api("DELETE", "/v1/engines/onnx-runtime/install")
    assert r.status == 409 and "tiny-onnx" in r.json["error"]["message"]
    assert api("POST", "/v1/models/tiny-onnx/stop").status == 200
    r = api("DELETE", "/v1/engines/onnx-runtime/install")
    assert r.status == 200
    assert r.json == {"message": "Engine onnx-runtime uninstalled successfully"}
    assert not folder.exists()
    assert engine(api, "onnx-runtime")["status"] == "Not Installed"


def test_install_progress_comes_as_engine_events(app, api, index):
    stream = app.services.events.listen()
    assert next(stream).startswith(b":")
    install_onnx(api)
    events = []
    while True:
        chunk = next(stream)
        if chunk.startswith(b"data:"):
            events.append(json.loads(chunk[5:]))
            if events[-1]["type"] in ("DownloadSuccess", "DownloadError"):
                break
    stream.close()
    types = [e["type"] for e in events]
    assert types[0] == "DownloadStarted" and types[-1] == "DownloadSuccess"
    assert all(e["task"]["type"] == "Engine" for e in events)


# --- bad inputs ----------------------------------------------------------------------


def test_unknown_engine_is_404(api):
    for method, path in (("POST", "/v1/engines/nope/install"),
                         ("DELETE", "/v1/engines/nope/install"),
                         ("GET", "/v1/engines/nope")):
        r = api(method, path)
        assert r.status == 404, (method, path)
        assert r.json["error"]["param"] == "engine"


def test_a_variant_for_another_os_is_refused(api):
    r = api("POST", "/v1/engines/onnx-runtime/install", {"variant": "windows-amd64"})
    assert r.status == 400
    assert r.json["error"]["param"] == "variant"
    assert "linux-amd64" in r.json["error"]["message"]
    r = api("POST", "/v1/engines/onnx-runtime/install", {"variant": "linux-amd64-cuda-12"})
    assert r.status == 400 and "NVIDIA" in r.json["error"]["message"]


def test_a_version_the_index_lacks_is_400(api, index):
    r = api("POST", "/v1/engines/onnx-runtime/install", {"version": "9.9.9"})
    assert r.status == 400
    assert r.json["error"]["param"] == "version"
    assert "9.9.9" in r.json["error"]["message"]
    r = api("POST", "/v1/engines/onnx-runtime/install", {"version": "not a version"})
    assert r.status == 400 and r.json["error"]["param"] == "version"


def test_a_wrong_sha256_fails_the_install_and_installs_nothing(api, index, settings):
    index.wrong_sha256 = {d.filename for d in index.distributions()
                          if d.filename.startswith("onnxruntime_genai")}
    r = api("POST", "/v1/engines/onnx-runtime/install")
    task = wait_install(api, r.json["task"]["id"])
    assert task["status"] == "Error" and "checksum mismatch" in task["error"]
    assert engine(api, "onnx-runtime")["status"] == "Not Installed"
    assert not (settings.data_dir / "engines" / "onnx-runtime").exists()


def test_a_cancelled_install_leaves_nothing_installed(api, index, settings):
    index.throttle = 0.01
    r = api("POST", "/v1/engines/onnx-runtime/install")
    task_id = r.json["task"]["id"]
    wait_bytes(api, task_id, 256 * 1024 + 1)
    assert api("DELETE", "/v1/models/pull", {"taskId": task_id}).status == 200
    assert wait_install(api, task_id)["status"] == "Stopped"
    assert engine(api, "onnx-runtime")["status"] == "Not Installed"
    assert not (settings.data_dir / "engines" / "onnx-runtime").exists()
    # The part file stays, so the next install resumes instead of starting over.
    index.throttle = 0
    assert list((settings.data_dir / "engines" / ".downloads").glob("*.part"))
    install_onnx(api)
    ranges = [h.get("range") for m, p, h in index.requests if p.startswith("/files/onnx")]
    assert any(r and r != "bytes=0-0" for r in ranges)


def test_a_killed_unpack_does_not_count_as_installed(app, api, settings):
    """A staging folder or an unregistered version folder is not an installed engine."""
    root = settings.data_dir / "engines" / "onnx-runtime" / "linux-amd64"
    (root / ".0.18.0.partial" / "onnxruntime_genai").mkdir(parents=True)
    (root / "0.18.0" / "onnxruntime_genai").mkdir(parents=True)
    fresh = create_app(settings, hardware=app.services.engines.hardware)
    try:
        assert engine(bind(fresh), "onnx-runtime")["status"] == \
            "Not Installed"
    finally:
        fresh.close()


def test_the_builtin_gguf_cpp_is_deactivated_not_deleted(api):
    # Installing what is installed checks its files (issue 15: was a 409).
    r = api("POST", "/v1/engines/gguf-cpp/install")
    assert r.status == 200 and "already installed" in r.json["message"]
    assert wait_install(api, r.json["task"]["id"])["status"] == "Success"
    r = api("DELETE", "/v1/engines/gguf-cpp/install")
    assert r.json == {"message": "Engine gguf-cpp uninstalled successfully"}
    gguf = engine(api, "gguf-cpp")
    assert (gguf["status"], gguf["version"], gguf["variant"]) == ("Not Installed", "", "")
    import llama_cpp  # still on disk
    assert Path(llama_cpp.__file__).exists()
    r = api("POST", "/v1/engines/gguf-cpp/install")
    assert r.status == 200 and r.json["message"] == "Engine gguf-cpp starts installing"
    wait_install(api, r.json["task"]["id"])  # issue 15: a real install, with a task
    assert engine(api, "gguf-cpp")["status"] == "Ready"


def test_bad_bodies_name_the_field(api):
    r = api("POST", "/v1/engines/onnx-runtime/install", {"variant": 3})
    assert r.status == 400 and r.json["error"]["param"] == "variant"
    r = api("POST", "/v1/engines/onnx-runtime/install", {"flavour": "x"})
    assert r.status == 400
    for not_a_wheel in ("/proc/cpuinfo", __file__):  # found by the fuzz: was a 500
        r = api("POST", "/v1/engines/install", {"wheel": not_a_wheel})
        assert r.status == 400 and "not a usable wheel" in r.json["message"], r.json
    r = api("POST", "/v1/engines/install", {"wheel": "~no-such-user-here/x.whl"})
    assert r.status == 400 and r.json["error"]["param"] == "wheel"  # found by the fuzz
    r = api("POST", "/v1/engines/install", {"wheel": "relative/path.whl"})
    assert r.status == 400 and r.json["error"]["param"] == "wheel"
    r = api("POST", "/v1/engines/install", {"wheel": "/no/such/file.whl"})
    assert r.status == 400 and "No such file" in r.json["error"]["message"]


# --- custom engines -------------------------------------------------------------------


def test_custom_engine_wheel_installs_lists_and_chats(api, app, index_dir, tmp_path,
                                                      clean_sys_path):
    wheel = next(index_dir.glob("localrt_echo_engine-*.whl"))
    r = api("POST", "/v1/engines/install", {"wheel": str(wheel)})
    assert r.status == 200 and r.json["message"] == "Engine echo starts installing"
    assert wait_install(api, r.json["task"]["id"])["status"] == "Success"
    echo = engine(api, "echo")
    assert (echo["status"], echo["format"], echo["version"]) == ("Ready", "ECHO", "v1.0.0")
    assert api("GET", "/engines/echo").json[0]["name"] == "linux-amd64"

    model = write_echo_model(tmp_path / "echo.txt")
    loaded = app.services.engines.open("echo", str(model), {})
    out = loaded.chat([{"role": "user", "content": "hello there"}], {}, False)
    assert out["content"] == "echo: hello there"
    # Chat completions stream an engine without generate(), counting pieces as tokens.
    from localrt.engines.generation import generation_of_pieces

    def generation(params):
        pieces = loaded.chat([{"role": "user", "content": "a b c"}], params, True)
        return generation_of_pieces(pieces, params)

    gen = generation({"max_tokens": 2, "stop": []})
    assert "".join(gen) == "echo: a" and gen.finish_reason == "length"
    assert gen.usage["completion_tokens"] == 2
    gen = generation({"stop": [" b"]})
    assert "".join(gen) == "echo: a" and gen.finish_reason == "stop"
    gen = generation({"max_tokens": 2, "stop": [" aX"]})  # held back, then let go at the end
    assert "".join(gen) == "echo: a" and gen.finish_reason == "length"
    assert api("DELETE", "/v1/engines/echo/install").status == 200
    assert "echo" not in {e["name"] for e in api("GET", "/v1/engines").json["data"]}


def test_custom_engine_wheel_from_a_url(api, index, clean_sys_path):
    wheel = next(d for d in index.distributions() if d.filename.startswith("localrt_echo"))
    r = api("POST", "/v1/engines/install", {"wheel": f"{index.root_url}/files/{wheel.filename}"})
    assert r.status == 200, r.body
    assert wait_install(api, r.json["task"]["id"])["status"] == "Success"
    assert engine(api, "echo")["status"] == "Ready"


def test_a_gguf_cpp_variant_installs_from_the_index_and_is_probed(app, api, index_dir,
                                                                  tmp_path, quantized):
    """gguf-cpp variants are llama-cpp-python wheels labelled +<variant feature>. This
    one crashes, so after its install it is Incompatible and models are refused.

    The variant is one this CPU runs other than the shipped build's (on an AVX2-only
    machine the shipped build is the avx2 variant, which an install only checks)."""
    from localrt.engines.hardware import CPU_LEVELS

    hw = app.services.engines.hardware
    shipped = app.services.engines.default("gguf-cpp")["variant"]
    level = next((level for level, flag in CPU_LEVELS if flag in hw.cpu_flags
                  and f"{hw.platform}-{level}" != shipped), None)
    if level is None or hw.platform != "linux-amd64":
        pytest.skip("no x86-64 CPU level here besides the shipped build's")
    variant, wheel = f"linux-amd64-{level}", f"llama_cpp_python-0.3.99+{level}-py3-none-any.whl"
    build_wheel(index_dir, "llama-cpp-python", f"0.3.99+{level}",
                {"llama_cpp/__init__.py": CRASHING_LLAMA_CPP})
    try:
        r = api("POST", "/v1/engines/gguf-cpp/install", {"variant": variant})
        assert r.status == 200, r.body
        assert wait_install(api, r.json["task"]["id"])["status"] == "Success"
        gguf = engine(api, "gguf-cpp")
        assert gguf["status"] == "Incompatible"
        assert "illegal instruction" in gguf["reason"]
        rows = {row["name"]: row for row in api("GET", "/engines/gguf-cpp").json}
        assert rows[variant]["status"] == "Incompatible"
        assert rows[variant]["version"] == "v0.3.99"
        with pytest.raises(engines_mod.EngineIncompatible) as refused:
            app.services.engines.open("gguf-cpp", str(quantized["Q8_0"]), {})
        assert refused.value.status == 409 and "illegal instruction" in refused.value.message
        # Uninstalling the variant brings the shipped build back.
        r = api("DELETE", "/v1/engines/gguf-cpp/install", {"variant": variant})
        assert r.status == 200
        assert engine(api, "gguf-cpp")["status"] == "Ready"
    finally:
        (index_dir / wheel).unlink()
