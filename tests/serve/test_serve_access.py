"""Who may talk to the server (issue 15, weaker points): the API key, the Host allow-list, the Origin check,
/docs off by default, and no local path in any answer."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from serve_testkit import FAST, WARN, client_for, make_app, passed_doctor

from ditq.serve.access import default_allowed_hosts, exposure_warning, hostname

GENERATIONS = "/v1/images/generations"
KEY = "sk-test-0123456789"
LOOPBACK = ("localhost", "127.0.0.1", "::1")


def error_code(response: Any) -> str:
    return str(response.json()["error"]["code"])


@pytest.fixture(scope="module")
def keyed() -> Any:
    with client_for(make_app(dataclasses.replace(WARN, api_key=KEY))) as client:
        yield client


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer"], ids=str
)
def test_a_missing_or_wrong_key_is_401(keyed: Any, authorization: str | None) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    response = keyed.post(GENERATIONS, json={"prompt": "a", **FAST}, headers=headers)
    assert response.status_code == 401 and error_code(response) == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"


def test_the_right_key_is_served_and_health_stays_open(keyed: Any) -> None:
    bearer = {"authorization": f"Bearer {KEY}"}
    assert keyed.post(GENERATIONS, json={"prompt": "a", **FAST}, headers=bearer).status_code == 200
    assert keyed.get("/health").status_code == 200  # load balancers and the sweep poll it without a key
    assert keyed.get("/metrics").status_code == 401
    assert keyed.get("/metrics", headers=bearer).status_code == 200
    assert keyed.get("/v1/models").status_code == 401


@pytest.fixture(scope="module")
def loopback_only() -> Any:
    with client_for(make_app(dataclasses.replace(WARN, allowed_hosts=LOOPBACK))) as client:
        yield client


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("localhost:8091", 200),
        ("127.0.0.1:8091", 200),
        ("[::1]:8091", 200),
        ("LOCALHOST.", 200),
        ("attacker.example:8091", 400),
        ("127.0.0.1.nip.io", 400),
        ("", 400),
    ],
)
def test_the_host_allow_list_stops_dns_rebinding(loopback_only: Any, host: str, status: int) -> None:
    response = loopback_only.get("/v1/models", headers={"host": host})
    assert response.status_code == status
    if status == 400:
        assert error_code(response) == "invalid_host"


@pytest.mark.parametrize(
    ("origin", "status"),
    [("http://localhost:3000", 200), ("https://attacker.example", 403), ("null", 403)],
)
def test_a_cross_site_origin_is_403(loopback_only: Any, origin: str, status: int) -> None:
    headers = {"host": "127.0.0.1:8091", "origin": origin, "content-type": "application/json"}
    response = loopback_only.post(
        GENERATIONS, content=b'{"prompt": "a", "size": "32x32", "num_inference_steps": 1}', headers=headers
    )
    assert response.status_code == status, response.text
    if status == 403:
        assert error_code(response) == "cross_origin"


@pytest.fixture(scope="module")
def any_host() -> Any:
    """No allow-list: --allowed-host '*', or a bind beyond loopback without --allowed-host."""
    with client_for(make_app(dataclasses.replace(WARN, allowed_hosts=None))) as client:
        yield client


@pytest.mark.parametrize(
    ("origin", "status"),
    [
        ("http://evil.example", 403),
        ("null", 403),
        ("http://gpu-7.internal.evil.example", 403),
        ("http://gpu-7.internal:3000", 200),  # the same host, another port: as the allow-list, ports aside
        ("https://GPU-7.internal", 200),
        (None, 200),  # no Origin: not a browser's cross-site request
    ],
    ids=str,
)
def test_without_an_allow_list_an_origin_other_than_the_host_is_403(
    any_host: Any, origin: str | None, status: int
) -> None:
    """Issue 28, defect 11: with the allow-list off, a POST with Origin http://evil.example was served 200."""
    headers = {"host": "gpu-7.internal:8091", **({"origin": origin} if origin else {})}
    if status == 403:
        response = any_host.post(GENERATIONS, json={"prompt": "a", **FAST}, headers=headers)
        assert response.status_code == 403 and error_code(response) == "cross_origin"
    else:  # the same access check on a cheaper path
        assert any_host.get("/v1/models", headers=headers).status_code == 200


def test_docs_are_off_by_default_and_on_when_asked() -> None:
    with client_for(make_app()) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == 404
    with client_for(make_app(dataclasses.replace(WARN, docs=True))) as client:
        assert client.get("/docs").status_code == 200 and client.get("/openapi.json").status_code == 200


def test_no_local_path_in_models_health_or_a_load_failure() -> None:
    with client_for(make_app()) as client:  # the testkit serves model_root="/models/tiny-demo"
        for path in ("/v1/models", "/health"):
            assert "/models/" not in client.get(path).text
        assert client.get("/v1/models").json()["data"][0]["root"] == "tiny"

    def failing_load() -> Any:
        raise FileNotFoundError("/models/tiny-demo/transformer/config.json: no such file")

    with client_for(make_app(load=failing_load)) as client:
        health = client.get("/health")
        assert health.status_code == 503 and "FileNotFoundError" in health.json()["error"]
        assert "/models/" not in health.text
        refused = client.post(GENERATIONS, json={"prompt": "a"})
        assert refused.status_code == 503 and "/models/" not in refused.text


def test_default_allowed_hosts_follow_the_bind_address() -> None:
    assert default_allowed_hosts("127.0.0.1", []) == LOOPBACK
    assert default_allowed_hosts("localhost", ["Box.Lan"]) == (*LOOPBACK, "box.lan")
    assert default_allowed_hosts("0.0.0.0", []) is None  # any name of the machine; warned about
    assert default_allowed_hosts("0.0.0.0", ["gpu-7.internal"]) == ("gpu-7.internal",)
    assert default_allowed_hosts("127.0.0.1", ["*"]) is None
    assert hostname("[::1]:80") == "::1" and hostname("Example.COM.:1") == "example.com"


def test_binding_beyond_loopback_without_a_key_is_warned_about() -> None:
    assert exposure_warning("127.0.0.1", None, LOOPBACK) is None
    assert exposure_warning("::1", None, None) is None
    warning = exposure_warning("0.0.0.0", None, None)
    assert warning is not None and "--api-key" in warning and "--allowed-host" in warning
    assert exposure_warning("0.0.0.0", KEY, ("gpu-7.internal",)) is None


def test_a_load_failure_message_that_begins_with_an_empty_line_is_still_its_first_words() -> None:
    """transformers' ImportErrors (a processor that needs torchvision) begin with a newline: the exit message
    carries their first line that says something, not an empty one."""
    from ditq.serve.state import ServerState

    def failing_load() -> Any:
        raise ImportError(
            "\nQwen3VLVideoProcessor requires the Torchvision library but it was not found.\nSee …"
        )

    messages: list[str] = []
    state = ServerState(
        WARN, failing_load, passed_doctor, "/m", on_load_failure=lambda m, _o: messages.append(m)
    )
    state.start()
    assert state.wait_loaded(30)
    assert messages == [
        "loading /m failed: Qwen3VLVideoProcessor requires the Torchvision library but it was not found."
    ]
