"""llama-server's utility routes (localrt.inference.utility) on real llama.cpp: POST
/tokenize, /detokenize (and their /v1/ names), /apply-template, GET /props and /slots.

Each is checked against llama-cpp-python's own tokenizer and template rendering on a
tiny generated GGUF (tests/emulators/ggufgen.py: a SentencePiece vocabulary with byte
tokens and ChatML's control tokens, and ChatML's template), and /apply-template
against the prompt localrt's chat path reads (its usage.prompt_tokens), with tools on
a model carrying Qwen 2.5's real template. Then the errors: a model that is not
running (409 model_not_running, and nothing starts), an unknown one (404), a model
left out, and the API key on /slots.
"""

from __future__ import annotations

import threading

import pytest
from emulators.ggufgen import CHATML_TEMPLATE, write_gguf
from support.apps import call
from support.models import NO_EOS, add_model
from support.waiting import wait_for

from localrt.dialects import openai

pytestmark = pytest.mark.live

TEXTS = ["Hello world", "<|im_start|>user\nhi there<|im_end|>", "", "  tab\tand 12, ok!",
         "caf\u00e9 \u00e1"]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
# Every utility route: (method, path, body or query) naming model MODEL.
ROUTES = [("POST", "/tokenize", {"content": "hi"}), ("POST", "/v1/tokenize", {"content": "hi"}),
          ("POST", "/detokenize", {"tokens": [5]}), ("POST", "/v1/detokenize", {"tokens": [5]}),
          ("POST", "/apply-template", {"messages": MESSAGES}),
          ("GET", "/props", None), ("GET", "/slots", None)]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """The tiny ChatML model's file."""
    return write_gguf(tmp_path_factory.mktemp("utility") / "tiny.gguf", name="tiny")


@pytest.fixture(scope="module")
def llm(gguf):
    """llama-cpp-python's own tokenizer of that file (its vocabulary only)."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    yield vocab
    vocab.close()


@pytest.fixture
def tiny(api, gguf):
    """The model imported as "tiny" and started with two slots of 128 tokens."""
    return add_model(api, gguf, "tiny", option="symlink",
                     start={"n_parallel": 2, "ctx_len": 128})


def send(api, method, path, body=None, model="tiny", **kwargs):
    """One utility request naming `model`: in the body of a POST, as ?model= on a GET."""
    if method == "GET":
        return api(method, path, query=f"model={model}" if model else "", **kwargs)
    return api(method, path, {**({"model": model} if model else {}), **body}, **kwargs)


def expected_piece(llm, token: int):
    """A token's piece as llama-server writes it, from llama-cpp-python's own bytes."""
    data = llm.detokenize([token], special=True)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_tokenize_gives_llama_cpp_pythons_tokens(api, tiny, llm, path):
    for text in TEXTS:
        r = send(api, "POST", path, {"content": text})  # add_special false, parse_special true
        assert r.status == 200, r.body
        assert r.json == {"tokens": llm.tokenize(text.encode(), add_bos=False, special=True)}
        for add_special in (False, True):
            for parse_special in (False, True):
                r = send(api, "POST", path, {"content": text, "add_special": add_special,
                                             "parse_special": parse_special})
                assert r.json["tokens"] == llm.tokenize(text.encode(), add_bos=add_special,
                                                        special=parse_special), text
    # The flags matter on this vocabulary: a BOS, and <|im_start|> read as one token.
    control = TEXTS[1]
    assert send(api, "POST", path, {"content": "Hi", "add_special": True}).json["tokens"][0] \
        == llm.token_bos()
    parsed = send(api, "POST", path, {"content": control}).json["tokens"]
    plain = send(api, "POST", path, {"content": control, "parse_special": False}).json["tokens"]
    assert len(parsed) < len(plain)


def test_with_pieces_gives_each_tokens_text_or_its_bytes(api, tiny, llm):
    text = "<|im_start|>caf\u00e9 \u00e1"
    r = send(api, "POST", "/tokenize", {"content": text, "with_pieces": True})
    assert r.status == 200, r.body
    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    assert r.json == {"tokens": [{"id": t, "piece": expected_piece(llm, t)} for t in tokens]}
    pieces = [entry["piece"] for entry in r.json["tokens"]]
    assert pieces[0] == "<|im_start|>"  # a special token as its text
    # The vocabulary has no "\u00e9" nor "\u00e1": their UTF-8 bytes are byte tokens, each
    # piece the list of its byte, as llama-server writes a piece that is not UTF-8.
    assert [0xC3] in pieces and [0xA9] in pieces and [0xA1] in pieces


@pytest.mark.parametrize("path", ["/detokenize", "/v1/detokenize"])
def test_detokenize_gives_the_pieces_text(api, tiny, llm, path):
    for text in TEXTS:
        tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
        r = send(api, "POST", path, {"tokens": tokens})
        assert r.status == 200, r.body
        assert r.json == {"content": llm.detokenize(tokens, special=True).decode()}
    for text in ("Hello world", "caf\u00e9 \u00e1"):  # back, but SentencePiece's first space
        tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert send(api, "POST", path, {"tokens": tokens}).json == {"content": " " + text}
    assert send(api, "POST", path, {"tokens": []}).json == {"content": ""}
    # A JSON integer may be written 5.0.
    assert send(api, "POST", path, {"tokens": [5.0]}).json == \
        {"content": llm.detokenize([5], special=True).decode()}
    byte = llm.tokenize("\u00e1".encode(), add_bos=False, special=True)[-1]  # <0xA1>
    assert send(api, "POST", path, {"tokens": [byte]}).json == {"content": "\ufffd"}


@pytest.mark.parametrize("bad", [-1, 320, 10**12])
def test_a_token_outside_the_vocabulary_is_a_400_naming_it(api, tiny, bad):
    r = send(api, "POST", "/detokenize", {"tokens": [5, 6, bad]})
    assert r.status == 400, r.body
    assert r.json["error"]["param"] == "tokens[2]" and str(bad) in r.json["message"]


def test_apply_template_renders_as_llama_cpp_python_and_the_chat_path_read(api, tiny, llm):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    r = send(api, "POST", "/apply-template", {"messages": MESSAGES, "temperature": 0.5})
    assert r.status == 200, r.body
    own = Jinja2ChatFormatter(CHATML_TEMPLATE, eos_token="</s>", bos_token="<s>")
    assert r.json == {"prompt": own(messages=MESSAGES).prompt}
    assert r.json["prompt"].endswith("<|im_start|>assistant\n")
    chat = api("POST", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES,
                                                "max_tokens": 1})
    assert chat.status == 200, chat.body
    read = llm.tokenize(r.json["prompt"].encode(), add_bos=False, special=True)
    assert chat.json["usage"]["prompt_tokens"] == len(read)


def test_apply_template_shows_the_tools_as_the_chat_renders_them(api, family_models):
    add_model(api, family_models["qwen25"], "qwen25", start={"n_parallel": 1,
                                                            "ctx_len": 2048})
    body = {"messages": MESSAGES, "tools": [WEATHER]}
    r = send(api, "POST", "/apply-template", body, model="qwen25")
    assert r.status == 200, r.body
    prompt = r.json["prompt"]
    assert "get_weather" in prompt and "What is the weather in Paris?" in prompt
    bare = send(api, "POST", "/apply-template", {"messages": MESSAGES}, model="qwen25")
    assert "get_weather" not in bare.json["prompt"]
    chat = api("POST", "/v1/chat/completions", {"model": "qwen25", "max_tokens": 1, **body})
    assert chat.status == 200, chat.body
    tokens = send(api, "POST", "/tokenize", {"content": prompt}, model="qwen25").json["tokens"]
    assert chat.json["usage"]["prompt_tokens"] == len(tokens)


def test_props_say_the_models_context_slots_template_and_build(api, tiny, gguf):
    api("PATCH", "/v1/models/tiny", {"temperature": 0.3})
    for query in ("model=tiny", ""):  # the one running model when none is named
        r = api("GET", "/props", query=query)
        assert r.status == 200, r.body
        props = r.json
        assert props["model"] == "tiny" and props["engine"] == "gguf-cpp"
        assert props["default_generation_settings"]["n_ctx"] == 128
        assert props["default_generation_settings"]["params"]["temperature"] == 0.3
        assert props["total_slots"] == 2
        assert props["chat_template"] == CHATML_TEMPLATE
        assert props["modalities"] == {"vision": False, "audio": False}
        assert props["build_info"].startswith("localrt ") and "gguf-cpp/" in props["build_info"]
        assert props["model_path"].endswith("tiny.gguf") and props["is_sleeping"] is False
        assert "media_marker" not in props  # no projector


def test_slots_say_what_each_slot_holds(app, api, tiny):
    r = send(api, "GET", "/slots")
    assert r.status == 200, r.body
    assert r.json == [{"id": i, "state": "idle", "n_ctx": 128, "prompt_tokens": 0,
                       "cached_tokens": 0} for i in range(2)]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "logit_bias": NO_EOS}
    chat = api("POST", "/v1/chat/completions", body)
    assert chat.status == 200, chat.body
    prompt = chat.json["usage"]["prompt_tokens"]
    rows = send(api, "GET", "/slots").json
    used = [row for row in rows if row["prompt_tokens"]]
    assert len(used) == 1 and used[0]["state"] == "idle"
    assert used[0]["prompt_tokens"] == prompt
    # The KV cache holds the prompt and the reply but its last token (never decoded).
    assert prompt <= used[0]["cached_tokens"] <= prompt + 4
    # A streamed reply's generation holds its slot while it is read: the tokens come as
    # the reader asks for them, so it is still processing after its first chunk.
    stream = openai.chat(app.services.chats, {**body, "max_tokens": 100, "stream": True})
    try:
        chunks = iter(stream)
        for _ in range(3):  # the role's chunk, then two of the reply's
            next(chunks)
        rows = send(api, "GET", "/slots").json
        assert sorted(row["state"] for row in rows) == ["idle", "processing"]
        busy = next(row for row in rows if row["state"] == "processing")
        assert busy["prompt_tokens"] == prompt
        assert api("GET", "/slots", query="model=tiny&fail_on_no_slot=1").status == 200
        other = openai.chat(app.services.chats, {**body, "max_tokens": 100, "stream": True})
        try:
            more = iter(other)
            for _ in range(3):
                next(more)
            r = api("GET", "/slots", query="model=tiny&fail_on_no_slot=1")
            assert r.status == 503 and "tiny" in r.json["message"]
        finally:
            other.close()
    finally:
        stream.close()
    assert [row["state"] for row in send(api, "GET", "/slots").json] == ["idle", "idle"]


def test_a_model_that_is_not_running_is_a_409_and_is_not_started(api, gguf):
    add_model(api, gguf, "tiny", option="symlink")
    for method, path, body in ROUTES:
        r = send(api, method, path, body)
        assert r.status == 409, (path, r.body)
        assert r.json["error"]["code"] == "model_not_running" and "tiny" in r.json["message"]
        assert r.json["error"]["param"] == "model"
    assert api("GET", "/v1/models/status").json["data"] == []
    assert api("POST", "/v1/models/tiny/start", {"cpu_threads": 1}).status == 200
    assert send(api, "POST", "/tokenize", {"content": "hi"}).status == 200
    assert api("POST", "/v1/models/tiny/stop", {}).status == 200
    assert send(api, "GET", "/slots").json["error"]["code"] == "model_not_running"


def test_an_unknown_model_is_a_404(api, tiny):
    for method, path, body in ROUTES:
        r = send(api, method, path, body, model="nope")
        assert r.status == 404, (path, r.body)
        assert r.json["error"]["code"] == "model_not_found" and "nope" in r.json["message"]


def test_a_model_left_out_is_the_one_running(api, tiny, gguf, llm):
    r = send(api, "POST", "/tokenize", {"content": "Hello"}, model=None)
    assert r.json == {"tokens": llm.tokenize(b"Hello", add_bos=False, special=True)}
    add_model(api, gguf, "second", option="symlink", start={"ctx_len": 64})
    for method, path, body in ROUTES:
        r = send(api, method, path, body, model=None)
        assert r.status == 400, (path, r.body)
        assert r.json["error"]["param"] == "model" and "second, tiny" in r.json["message"]
    api("POST", "/v1/models/tiny/stop", {})
    api("POST", "/v1/models/second/stop", {})
    r = send(api, "GET", "/props", model=None)
    assert r.status == 400 and "no model is running" in r.json["message"]


def test_slots_and_the_other_routes_need_the_api_key(api, tiny, settings):
    settings.update({"apiKeys": ["k-utility"]})
    for method, path, body in ROUTES:
        r = send(api, method, path, body)
        assert r.status == 401 and r.json["error"]["code"] == "unauthorized", path
    r = send(api, "GET", "/slots", headers={"Authorization": "Bearer k-utility"})
    assert r.status == 200 and len(r.json) == 2


def test_bodies_are_checked_against_their_schemas(api):
    for path, body, field in (("/tokenize", {"content": 5}, "content"),
                              ("/tokenize", {}, "content"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens"),
                              ("/apply-template", {"messages": "hi"}, "messages")):
        r = api("POST", path, body)
        assert r.status == 400 and field in r.json["message"], (path, r.body)
    assert api("GET", "/props", query="model=bad%0Aid").status == 400


def test_a_model_stopped_during_a_read_unloads_once_the_read_ends(app, tiny, llm):
    """Scheduler.using: the routes read the model outside its turns, so its unload waits
    for them; the vocabulary stays readable until the read ends."""
    scheduler = app.services.scheduler
    with scheduler.using("tiny") as use:
        stopper = threading.Thread(target=scheduler.stop, args=("tiny",))
        stopper.start()
        wait_for(lambda: not scheduler.is_running("tiny"), what="the stop begun")
        assert stopper.is_alive()  # the unload waits for this read
        assert use.model.encode("Hello", False, True) == \
            llm.tokenize(b"Hello", add_bos=False, special=True)
    stopper.join(30)
    assert not stopper.is_alive()
    assert call(app, "POST", "/tokenize", {"model": "tiny", "content": "x"}).status == 409


def test_an_embedding_model_tokenizes_and_its_slots_have_no_counts(api, tmp_path):
    """llama.cpp's embedding mode (LlamaEmbedder) has a vocabulary but no chat slots:
    /tokenize and /detokenize as llama-cpp-python's, /slots from the requests in it,
    its counts null, and /apply-template a 400 naming the model."""
    import llama_cpp
    from emulators.ggufgen import write_bert_gguf

    path = write_bert_gguf(tmp_path / "bert.gguf")
    add_model(api, path, "bert", start={})
    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for add_special in (False, True):
            r = send(api, "POST", "/tokenize", {"content": "the cat sat",
                                                "add_special": add_special}, model="bert")
            assert r.status == 200, r.body
            tokens = vocab.tokenize(b"the cat sat", add_bos=add_special, special=True)
            assert r.json == {"tokens": tokens}
        r = send(api, "POST", "/detokenize", {"tokens": tokens}, model="bert")
        assert r.json == {"content": vocab.detokenize(tokens, special=True).decode()}
    finally:
        vocab.close()
    r = send(api, "GET", "/slots", model="bert")
    assert r.status == 200, r.body
    assert r.json == [{"id": 0, "state": "idle", "n_ctx": 128, "prompt_tokens": None,
                       "cached_tokens": None}]
    props = send(api, "GET", "/props", model="bert").json
    assert props["chat_template"] == "" and props["total_slots"] == 1
    r = send(api, "POST", "/apply-template", {"messages": MESSAGES}, model="bert")
    assert r.status == 400 and r.json["error"]["param"] == "model", r.body


def test_a_vision_models_props_and_its_images_in_the_prompt(api, tmp_path):
    """A model with a projector: vision among its modalities, and an image of a chat's
    messages in /apply-template's prompt as the projector's marker, where chat puts it."""
    import base64

    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from support.vision import png, write_vision_pair

    model, mmproj = write_vision_pair(tmp_path)
    add_model(api, model, "eye", mmproj=str(mmproj), start={"ctx_len": 512})
    props = send(api, "GET", "/props", model="eye").json
    assert props["modalities"] == {"vision": True, "audio": False}
    marker = props["media_marker"]
    assert marker.startswith("<__image_")
    image = "data:image/png;base64," + base64.b64encode(png(8, 8, 0)).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Describe it."},
        {"type": "image_url", "image_url": {"url": image}}]}]
    r = send(api, "POST", "/apply-template", {"messages": messages}, model="eye")
    assert r.status == 200, r.body
    own = Jinja2ChatFormatter(CHATML_TEMPLATE, eos_token="</s>", bos_token="<s>")
    shown = [{"role": "user", "content": "Describe it.\n" + marker}]
    assert r.json == {"prompt": own(messages=shown).prompt}
    # The tiny ChatML model has no projector: an image is refused before anything reads it.
    add_model(api, write_gguf(tmp_path / "blind.gguf"), "blind", start={"ctx_len": 64})
    r = send(api, "POST", "/apply-template", {"messages": messages}, model="blind")
    assert r.status == 400 and r.json["error"]["code"] == "images_not_supported", r.body
