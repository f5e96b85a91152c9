"""localrt.native: the request every dialect reads into and the events every reply is
made of; `collect` folds a reply whole."""

import pytest

from localrt import native
from localrt.errors import UpstreamError


def test_collect_folds_text_reasoning_calls_and_the_end():
    events = [native.Reasoning("think "), native.Reasoning("hard"), native.Text("Hel"),
              native.Logprobs(["a"]), native.Text("lo"),
              native.CallStart(0, "c1", "get_weather"), native.CallArgs(0, '{"city"'),
              native.CallArgs(0, ': "Paris"}'), native.CallStart(1, "c2", "get_time"),
              native.Logprobs(["b"]), native.Finish("tool_calls"),
              native.Usage(7, 5, cached_tokens=2)]
    whole = native.collect(events)
    assert whole.text == "Hello" and whole.reasoning == "think hard"
    assert whole.calls == [native.ToolCall("c1", "get_weather", '{"city": "Paris"}'),
                           native.ToolCall("c2", "get_time", "")]
    assert whole.logprobs == ["a", "b"] and whole.finish == "tool_calls"
    assert whole.usage == native.Usage(7, 5, cached_tokens=2)


def test_collect_of_nothing_is_an_empty_reply_that_stopped():
    whole = native.collect([])
    assert (whole.text, whole.calls, whole.logprobs, whole.finish, whole.usage) == \
        ("", [], None, "stop", None)
    assert native.collect([native.Finish("stop", "END")]).stop_sequence == "END"


def test_collect_raises_what_broke_the_reply():
    with pytest.raises(UpstreamError):
        native.collect([native.Text("a"), native.Failed(UpstreamError("gone"))])


def test_a_message_joins_its_text_and_keeps_its_media_in_order():
    image = native.Media(b"\x89PNG", "image/png", "messages[0].content[1]")
    message = native.Message("user", [native.Text("a"), image, native.Text("b")])
    assert message.text == "a\nb" and message.media == [image] and image.kind == "image"
    request = native.Request("m", [message, native.Message("assistant", [native.Text("x")])])
    assert list(request.media()) == [image]


def test_a_reply_closes_once_asked_and_says_its_prompt_tokens():
    closed = []
    reply = native.Reply(iter([native.Text("x")]), lambda: closed.append(1), lambda: 12)
    assert reply.prompt_tokens == 12 and list(reply.events()) == [native.Text("x")]
    reply.close()
    assert closed == [1]
