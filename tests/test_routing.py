"""Router.match is a pure function of (method, path)."""

import pytest

from localrt.errors import MethodNotAllowed, NotFound
from localrt.routing import Route, Router


def h(*a):
    return None


ROUTES = (
    Route("GET", "/v1/models/pull", h, None),
    Route("GET", "/v1/models/{model_id:path}", h, None),
    Route("POST", "/v1/models/{model_id:path}/start", h, "s.json"),
    Route("GET", "/engines/{engine}", h, None),
    Route("PATCH", "/v1/configs", h, "c.json"),
    Route("GET", "/v1/configs", h, None),
)
router = Router(ROUTES)


def test_literal_route_wins_by_order():
    route, params = router.match("GET", "/v1/models/pull")
    assert route is ROUTES[0] and params == {}


@pytest.mark.parametrize("model_id", ["tinyllama", "tinyllama:1b", "org/repo", "a/b:c.gguf"])
def test_path_parameter_takes_slashes_and_colons(model_id):
    route, params = router.match("POST", f"/v1/models/{model_id}/start")
    assert route is ROUTES[2] and params == {"model_id": model_id}
    route, params = router.match("GET", f"/v1/models/{model_id}")
    assert route is ROUTES[1] and params == {"model_id": model_id}


def test_segment_parameter_takes_one_segment():
    assert router.match("GET", "/engines/gguf-cpp")[1] == {"engine": "gguf-cpp"}
    with pytest.raises(NotFound):
        router.match("GET", "/engines/a/b")


def test_wrong_method_is_405_with_allow():
    with pytest.raises(MethodNotAllowed) as info:
        router.match("DELETE", "/v1/configs")
    assert set(info.value.allowed) == {"PATCH", "GET", "HEAD"}
    assert ("Allow", "PATCH, GET, HEAD") in info.value.headers
    assert info.value.status == 405


def test_unknown_path_is_404():
    with pytest.raises(NotFound) as info:
        router.match("GET", "/nope")
    assert info.value.status == 404


def test_head_matches_get():
    assert router.match("HEAD", "/v1/configs")[0] is ROUTES[5]


def test_no_partial_matches():
    with pytest.raises(NotFound):
        router.match("GET", "/v1/configsX")
    with pytest.raises(NotFound):
        router.match("GET", "/v1/configs/")
