"""Running models and chat completions, through the WSGI app, on real llama.cpp.

The models are tests/emulators/ggufgen.py's tiny random llama, quantized by llama.cpp to Q8_0
and Q4_0 (the `quantized` fixture in conftest), registered with POST /v1/models/import.
Its end-of-sequence token is id 2, so `"logit_bias": {"2": -100}` makes a reply run
to max_tokens and `{"2": 100}` ends it at once.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from support.apps import bind, events
from support.models import NO_EOS, add_model

from localrt import settings as settings_mod
from localrt.api import ROUTES
from localrt.app import create_app
from localrt.inference.chat import render_template
from localrt.inference.lanes import FairLock

USER = [{"role": "user", "content": "hello"}]


def chat(api, **body):
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "temperature": 0, **body}
    return api("POST", "/v1/chat/completions", body)


# --- start, stop, status ------------------------------------------------------------


def test_start_reports_the_effective_options_and_status_lists_the_model(api, tiny):
    before = time.time()
    r = api("POST", "/v1/models/tiny/start", {"ctx_len": 128, "cpu_threads": 1})
    assert r.status == 200, r.body
    assert r.json["message"] == "Model tiny started successfully"
    assert (r.json["model"], r.json["engine"]) == ("tiny", "gguf-cpp")
    assert r.json["options"]["ctx_len"] == 128 and r.json["options"]["cpu_threads"] == 1
    again = api("POST", "/v1/models/tiny/start", {"cpu_threads": 1})
    assert again.status == 200 and again.json["message"] == "Model tiny is already running"
    other = api("POST", "/v1/models/tiny/start", {"ctx_len": 64})
    assert other.status == 200 and other.json["message"] == (
        "Model tiny is already running, with other ctx_len; stop it first to start it "
        "with these options")
    assert other.json["options"]["ctx_len"] == 128  # not loaded twice
    r = api("POST", "/v1/models/tiny/start", {"ctx_len": 100000})  # still checked
    assert r.status == 400 and r.json["error"]["param"] == "ctx_len"
    status = api("GET", "/v1/models/status").json
    since_start = time.time() - before
    row, = status["data"]
    assert (row["id"], row["engine"], row["vram"]) == ("tiny", "gguf-cpp", 0)
    assert row["ram"] > 0 and row["options"]["ctx_len"] == 128
    # Started by this test's first request: not before it, and up since then at most.
    assert int(before) <= row["startedAt"] <= before + since_start
    assert row["uptime"] <= round(since_start, 1) + 0.1
    assert status["hardware"]["cores"] >= 1 and status["hardware"]["ramTotal"] > 0
    assert api("GET", "/v1/models/tiny").json["status"] == "running"


def test_start_with_the_body_form_and_stop_in_every_form(api, tiny):
    assert api("POST", "/v1/models/start", {"model": "tiny", "ctx_len": 64}).status == 200
    r = api("POST", "/models/tiny/stop")
    assert r.status == 200 and r.json["message"] == "Model tiny stopped successfully"
    assert api("GET", "/v1/models/status").json["data"] == []
    r = api("POST", "/v1/models/tiny/stop")
    assert r.status == 409 and r.json["error"]["code"] == "model_not_running"
    api("POST", "/v1/models/tiny/start")
    assert api("POST", "/v1/models/stop", {"model": "tiny"}).status == 200
    assert api("GET", "/v1/models/tiny").json["status"] == "downloaded"


@pytest.mark.parametrize("body, param", [
    ({"ctx_len": 100000}, "ctx_len"),          # beyond the 256 tokens it was trained on
    ({"cache_type": "q9_9"}, "cache_type"),
    ({"cache_type": "q8_0"}, "cache_type"),    # a quantized V cache needs flash_attn
    ({"grp_attn_n": 4}, "grp_attn_n"),
    ({"ngl": "all"}, "ngl"),
    ({"prompt_template": "no placeholder"}, "prompt_template"),
    ({"engine": "onnx-runtime"}, "engine"),    # runs ONNX, not GGUF
    ({"turbo": True}, "turbo"),
])
def test_start_refuses_options_the_model_cannot_take(api, tiny, body, param):
    r = api("POST", "/v1/models/tiny/start", body)
    assert r.status == 400, r.body
    assert r.json["error"]["param"] == param
    assert api("GET", "/v1/models/status").json["data"] == []


def test_start_errors_for_missing_models_and_engines(api, tiny, tmp_path):
    assert api("POST", "/v1/models/nope/start").status == 404
    r = api("POST", "/v1/models/start", {"ctx_len": 64})
    assert r.status == 400 and r.json["error"]["param"] == "model"
    r = api("POST", "/v1/models/start", {"model": "tiny", "engine": "no-such-engine"})
    assert r.status == 400 and r.json["error"]["param"] == "engine"
    assert "no-such-engine" in r.json["message"]


def test_a_model_whose_engine_is_not_installed_gets_a_409_naming_it(api, tmp_path):
    from emulators.onnxgen import write_onnx_model

    folder = write_onnx_model(tmp_path / "onnx-model")
    add_model(api, folder, "tiny-onnx", option="symlink")
    r = api("POST", "/v1/models/tiny-onnx/start")
    assert r.status == 409 and r.json["error"]["code"] == "engine_not_installed"
    assert "localrt engines install onnx-runtime" in r.json["message"]
    r = chat(api, model="tiny-onnx")
    assert r.status == 409 and "onnx-runtime" in r.json["message"]


def test_a_damaged_file_fails_to_load_cleanly(api, quantized):
    add_model(api, quantized["Q8_0"], "broken", option="copy")
    weights = next(Path(api("GET", "/v1/models/broken").json["path"]).glob("*.gguf"))
    good = weights.read_bytes()
    # the tensor count: same size, refused by the header check before llama.cpp reads it
    weights.write_bytes(good[:8] + b"\xff" * 8 + good[16:])
    r = api("POST", "/v1/models/broken/start")
    assert r.status == 400 and r.json["error"]["code"] == "invalid_model_file"
    assert r.json["message"].endswith("model broken cannot start")
    # a tensor the header check cannot know is missing: llama.cpp refuses the file itself
    weights.write_bytes(good.replace(b"output_norm.weight", b"output_norm.weighx"))
    for _ in range(2):  # and again: nothing half-loaded stays behind
        r = api("POST", "/v1/models/broken/start")
        assert r.status == 422 and r.json["error"]["code"] == "model_load_failed"
        assert "broken" in r.json["message"]
        assert api("GET", "/v1/models/status").json["data"] == []


# --- chat completions ------------------------------------------------------------------


def test_a_chat_starts_the_model_and_replies_in_openai_shape(api, tiny, caplog):
    with caplog.at_level(logging.INFO, logger="localrt.inference.scheduler"):
        r = chat(api, logit_bias=NO_EOS)
    assert r.status == 200, r.body
    assert "starting model tiny for a chat request" in caplog.text
    out = r.json
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["model"] == "tiny" and isinstance(out["created"], int)
    choice, = out["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    usage = out["usage"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_finish_reason_stop_at_end_of_sequence(api, tiny):
    out = chat(api, logit_bias={"2": 100}).json
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 0


def test_max_completion_tokens_and_stored_max_tokens(api, tiny):
    out = chat(api, max_tokens=None, max_completion_tokens=3, logit_bias=NO_EOS).json
    assert out["usage"]["completion_tokens"] == 3
    api("PATCH", "/v1/models/tiny", {"max_tokens": 5})
    out = chat(api, max_tokens=None, logit_bias=NO_EOS).json
    assert out["usage"]["completion_tokens"] == 5


def test_the_same_seed_gives_the_same_text(api, tiny):
    body = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 16,
            "logit_bias": NO_EOS}
    first = chat(api, seed=1234, **body).json["choices"][0]["message"]["content"]
    second = chat(api, seed=1234, **body).json["choices"][0]["message"]["content"]
    assert first == second
    others = {chat(api, seed=s, **body).json["choices"][0]["message"]["content"]
              for s in (1, 2, 3)}
    assert len(others | {first}) > 1  # the seed is used, not ignored


def test_stop_sequences_cut_the_reply(api, tiny):
    full = chat(api, max_tokens=24, logit_bias=NO_EOS).json["choices"][0]["message"]["content"]
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2)
                if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    cut = chat(api, max_tokens=24, logit_bias=NO_EOS, stop=stop).json
    assert cut["choices"][0]["message"]["content"] == full[:full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    as_list = chat(api, max_tokens=24, logit_bias=NO_EOS, stop=["\x00never", stop]).json
    assert as_list["choices"][0]["message"]["content"] == full[:full.index(stop)]


def test_the_models_stored_stop_sequences_apply(api, tiny):
    full = chat(api, max_tokens=24, logit_bias=NO_EOS).json["choices"][0]["message"]["content"]
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2)
                if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    api("POST", "/v1/models/tiny/stop")
    api("PATCH", "/v1/models/tiny", {"stop": [stop]})
    out = chat(api, max_tokens=24, logit_bias=NO_EOS).json
    assert out["choices"][0]["message"]["content"] == full[:full.index(stop)]


def test_streamed_reply_matches_the_plain_one(api, tiny):
    plain = chat(api, max_tokens=10, logit_bias=NO_EOS).json
    r = chat(api, max_tokens=10, logit_bias=NO_EOS, stream=True,
             stream_options={"include_usage": True})
    assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
    got = events(r)
    assert got[-1] == "[DONE]"
    first, *middle, final, usage, _ = got
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["id"] == first["id"] for c in middle + [final, usage])
    assert len(middle) >= 5  # one chunk per token piece, not one blob
    text = "".join(c["choices"][0]["delta"]["content"] for c in middle)
    assert text == plain["choices"][0]["message"]["content"]
    assert final["choices"][0]["finish_reason"] == "length"
    # the same prompt again: all but its last token cached
    assert usage["choices"] == [] and usage["usage"] == {
        **plain["usage"], "prompt_tokens_details": {
            "cached_tokens": plain["usage"]["prompt_tokens"] - 1, "audio_tokens": 0}}


def test_a_stream_without_include_usage_has_no_usage_chunk(api, tiny):
    got = events(chat(api, stream=True))
    assert got[-1] == "[DONE]"
    assert all("usage" not in c for c in got[:-1])
    assert got[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_content_as_text_parts_and_system_messages(api, tiny):
    parts = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "hel"},
                                          {"type": "text", "text": "lo"}]}]
    r = chat(api, messages=parts)
    assert r.status == 200, r.body
    r = chat(api, messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]}])
    # issue 36: a clip to a model without an audio projector is refused naming the model
    assert r.status == 400 and r.json["error"]["code"] == "audio_not_supported"
    assert r.json["error"]["param"] == "model"


def test_json_schema_replies_follow_the_schema(api, tiny):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    out = chat(api, max_tokens=64, response_format=fmt).json
    assert out["choices"][0]["finish_reason"] == "stop"
    assert json.loads(out["choices"][0]["message"]["content"])["answer"] in ("yes", "no")
    streamed = events(chat(api, max_tokens=64, response_format=fmt, stream=True))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in streamed[1:-2])
    assert json.loads(text)["answer"] in ("yes", "no")


def test_json_object_replies_start_as_json(api, tiny):
    out = chat(api, max_tokens=6, response_format={"type": "json_object"}).json
    assert out["choices"][0]["message"]["content"].lstrip().startswith(("{", "["))
    r = chat(api, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert r.status == 400 and "response_format" in r.json["error"]["param"]


def test_prompt_template_builds_the_prompt(api, tiny):
    base = chat(api).json["usage"]["prompt_tokens"]
    api("POST", "/v1/models/tiny/stop")
    template = "{system_message}\n" + "x " * 20 + "{prompt}\n"
    api("POST", "/v1/models/tiny/start", {"prompt_template": template})
    templated = chat(api).json["usage"]["prompt_tokens"]
    assert templated != base and templated >= 20


def test_render_template_renders_a_chatml_conversation():
    chatml = ("<|im_start|>system\n{system_message}<|im_end|>\n<|im_start|>user\n{prompt}"
              "<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    assert render_template(chatml, messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render_template("[INST] {prompt} [/INST]", messages[:2]) == "[INST] S\n\nU1 [/INST]"


def test_unknown_fields_are_ignored_and_wrong_types_named(api, tiny):
    r = chat(api, user="someone", parallel_tool_calls=False, metadata={"a": "b"},
             service_tier="auto")
    assert r.status == 200, r.body
    for field, value in (("temperature", "hot"), ("messages", "hi"), ("max_tokens", 0),
                         ("stop", 5), ("stream", "yes"), ("seed", 1.5), ("top_k", -1),
                         ("logit_bias", {"x": 1}), ("response_format", {"type": "xml"})):
        r = chat(api, **{field: value})
        assert r.status == 400, (field, r.body)
        assert r.json["error"]["param"].startswith(field), (field, r.json)
    r = chat(api, n=2)
    assert r.status == 400 and r.json["error"]["param"] == "n"
    r = chat(api, messages=[{"role": "robot", "content": "x"}])
    assert r.status == 400 and r.json["error"]["param"] == "messages[0].role"


def test_unknown_model_is_a_plain_json_404_even_when_streamed(api, tiny):
    for stream in (False, True):
        r = chat(api, model="nope", stream=stream)
        assert r.status == 404 and r.headers["content-type"] == "application/json"
        assert r.json["error"]["code"] == "model_not_found"


def test_a_prompt_longer_than_the_context_is_a_400_before_any_stream(api, tiny):
    api("POST", "/v1/models/tiny/start", {"ctx_len": 32})
    long = [{"role": "user", "content": "hello " * 100}]
    for stream in (False, True):
        r = chat(api, messages=long, stream=stream)
        assert r.status == 400 and r.json["error"]["param"] == "messages"
    assert chat(api).status == 200  # the model is free again


def test_completion_tokens_never_exceed_the_room_left_in_the_context(api, tiny):
    api("POST", "/v1/models/tiny/start", {"ctx_len": 40})
    out = chat(api, max_tokens=500, logit_bias=NO_EOS).json
    assert out["usage"]["total_tokens"] <= 40
    assert out["choices"][0]["finish_reason"] == "length"


def test_q4_0_models_chat_too(api, quantized):
    add_model(api, quantized["Q4_0"], "tiny-q4", option="symlink")
    out = chat(api, model="tiny-q4", logit_bias=NO_EOS).json
    assert out["usage"]["completion_tokens"] == 8


# --- several models ----------------------------------------------------------------------


def make_app(home, **overrides):
    settings = settings_mod.load(environ={"HOME": str(home)})
    settings.override(**overrides)
    return create_app(settings)


def test_past_max_running_models_the_least_recently_used_is_unloaded(home, quantized):
    app = make_app(home, maxRunningModels=2)
    try:
        api = bind(app)
        for name in ("a", "b", "c"):
            add_model(api, quantized["Q8_0"], name, option="symlink")
        api("POST", "/v1/models/a/start")
        api("POST", "/v1/models/b/start")
        chat(api, model="a")  # a is now used more recently than b
        api("POST", "/v1/models/c/start")
        running = {m["id"] for m in api("GET", "/v1/models/status").json["data"]}
        assert running == {"a", "c"}
        chat(api, model="b")  # starts b, unloading a
        assert {m["id"] for m in api("GET", "/v1/models/status").json["data"]} == {"b", "c"}
    finally:
        app.close()


def test_keep_alive_unloads_idle_models(home, quantized):
    app = make_app(home, keepAlive="1s")
    try:
        api = bind(app)
        add_model(api, quantized["Q8_0"], option="symlink")
        assert chat(api).status == 200
        assert api("GET", "/v1/models/status").json["data"]
        deadline = time.monotonic() + 5
        while api("GET", "/v1/models/status").json["data"]:
            assert time.monotonic() < deadline, "the idle model was not unloaded"
            time.sleep(0.1)
    finally:
        app.close()


def test_settings_keys_for_running_models(home):
    (home / ".localrtrc").write_text("maxRunningModels: 0\n")
    with pytest.raises(settings_mod.SettingsError, match="maxRunningModels"):
        settings_mod.load(environ={"HOME": str(home)})
    for value, minutes in (("5m", 5.0), (2, 2.0), ("30s", 0.5), ("1h", 60.0), (0, 0.0)):
        (home / ".localrtrc").write_text(f"keepAlive: {json.dumps(value)}\n")
        settings = settings_mod.load(environ={"HOME": str(home)})
        assert settings["keepAlive"] == minutes
        settings.update({"cors": False})  # the file is written back...
        again = settings_mod.load(environ={"HOME": str(home)})
        assert again["keepAlive"] == minutes  # ...and reads the same


def test_fair_lock_lets_waiters_in_in_arrival_order():
    import threading

    lock, order = FairLock(), []
    lock.acquire()
    threads = []
    for i in range(5):
        t = threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i),
                                                 lock.release()))
        t.start()
        threads.append(t)
        while lock.waiting < i + 1:
            time.sleep(0.001)
    lock.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4]


def test_removing_a_running_model_is_refused(api, tiny, quantized):
    api("POST", "/v1/models/tiny/start")
    r = api("DELETE", "/v1/models/tiny")
    assert r.status == 409
    api("POST", "/v1/models/tiny/stop")
    assert api("DELETE", "/v1/models/tiny").status == 200
    assert quantized["Q8_0"].is_file()  # it was linked, not moved


def shadowed_ids() -> list:
    """What follows /v1/models/ in every route path there that has no parameter."""
    prefix = "/v1/models/"
    return sorted({route.pattern[len(prefix):] for route in ROUTES
                   if route.pattern.startswith(prefix) and "{" not in route.pattern})


@pytest.mark.parametrize("reserved", shadowed_ids())
def test_ids_the_fixed_routes_shadow_cannot_be_registered(api, quantized, reserved):
    r = api("POST", "/v1/models/import", {"path": str(quantized["Q8_0"]), "id": reserved})
    assert r.status == 400 and r.json["error"]["param"] == "id"
    assert "another endpoint" in r.json["message"]
    r = api("POST", f"/v1/models/{reserved}/pull")  # the built-in model of that name
    assert r.status == 400 and r.json["error"]["param"] == "model"


def test_a_seed_of_all_ones_is_deterministic_too(api, tiny):
    body = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 12,
            "logit_bias": NO_EOS}
    for seed in (4294967295, 2 ** 33 - 1):
        texts = {chat(api, seed=seed, **body).json["choices"][0]["message"]["content"]
                 for _ in range(3)}
        assert len(texts) == 1, seed


def test_a_bad_stored_parameter_is_a_409_that_says_how_to_fix_it(api, tiny):
    api("PATCH", "/v1/models/tiny", {"cache_type": "q8_0"})
    r = chat(api)
    assert r.status == 409 and r.json["error"]["code"] == "invalid_stored_parameter"
    assert "localrt models update tiny" in r.json["message"]
    r = api("POST", "/v1/models/tiny/start", {"flash_attn": True})  # a request can fix it
    assert r.status == 200, r.body


def test_stop_takes_the_model_in_the_body_too(api, tiny):
    api("POST", "/v1/models/tiny/start")
    r = api("POST", "/v1/models/tiny/stop", {"model": "other"})
    assert r.status == 400 and r.json["error"]["param"] == "model"
    assert api("POST", "/models/tiny/stop", {"model": "tiny"}).status == 200
    r = api("POST", "/v1/models/stop", {})
    assert r.status == 400 and r.json["error"]["param"] == "model"


def test_developer_messages_are_system_messages(api, tiny):
    api("POST", "/v1/models/tiny/start",
        {"prompt_template": "<sys>{system_message}</sys>{prompt}"})
    as_developer = chat(api, messages=[{"role": "developer", "content": "be brief"}, *USER])
    as_system = chat(api, messages=[{"role": "system", "content": "be brief"}, *USER])
    # the second was cached
    assert as_developer.json["usage"] == {**as_system.json["usage"], "prompt_tokens_details":
                                          {"cached_tokens": 0, "audio_tokens": 0}}
    assert as_developer.json["choices"] == as_system.json["choices"]


def test_a_schema_llama_cpp_cannot_follow_is_a_400_before_the_model_starts(api, tiny):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}
    r = chat(api, response_format=fmt)
    assert r.status == 400 and r.json["error"]["param"] == "response_format"
    assert api("GET", "/v1/models/status").json["data"] == []  # nothing was started for it
