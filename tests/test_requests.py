"""The one request path's shared pieces: the stream-error event, SSE framing, the
dialects' field names, and the event bus's in-process followers."""

import json
import logging

import pytest

from localrt.dialects import anthropic, ollama, responses
from localrt.dialects.common import NamedEvents
from localrt.errors import InvalidField, UpstreamError
from localrt.events import EventBus, TooManyListeners
from localrt.routing import EventStream, stream_error
from localrt.inference.running import ModelStopped
from localrt.routing import SSE_DONE, sse


def test_a_failure_part_way_is_an_event_with_a_code_and_no_raw_text(caplog):
    with caplog.at_level(logging.ERROR, logger="localrt.routing"):
        event = stream_error(RuntimeError("llama_decode returned -3 at /secret/path"), "m1")
    error = event["error"]
    assert error["code"] == "generation_failed" and error["type"] == "server_error"
    assert "m1" in error["message"] and "server log" in error["message"]
    assert "secret" not in json.dumps(event) and "-3" not in json.dumps(event)
    assert "/secret/path" in caplog.text  # the details stay in the log


def test_an_http_error_part_way_keeps_its_code_and_message():
    event = stream_error(ModelStopped("Model m1 was stopped during this reply"), "m1")
    assert event["error"]["code"] == "model_stopped"
    assert event["error"]["message"] == "Model m1 was stopped during this reply"
    assert stream_error(UpstreamError("Upstream http://u.invalid broke off"), "m")[
        "error"]["code"] == "upstream_error"


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'.encode()
    assert sse({"type": "ping"}, event="ping") == b'event: ping\ndata: {"type": "ping"}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_an_event_stream_frames_its_chunks_then_done():
    class Two(EventStream):
        def chunks(self):
            yield {"n": 1}
            yield {"error": {"code": "x"}}

        def close(self):
            pass

    assert b"".join(Two()) == sse({"n": 1}) + sse({"error": {"code": "x"}}) + SSE_DONE


def test_named_events_frame_each_with_its_name():
    class Native:
        closed = False

        def close(self):
            self.closed = True

    class Named(NamedEvents):
        def named(self):
            yield "message_start", {"type": "message_start"}

    native_stream = Native()
    stream = Named(native_stream)
    assert list(stream) == [sse({"type": "message_start"}, event="message_start")]
    stream.close()
    assert native_stream.closed


@pytest.mark.parametrize("fields, param, renamed", [
    (anthropic.FIELDS, "tools[2].function.parameters.properties", "tools[2].input_schema.properties"),
    (anthropic.FIELDS, "stop", "stop_sequences"),
    (anthropic.FIELDS, "messages[3].content[0]", "messages"),
    (responses.FIELDS, "messages[1].content", "input"),
    (responses.FIELDS, "max_tokens", "max_output_tokens"),
    (responses.FIELDS, "tools[0].function.name", "tools[0].name"),
    # a path inside a tool's schema keeps its tail (a grammar's bound names one)
    (responses.FIELDS, "tools[0].function.parameters.x", "tools[0].parameters.x"),
    (ollama.FIELDS, "response_format.json_schema.schema", "format"),
    (ollama.FIELDS, "max_tokens", "options.num_predict"),
    (ollama.GENERATE_FIELDS, "messages[0].content", "prompt"),
    (ollama.FIELDS, "temperature", "temperature"),
])
def test_each_dialect_names_chats_fields_its_own_way(fields, param, renamed):
    err = fields.rename(InvalidField(f"Invalid field '{param}': no", param=param))
    assert err.param == renamed
    assert err.message == f"Invalid field '{renamed}': no" == str(err)


def test_a_media_parts_own_path_is_not_renamed():
    """A Media part's `where` is the dialect's path already: an error naming it keeps it,
    where the dialect's rules would have renamed a native path of that shape."""
    request = anthropic.read({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x.invalid/a.png"}}]}]})
    [media] = request.media()
    assert media.where == "messages[0].content[0]"
    with pytest.raises(InvalidField) as caught:
        with anthropic.FIELDS.named(request):
            raise InvalidField(f"Invalid field '{media.where}': no", param=media.where)
    assert caught.value.param == "messages[0].content[0]"
    with pytest.raises(InvalidField) as caught:
        with anthropic.FIELDS.named(request):
            raise InvalidField("Invalid field 'messages[1].content': no",
                               param="messages[1].content")
    assert caught.value.param == "messages"


def test_a_follower_gets_its_tasks_events_and_is_not_a_listener():
    bus = EventBus(max_listeners=1)
    follower = bus.follow("t1")
    stream = bus.listen()  # the one listener slot is still free
    with pytest.raises(TooManyListeners):
        bus.listen()
    bus.publish("DownloadUpdated", task={"id": "t2"})
    bus.publish("DownloadSuccess", task={"id": "t1", "status": "Success"})
    assert next(follower) == {"type": "DownloadSuccess", "task": {"id": "t1",
                                                                  "status": "Success"}}
    follower.close()
    bus.publish("DownloadUpdated", task={"id": "t1"})
    assert len(bus._listeners) == 1  # the follower is gone once closed
    bus.close()
    assert next(bus.follow("t1"), None) is None  # a closed bus follows nothing
    del stream
