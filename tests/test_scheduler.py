"""The scheduler on its own (localrt.inference.scheduler.Scheduler): starting models,
leases and their turns, keep-alive, maxRunningModels and stopping, driven through its
own methods on real llama.cpp (conftest's tiny Q8_0 model, imported under several ids).

Each test's scheduler is its app's (`app.services.scheduler`), built from the settings
as the server builds it; only the imports go through the API.
"""

from __future__ import annotations

import math
import threading

import pytest
from support.apps import bind
from support.models import add_model
from support.waiting import Leaving, wait_for

from localrt import settings as settings_mod
from localrt.app import create_app
from localrt.errors import HTTPError

pytestmark = pytest.mark.live

START = {"cpu_threads": 1, "ctx_len": 128}


@pytest.fixture
def scheduler(app, tiny):
    return app.services.scheduler


def running_ids(scheduler) -> set:
    return {row["id"] for row in scheduler.status()}


def row_of(scheduler, model_id) -> dict:
    return {row["id"]: row for row in scheduler.status()}[model_id]


@pytest.fixture
def several(home, quantized):
    """A function making the scheduler of an app with these settings overridden, with
    "a", "b" and "c" imported (the tiny model each); the apps close after the test."""
    apps = []

    def make(**overrides):
        settings = settings_mod.load(environ={"HOME": str(home)})
        settings.override(**overrides)
        app = create_app(settings)
        apps.append(app)
        for model_id in ("a", "b", "c"):
            add_model(bind(app), quantized["Q8_0"], model_id, option="symlink")
        return app.services.scheduler

    yield make
    for app in apps:
        app.close()


# --- start ---------------------------------------------------------------------------


def test_start_loads_once_with_the_effective_options(scheduler):
    running, fresh = scheduler.start("tiny", START)
    assert fresh and scheduler.is_running("tiny")
    again, fresh = scheduler.start("tiny", {"ctx_len": 64})
    assert again is running and not fresh  # not loaded twice, whatever the options
    row = row_of(scheduler, "tiny")
    assert (row["engine"], row["options"]["ctx_len"], row["requests"]) == ("gguf-cpp", 128, 0)
    assert row["slots"] == 4  # n_parallel, when nothing says otherwise
    assert scheduler.loaded("tiny") is running.model


def test_a_bad_option_is_refused_before_anything_loads(scheduler):
    with pytest.raises(HTTPError) as refused:
        scheduler.start("tiny", {"ctx_len": 100000})
    assert refused.value.status == 400 and refused.value.param == "ctx_len"
    assert not scheduler.is_running("tiny")


def test_what_is_not_running_is_a_409_and_what_is_not_there_a_404(scheduler):
    for call in (lambda: scheduler.stop("tiny"), lambda: scheduler.loaded("tiny")):
        with pytest.raises(HTTPError) as refused:
            call()
        assert (refused.value.status, refused.value.code) == (409, "model_not_running")
    with pytest.raises(HTTPError) as refused:
        scheduler.stop("nope")
    assert refused.value.status == 404


# --- leases ---------------------------------------------------------------------------


def test_a_lease_starts_the_model_and_holds_a_request_until_released(scheduler):
    lease = scheduler.lease("tiny")  # starts it with its stored parameters
    try:
        assert scheduler.is_running("tiny") and row_of(scheduler, "tiny")["requests"] == 1
        assert lease.model is scheduler.loaded("tiny")
    finally:
        lease.release()
    assert row_of(scheduler, "tiny")["requests"] == 0
    lease.release()  # a second release gives nothing back twice
    assert row_of(scheduler, "tiny")["requests"] == 0


def test_past_its_slots_a_lease_waits_in_arrival_order(scheduler):
    scheduler.start("tiny", {**START, "n_parallel": 1})
    held = scheduler.lease("tiny")
    turn = held.running.turn  # the model's slots, one here
    order, threads = [], []
    for i in range(3):
        def take(i=i):
            lease = scheduler.lease("tiny")
            order.append(i)
            lease.release()

        threads.append(threading.Thread(target=take, daemon=True))
        threads[-1].start()
        wait_for(lambda: turn.waiting == i + 1, what=f"lease {i} in the queue")
    # Each found the one slot held and queued: only a release lets one out.
    assert order == [] and row_of(scheduler, "tiny")["requests"] == 4
    held.release()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert order == [0, 1, 2] and row_of(scheduler, "tiny")["requests"] == 0


def test_a_lease_whose_client_leaves_while_waiting_gives_its_place_up(scheduler):
    scheduler.start("tiny", {**START, "n_parallel": 1})
    held = scheduler.lease("tiny")
    leaving, failed = Leaving(), []

    def take():
        try:
            scheduler.lease("tiny", disconnected=leaving)
        except HTTPError as exc:
            failed.append(exc.code)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    wait_for(lambda: held.running.turn.waiting == 1, what="the lease in the queue")
    leaving.leave()
    thread.join(30)
    assert not thread.is_alive() and failed == ["client_disconnected"]
    assert row_of(scheduler, "tiny")["requests"] == 1  # only the held one
    held.release()


# --- keep-alive -------------------------------------------------------------------------


def test_keep_for_0_unloads_an_idle_model_now(scheduler):
    scheduler.start("tiny", START)
    scheduler.keep_for("tiny", 0)
    assert not scheduler.is_running("tiny")
    scheduler.keep_for("tiny", 0)  # a model that is not running is left alone


def test_keep_for_0_waits_for_the_requests_under_way(scheduler):
    scheduler.start("tiny", START)
    lease = scheduler.lease("tiny")
    scheduler.keep_for("tiny", 0)
    scheduler.reap()  # what unloads idle models, now: this one is busy
    assert scheduler.is_running("tiny")
    lease.release()
    wait_for(lambda: not scheduler.is_running("tiny"), what="the unload once idle")


def test_keep_for_a_while_unloads_once_idle_that_long(scheduler):
    scheduler.start("tiny", START)
    scheduler.keep_for("tiny", math.inf)
    assert row_of(scheduler, "tiny")["expiresAt"] is None  # until stopped
    scheduler.reap()
    assert scheduler.is_running("tiny")
    scheduler.keep_for("tiny", 0.2)
    expires = row_of(scheduler, "tiny")["expiresAt"]
    assert expires is not None
    wait_for(lambda: not scheduler.is_running("tiny"), what="the unload 0.2 s after")


def test_keep_for_none_is_the_servers_keep_alive_again(several):
    scheduler = several(keepAlive="1h")
    scheduler.start("a", START)
    scheduler.keep_for("a", math.inf)
    assert row_of(scheduler, "a")["expiresAt"] is None
    scheduler.keep_for("a", None)
    expires = row_of(scheduler, "a")["expiresAt"]
    assert expires is not None and expires > row_of(scheduler, "a")["startedAt"] + 3500


# --- maxRunningModels -------------------------------------------------------------------


def test_past_max_running_models_the_least_recently_used_idle_one_goes(several):
    scheduler = several(maxRunningModels=2)
    scheduler.start("a", START)
    scheduler.start("b", START)
    scheduler.lease("a").release()  # a is now used more recently than b
    scheduler.start("c", START)
    assert running_ids(scheduler) == {"a", "c"}


def test_with_every_model_busy_a_start_waits_rather_than_cut_a_reply(several):
    scheduler = several(maxRunningModels=1)
    scheduler.start("a", START)
    lease = scheduler.lease("a")
    leaving, failed = Leaving(), []

    def start_b():
        try:
            scheduler.start("b", START, disconnected=leaving)
        except HTTPError as exc:
            failed.append(exc.code)

    thread = threading.Thread(target=start_b, daemon=True)
    thread.start()
    leaving.leave()  # the start gives up only while it waits for room
    thread.join(30)
    assert not thread.is_alive() and failed == ["client_disconnected"]
    assert running_ids(scheduler) == {"a"}
    lease.release()
    scheduler.start("b", START)  # a is idle now: it makes room
    assert running_ids(scheduler) == {"b"}


# --- stop, and what it guards -----------------------------------------------------------


def test_stop_while_leased_waits_for_the_lease_and_ends_its_reply(scheduler):
    scheduler.start("tiny", {**START, "n_parallel": 1})
    lease = scheduler.lease("tiny")
    stopper = threading.Thread(target=scheduler.stop, args=("tiny",), daemon=True)
    stopper.start()
    # The stop queued for the slot the lease holds: the model unloads after the reply.
    wait_for(lambda: lease.running.turn.waiting == 1, what="the stop waiting for the slot")
    assert not scheduler.is_running("tiny")  # no new request gets it meanwhile
    with pytest.raises(HTTPError) as stopped:
        lease.run(len, "the lease's next step")
    assert stopped.value.code == "model_stopped"
    lease.release()
    stopper.join(30)
    assert not stopper.is_alive()
    again = scheduler.lease("tiny")  # starts it afresh
    try:
        assert again.model is scheduler.loaded("tiny") and again.model is not lease.model
    finally:
        again.release()


def test_not_running_and_engine_unused_refuse_while_the_model_runs(scheduler):
    scheduler.start("tiny", START)
    for guard in (scheduler.not_running("tiny"), scheduler.engine_unused("gguf-cpp")):
        with pytest.raises(HTTPError) as refused:
            with guard:
                pytest.fail("the body ran")
        assert refused.value.status == 409
    ran = []
    with scheduler.not_running("other"):  # each holds off loads: one at a time
        ran.append("not_running")
    with scheduler.engine_unused("onnx-runtime"):
        ran.append("engine_unused")
    scheduler.stop("tiny")
    with scheduler.not_running("tiny"):
        ran.append("not_running after the stop")
    with scheduler.engine_unused("gguf-cpp"):
        ran.append("engine_unused after the stop")
    assert len(ran) == 4 and scheduler.models_of("gguf-cpp") == []


def test_after_close_nothing_starts(several):
    scheduler = several()
    scheduler.start("a", START)
    scheduler.close()
    assert running_ids(scheduler) == set() and scheduler.closed
    for call in (lambda: scheduler.lease("a"), lambda: scheduler.start("b", START)):
        with pytest.raises(HTTPError) as refused:
            call()
        assert refused.value.status == 503
