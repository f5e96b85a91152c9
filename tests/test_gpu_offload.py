"""Layers on a GPU, for real, on Mesa's lavapipe (issue 35, items 5 and 8): the gguf-cpp
Vulkan variant runs layers through llama.cpp's Vulkan backend on a Vulkan device that
is the CPU, so everything but the speed of the GPU path is tested without a GPU.

* ngl 0, a part of the layers and all of them give the CPU build's greedy reply (the
  first 8 tokens: the Vulkan kernels sum in another order than the CPU's, so a long
  greedy reply of a random model may part where two tokens are nearly tied);
* the model's status row and `localrt ps` show the layers and bytes on llvmpipe, as
  llama.cpp put them, and /metrics and Ollama's /api/ps the same bytes;
* fit (ngl left unset) puts fewer layers on the device when the KV cache needs more
  than its 2 GiB heap (Debian 12's lavapipe), and fewer when gpuOverheadMiB leaves
  too little.

The Vulkan variant: the wheel of `vulkan_engine` (tests/support/variants.py: compiled
once a run, for tests/test_vulkan_live.py too, or kept in tests/.vulkan-build/built
under its key, or LOCALRT_TEST_VULKAN_WHEEL), installed through the API as
`<platform>-vulkan` from a package index of it into this module's own home. ggml's
Vulkan backend takes a CPU device only when told to (GGML_VK_VISIBLE_DEVICES), which
the servers here are given. Without lavapipe or what the compile needs they skip,
except under CI, where they fail.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from emulators.ggufgen import write_gguf
from prometheus_client.parser import text_string_to_metric_families  # a test dependency
from support.servers import run_foreground_server, send, subprocess_env
from support.variants import install_variant, labelled, scratch_caches, unavailable

from localrt.engines import gpus, memory
from localrt.engines.catalog import VULKAN

pytestmark = [pytest.mark.live, pytest.mark.slow]

INSTALL_TIMEOUT = 10 * 60  # seconds: a wheel built before only unpacks and probes
PROMPT = "The quick brown fox"
FIRST = 8  # tokens that must agree with the CPU build's (see the docstring)


@pytest.fixture(scope="session")
def lavapipe():
    """lavapipe as localrt.engines.gpus reads it, and GGML_VK_VISIBLE_DEVICES set to its
    index among the Vulkan devices (for the servers started here)."""
    if not (glob.glob("/usr/lib/*/libvulkan.so.1")
            and glob.glob("/usr/share/vulkan/icd.d/lvp_icd.*.json")):
        unavailable("no Vulkan loader or lavapipe (libvulkan1, mesa-vulkan-drivers)",
                    "lavapipe offload")
    found = [g for g in gpus.detect() if g["backend"] == "vulkan" and g["type"] == "cpu"]
    if not found:
        unavailable("the Vulkan loader lists no CPU device", "lavapipe offload")
    before = os.environ.get("GGML_VK_VISIBLE_DEVICES")
    os.environ["GGML_VK_VISIBLE_DEVICES"] = found[0]["id"]
    yield found[0]
    if before is None:
        os.environ.pop("GGML_VK_VISIBLE_DEVICES", None)
    else:
        os.environ["GGML_VK_VISIBLE_DEVICES"] = before


@pytest.fixture(scope="session")
def vulkan_home(lavapipe, vulkan_engine, tmp_path_factory):
    """A localrt home of this module's own whose active gguf-cpp variant is the Vulkan
    one, installed through the API from a package index holding the wheel
    `vulkan_engine` installed (tests/support/variants.py: built once a run, or kept)."""
    wheel, version, variant = vulkan_engine.wheel, vulkan_engine.version, vulkan_engine.variant
    index_dir = tmp_path_factory.mktemp("vulkan-index")
    (index_dir / labelled(wheel.name, version, VULKAN)).symlink_to(wheel.resolve())
    home = tmp_path_factory.mktemp("vulkan-home")
    install_variant(variant, version, index_dir, home, INSTALL_TIMEOUT,
                    scratch_caches(tmp_path_factory))
    return SimpleNamespace(home=home, variant=variant, device=lavapipe)


@pytest.fixture(scope="session")
def cpu_home(tmp_path_factory):
    """A localrt home on the CPU build (the llama-cpp-python localrt ships)."""
    return tmp_path_factory.mktemp("cpu-home")


@pytest.fixture(scope="session")
def small(tmp_path_factory):
    """A random 4-layer llama (5 layers as llama.cpp counts them)."""
    return write_gguf(tmp_path_factory.mktemp("offload") / "small.gguf", name="small",
                      n_embd=256, n_ff=512, n_layer=4, n_head=4, context_length=1 << 20)


def server_with(home: Path, model: Path, rc: str = "", name: str = "m"):
    """A server on `home` (with `rc` lines added to its .localrtrc), the model imported
    as `name`; the caller stops it."""
    rc_file = home / ".localrtrc"
    kept = rc_file.read_text() if rc_file.exists() else ""
    rc_file.write_text(re.sub(r"(?m)^gpuOverheadMiB:.*\n?", "", kept) + rc)
    srv = run_foreground_server(home)
    code, body = send(srv.url, "POST", "/v1/models/import",
                      {"path": str(model), "id": name, "option": "symlink"}, timeout=300)
    # The home is the session's: an earlier test imported the same file as `name`.
    assert code == 200 or body["error"]["code"] == "conflict", body
    return srv


def start(srv, name: str = "m", **options) -> dict:
    code, body = send(srv.url, "POST", f"/v1/models/{name}/start",
                      {"ctx_len": 256, "n_parallel": 1, "cpu_threads": 1, **options},
                      timeout=300)
    assert code == 200, body
    return row(srv, name)


def row(srv, name: str = "m") -> dict:
    code, body = send(srv.url, "GET", "/v1/models/status")
    assert code == 200, body
    return {r["id"]: r for r in body["data"]}[name]


def first_tokens(srv, name: str = "m") -> str:
    code, body = send(srv.url, "POST", "/v1/completions",
                      {"model": name, "prompt": PROMPT, "max_tokens": FIRST,
                       "temperature": 0}, timeout=300)
    assert code == 200, body
    assert body["usage"]["completion_tokens"] == FIRST
    return body["choices"][0]["text"]


def stop(srv) -> None:
    send(srv.url, "POST", "/v1/models/m/stop")


def test_ngl_0_part_and_all_give_the_cpu_s_reply_and_show_where(vulkan_home, cpu_home,
                                                                  small):
    srv = server_with(cpu_home, small)
    try:
        start(srv)
        expected = first_tokens(srv)
    finally:
        srv.stop()
    name = vulkan_home.device["name"]
    srv = server_with(vulkan_home.home, small)
    try:
        for ngl, layers in ((0, 0), (2, 2), (-1, 5)):
            shown = start(srv, ngl=ngl)
            offload = shown["offload"]
            print(f"ngl {ngl}: offload {offload}, ram {shown['ram']}, vram {shown['vram']}")
            assert (offload["ngl"], offload["layers"], offload["of"]) == (ngl, layers, 5), \
                shown
            if layers:
                assert [d["name"] for d in offload["devices"]] == [name]
                assert offload["devices"][0]["bytes"] > 0
            assert shown["vram"] == sum(d["bytes"] for d in offload["devices"])
            assert first_tokens(srv) == expected, f"ngl {ngl}"
            if ngl == 2:  # ps, Ollama's ps and the gauge say the same
                ps = subprocess.run([sys.executable, "-m", "localrt", "ps"],
                                    env=subprocess_env(vulkan_home.home),
                                    capture_output=True, text=True, timeout=60)
                assert f"m: 2/5 layers on {name}" in ps.stdout, ps.stdout + ps.stderr
                code, body = send(srv.url, "GET", "/api/ps")
                assert body["models"][0]["size_vram"] == shown["vram"] > 0
                with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as reply:
                    samples = [s for f in text_string_to_metric_families(reply.read().decode())
                               for s in f.samples if s.name == "localrt_model_memory_bytes"]
                assert {s.labels["device"]: s.value for s in samples} == \
                    {"cpu": shown["ram"], name: shown["vram"]}
            stop(srv)
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def deep(tmp_path_factory):
    """A random 40-layer llama as narrow as `small`: at ctx_len 2**16 its KV cache is
    2.5 GiB (64 MiB a layer), more than lavapipe's 2 GiB heap, while each layer's K and
    V tensors (32 MiB) stay under lavapipe's maxStorageBufferRange (128 MiB), the most
    one tensor on the device may have (ggml's Vulkan backend aborts the process on a
    bigger one: `small` at ctx_len 2**19, 256 MiB K tensors, did)."""
    return write_gguf(tmp_path_factory.mktemp("offload-deep") / "deep.gguf", name="deep",
                      n_embd=256, n_ff=512, n_layer=40, n_head=4, context_length=1 << 20)


def test_fit_leaves_on_the_cpu_what_the_heap_cannot_hold(vulkan_home, deep):
    """The KV cache and the compute buffer need more than lavapipe's heap holds, so fit
    puts some layers on it, not all."""
    options = {"ctx_len": 1 << 16, "n_parallel": 1, "flash_attn": True}
    device = vulkan_home.device
    expected = memory.fit(memory.need([deep], [], options), [device], 512 << 20)
    assert 0 < expected.ngl < expected.of
    srv = server_with(vulkan_home.home, deep, name="deep")
    try:
        offload = start(srv, name="deep", **options)["offload"]
        print("fit at ctx_len 2**16:", offload, f"(expected {expected})")
        assert offload["ngl"] == "fit" and offload["layers"] == expected.ngl, offload
        assert offload["devices"][0]["bytes"] <= device["free"]
        assert first_tokens(srv, "deep")
    finally:
        srv.stop()


def test_fit_leaves_gpu_overhead_free(vulkan_home, small):
    """gpuOverheadMiB of all but the compute buffer and the output layer: fit puts the
    output layer alone on the device; of all of it, nothing."""
    options = {"ctx_len": 256, "n_parallel": 1}
    needed = memory.need([small], [], options)
    free = vulkan_home.device["free"]
    only_output = (free - needed.compute - needed.output) >> 20
    for overhead, layers in ((only_output, 1), (free >> 20, 0)):
        srv = server_with(vulkan_home.home, small, rc=f"gpuOverheadMiB: {overhead}\n")
        try:
            offload = start(srv, **options)["offload"]
            print(f"gpuOverheadMiB {overhead}: offload {offload}")
            assert offload["ngl"] == "fit" and offload["layers"] == layers, offload
        finally:
            srv.stop()


def test_a_tensor_over_the_device_s_buffer_limit_is_refused_or_fit_around(vulkan_home,
                                                                          small):
    """`small` at ctx_len 2**19 has 256 MiB K and V tensors a layer, over lavapipe's
    largest buffer (its maxStorageBufferRange, 128 MiB on Debian 12): ggml's Vulkan
    backend aborted the whole server on one. ngl 2 (a block on the device) is a 400
    naming ctx_len and the limit, and the ctx_len it advises starts; left unset, fit
    keeps every block on the CPU; and the server goes on answering another model."""
    limit = vulkan_home.device["maxBuffer"]
    options = {"ctx_len": 1 << 19, "n_parallel": 1, "cpu_threads": 1, "flash_attn": True}
    needed = memory.need([small], [], options)
    if needed.largest[3][1] <= limit:
        pytest.skip(f"this lavapipe takes {limit >> 20} MiB in one buffer")
    srv = server_with(vulkan_home.home, small)
    try:
        send(srv.url, "POST", "/v1/models/m/stop")
        code, body = send(srv.url, "POST", "/v1/models/m/start", {**options, "ngl": 2},
                          timeout=300)
        print("ngl 2 at ctx_len 2**19:", code, body)
        assert code == 400 and body["error"]["param"] == "ctx_len", body
        message = body["error"]["message"]
        assert f"over the {limit >> 20} MiB" in message and "ngl 1 or less" in message
        assert vulkan_home.device["name"] in message
        # the advice holds: at the ctx_len it names, the K tensors are the limit itself
        advised = int(re.search(r"ctx_len (\d+) or less", message).group(1))
        assert advised == 1 << 18
        shown = start(srv, **{**options, "ctx_len": advised}, ngl=2)["offload"]
        assert shown["layers"] == 2, shown
        assert first_tokens(srv)
        stop(srv)
        fitted = start(srv, **options)["offload"]
        print("fit at ctx_len 2**19:", fitted)
        assert fitted["ngl"] == "fit" and fitted["layers"] == 1, fitted  # the output layer
        assert first_tokens(srv)
        code, body = send(srv.url, "POST", "/v1/models/import",
                          {"path": str(small), "id": "other", "option": "symlink"},
                          timeout=300)
        assert code == 200 or body["error"]["code"] == "conflict", body
        start(srv, name="other", ngl=-1)
        assert first_tokens(srv, "other")
        assert first_tokens(srv)  # the first one goes on too
    finally:
        srv.stop()
