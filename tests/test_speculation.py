"""Speculative decoding from the context (localrt.engines.llama.drafting in the batched step),
on real llama.cpp with generated models.

Two kinds of model: ggufgen's scripted one, which always writes its script whatever
the prompt (a prompt that holds the script is a reply copied from the context, as an
edit is), and a random one whose replies do not repeat the prompt.
"""

from __future__ import annotations

import pytest
from emulators.ggufgen import _vocab, write_gguf
from support.apps import call
from support.models import NO_EOS, quantize
from support.servers import send

from localrt.engines.llama.drafting import prediction_counts
from localrt.engines.llama.model import LlamaModel

pytestmark = pytest.mark.live

SCRIPT = [t for t in _vocab(400)[0][300:340]][:30]
COPY_PROMPT = "Repeat this: " + "".join(SCRIPT).replace("\u2581", " ")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    copy = write_gguf(root / "copy.gguf", vocab_size=400, script=SCRIPT, n_embd=128,
                      context_length=1024)
    rnd = write_gguf(root / "random.gguf", vocab_size=400, n_embd=128, context_length=1024,
                     weight_scale=0.2)
    return {"copy": quantize(copy, root / "copy-Q8_0.gguf", "Q8_0"),
            "random": quantize(rnd, root / "random-Q4_0.gguf", "Q4_0")}


def load(path, **options) -> LlamaModel:
    return LlamaModel(str(path), {"ctx_len": 1024, "n_parallel": 4, **options})


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


def run(model, text, **params):
    gen = model.generate(user(text), {"temperature": 0, "max_tokens": 48,
                                      "logit_bias": NO_EOS, **params})
    return "".join(gen), gen.usage


def counting_steps(model):
    """Wrap the model's decode to count the steps that generate (not read a prompt)."""
    batch, decode, steps = model._batch, model._batch.decode, []

    def counted(entries):
        steps.append([e for e in entries if not e.reading])
        return decode(entries)

    batch.decode = counted
    return steps


@pytest.mark.parametrize("kind,text", [("copy", COPY_PROMPT), ("random", "Say something.")])
def test_greedy_and_seeded_replies_are_the_same_with_and_without_drafts(models, kind, text):
    on, off = load(models[kind]), load(models[kind], speculative="off")
    try:
        for params in ({}, {"temperature": 0.8, "seed": 11}):
            assert run(on, text, **params)[0] == run(off, text, **params)[0]
        assert run(on, text, speculative=False)[1].get("accepted_prediction_tokens") is None
    finally:
        on.unload()
        off.unload()


def test_a_copied_reply_takes_fewer_steps_and_acceptance_is_counted_right(models):
    model = load(models["copy"])
    try:
        steps = counting_steps(model)
        text, usage = run(model, COPY_PROMPT)
        generating = [s for s in steps if s]
        # each generating step gives its next token and the draft tokens it kept; the
        # prompt's step gave the first; an end token (<|im_end|>) is not counted as
        # completion, though it may be a kept draft token
        made = usage["completion_tokens"] + 1
        assert usage["accepted_prediction_tokens"] in (made - 1 - len(generating),
                                                       made - 2 - len(generating))
        assert len(generating) < usage["completion_tokens"] / 3
        counts = model.counters()
        assert counts["accepted"] == usage["accepted_prediction_tokens"]
        assert counts["drafted"] >= counts["accepted"] > 0
    finally:
        model.unload()


def test_a_prediction_that_matches_is_accepted_and_a_wrong_one_costs_no_output(models):
    script = "".join(SCRIPT).replace("\u2581", " ")
    model = load(models["copy"])
    predicted = len(model._model.tokenize(script.encode(), add_bos=False, special=False))
    try:  # the prompt does not hold the script: only the prediction can draft it
        plain, usage = run(model, "Write.", max_tokens=24)
        assert usage["accepted_prediction_tokens"] == 0
        assert "rejected_prediction_tokens" not in usage
        right, usage = run(model, "Write.", max_tokens=24, prediction=script)
        assert right == plain
        assert model.counters()["accepted"] >= 24 - 8  # the drafts came from it
        # OpenAI's counts: the 24 tokens of the reply were in the prediction, the rest
        # of it (its last words, and a lone leading space) not in the reply
        assert (usage["accepted_prediction_tokens"],
                usage["rejected_prediction_tokens"]) == (24, predicted - 24)
        # speculation off: the same counts, as they only compare the texts
        _, usage = run(model, "Write.", max_tokens=24, prediction=script, speculative=False)
        assert (usage["accepted_prediction_tokens"],
                usage["rejected_prediction_tokens"]) == (24, predicted - 24)
    finally:
        model.unload()
    model = load(models["random"])
    try:
        plain, _ = run(model, "Say something.", speculative=False)
        wrong = COPY_PROMPT * 2
        got, usage = run(model, "Say something.", prediction=wrong)
        assert got == plain
        total = len(model._model.tokenize(wrong.encode(), add_bos=False, special=False))
        assert usage["accepted_prediction_tokens"] + usage["rejected_prediction_tokens"] \
            == total
        assert usage["rejected_prediction_tokens"] > total // 2
    finally:
        model.unload()


def test_prediction_counts_are_openais():
    """Tokens of the prediction found in the reply (as often as the reply has them), and
    the rest of the prediction."""
    assert prediction_counts([1, 2, 3, 4], [1, 2, 3, 4]) == (4, 0)
    assert prediction_counts([1, 2, 9, 4], [1, 2, 3, 4, 5]) == (3, 1)
    assert prediction_counts([7, 7, 7], [7, 1]) == (1, 2)
    assert prediction_counts([], [1]) == (0, 0)


def test_four_sequences_mixing_copies_and_fresh_text_are_each_unchanged(models):
    prompts = [("copy", COPY_PROMPT), ("copy", "Again: " + COPY_PROMPT),
               ("random", "one"), ("random", "two")]
    for kind in ("copy", "random"):
        on, off = load(models[kind]), load(models[kind], speculative="off")
        try:
            expected = [run(off, text)[0] for _, text in prompts]
            gens = [on.generate(user(text), {"temperature": 0, "max_tokens": 48,
                                              "logit_bias": NO_EOS}) for _, text in prompts]
            out, iters = ["" for _ in gens], [iter(g) for g in gens]
            live = set(range(len(gens)))
            while live:
                for i in sorted(live):
                    try:
                        out[i] += next(iters[i])
                    except StopIteration:
                        live.discard(i)
            assert out == expected
        finally:
            on.unload()
            off.unload()


def test_the_api_reports_drafts_in_usage_status_and_metrics(app, api, models):
    r = api("POST", "/v1/models/import", {"path": str(models["copy"]), "id": "copy",
                                          "option": "symlink"})
    assert r.status == 200, r.body
    body = {"model": "copy", "messages": user(COPY_PROMPT), "max_tokens": 40,
            "temperature": 0, "logit_bias": NO_EOS}
    r = api("POST", "/v1/chat/completions", body)
    assert r.status == 200, r.body
    details = r.json["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 20
    assert details["rejected_prediction_tokens"] == 0
    row = api("GET", "/v1/models/status").json["data"][0]
    assert row["speculative"]["accepted"] == details["accepted_prediction_tokens"]
    text = call(app, "GET", "/metrics").body.decode()
    assert f'localrt_draft_tokens_accepted_total{{model="copy"}} ' \
           f'{details["accepted_prediction_tokens"]}' in text
    off = api("POST", "/v1/chat/completions", {**body, "speculative": False})
    assert off.json["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    assert off.json["choices"][0]["message"] == r.json["choices"][0]["message"]
    api("POST", "/v1/models/copy/stop")
    assert api("POST", "/v1/models/copy/start", {"speculative": "off"}).status == 200
    again = api("POST", "/v1/chat/completions", body)
    assert again.json["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    bad = api("POST", "/v1/models/copy/start", {"speculative": "sometimes"})
    assert bad.status == 400 and bad.json["error"]["param"] == "speculative"
    bad = api("POST", "/v1/chat/completions", {**body, "prediction": {"type": "x"}})
    assert bad.status == 400 and bad.json["error"]["param"].startswith("prediction")


def test_the_openai_sdk_sends_a_prediction_and_reads_its_counts(live_server, models):
    """OpenAI's own client: `prediction` as its editors send it, and the usage counts
    read back as its types declare them, whole and streamed."""
    import openai

    send(live_server.url, "POST", "/v1/models/import",
         {"path": str(models["copy"]), "id": "copy", "option": "symlink"})
    script = "".join(SCRIPT).replace("\u2581", " ")
    ask = dict(model="copy", messages=user("Write."), max_tokens=24, temperature=0,
               logit_bias=NO_EOS, prediction={"type": "content", "content": script})
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused",
                       max_retries=0, timeout=120) as client:
        whole = client.chat.completions.create(**ask)
        details = whole.usage.completion_tokens_details
        assert details.accepted_prediction_tokens == 24  # every token of the reply
        assert details.rejected_prediction_tokens > 0  # the script's last words
        assert whole.choices[0].message.content.strip() == \
            "".join(SCRIPT[:24]).replace("\u2581", " ").strip()
        chunks = list(client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage.completion_tokens_details == details
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
            == whole.choices[0].message.content


def test_a_drafter_proposes_what_followed_and_sizes_its_drafts_by_their_fate():
    from localrt.engines.llama.drafting import REST, Drafter

    d = Drafter([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])
    assert d.propose(16) == [4, 5, 6, 7]  # after the last 1 2 3: the first size is 4
    d.settle(4, 4)
    d.extend([4, 5, 6, 7, 8])
    assert d.propose(16) == [9, 1, 2, 3, 4, 5, 6, 7]  # doubled
    assert d.propose(3) == [9, 1, 2]  # never more than the room
    d.settle(8, 1)
    assert d.size == 4  # twice what it kept, and two
    for size in (2, 1):
        d.settle(d.size, 0)
        assert d.size == size
    d.settle(1, 0)  # nothing kept at size 1: it rests
    assert [d.propose(16) for _ in range(REST)] == [[]] * REST
    assert d.propose(16) == [9]
    assert Drafter([5, 6, 7]).propose(16) == []  # nothing seen twice
    predicted = Drafter([1, 2], prediction=[1, 2, 30, 31, 32])
    assert predicted.propose(16) == [30, 31, 32]
