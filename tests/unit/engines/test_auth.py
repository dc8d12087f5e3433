"""Who may call an engine (slime.engines.auth): the run's key, the server's own Host and Origin,
JSON bodies, and the two routes that touch files and addresses. One native engine serves every
test here, started with the test key (tests/conftest.py) the way a run starts its engines."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from slime.engines.auth import check_weight_path, env_api_key, run_weights_dir
from slime.engines.control import EngineControl, EngineError
from slime.engines.protocol import ProtocolError
from tests.helpers.native_server import native_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    weights = tmp / "weights"
    weights.mkdir()
    with native_server(tiny_model_dir, tmp / "engine.log", "--weight-dirs", str(weights)) as (url, _):
        yield url, weights


def raw(url: str, path: str, *, body: bytes | None = None, headers: dict | None = None,
        method: str | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url + path, data=body, method=method or ("POST" if body is not None else "GET"),
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


KEY = {"Authorization": f"Bearer {env_api_key()}"}
JSON = {"Content-Type": "application/json"}
GENERATE = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}).encode()


def test_a_request_without_the_key_is_401_and_health_answers_without_it(server):
    url, _ = server
    assert raw(url, "/health")[0] == 200
    status, body = raw(url, "/generate", body=GENERATE, headers=JSON)
    assert status == 401 and "API key" in body["error"]["message"]
    assert raw(url, "/generate", body=GENERATE, headers={**JSON, "Authorization": "Bearer wrong-key"})[0] == 401
    assert raw(url, "/get_model_info")[0] == 401  # control and info routes too, not only generation
    assert raw(url, "/release_memory_occupation", body=b"{}", headers=JSON)[0] == 401
    status, body = raw(url, "/generate", body=GENERATE, headers={**JSON, **KEY})
    assert status == 200 and body["meta_info"]["completion_tokens"] == 2


def test_slime_clients_and_an_openai_client_with_the_key_work(server):
    url, _ = server
    assert EngineControl(url).model_info()["model_path"]  # the key from SLIME_ENGINE_API_KEY
    with pytest.raises(EngineError) as e:
        EngineControl(url, api_key="not-the-key").model_info()
    assert e.value.status == 401
    client = openai.OpenAI(base_url=url + "/v1", api_key=env_api_key(), timeout=60, max_retries=0)
    out = client.completions.create(model="default", prompt="hi", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_a_foreign_origin_or_host_is_403(server):
    url, _ = server
    port = url.rsplit(":", 1)[1]
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Host": f"evil.example:{port}"},
                    {"Host": f"127.0.0.1:{int(port) + 1}"}):
        status, body = raw(url, "/generate", body=GENERATE, headers={**JSON, **KEY, **headers})
        assert status == 403, headers
    # the server's own origin (and localhost on loopback) is fine; /health checks the Host as well
    assert raw(url, "/generate", body=GENERATE, headers={**JSON, **KEY, "Origin": url})[0] == 200
    assert raw(url, "/get_model_info", headers={**KEY, "Host": f"localhost:{port}"})[0] == 200
    assert raw(url, "/health", headers={"Host": f"evil.example:{port}"})[0] == 403


def test_a_body_a_web_page_could_send_is_refused(server):
    url, _ = server
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, body = raw(url, "/generate", body=GENERATE, headers={**KEY, "Content-Type": ctype})
        assert status == 415 and "application/json" in body["error"]["message"], ctype


def test_disk_loads_only_from_the_run_directories(server, tiny_model_dir, tmp_path):
    url, weights = server
    engine = EngineControl(url)
    with pytest.raises(EngineError) as e:
        engine.update_weights_from_disk(str(tmp_path))  # a directory the engine was not given
    assert e.value.status == 400 and "model_path" in str(e.value) and "outside" in str(e.value)
    escape = weights / "link"
    escape.symlink_to(tmp_path, target_is_directory=True)  # a link out of an allowed directory
    with pytest.raises(EngineError, match="outside"):
        engine.update_weights_from_disk(str(escape))
    with pytest.raises(EngineError, match="outside"):
        engine.update_weights_from_disk(str(weights / ".." / ".." ))
    assert engine.update_weights_from_disk(tiny_model_dir, weight_version=3)  # --model-path is allowed


def test_a_weight_group_only_at_an_allowed_address(server):
    url, _ = server
    with pytest.raises(EngineError) as e:
        EngineControl(url).init_weights_update_group("127.0.0.9", 29500, 1, 2, "g", "gloo")
    assert e.value.status == 400 and "master_address" in str(e.value) and "127.0.0.9" in str(e.value)


def test_check_weight_path_and_run_weights_dir(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    check_weight_path(str(tmp_path / "a" / "b"), [str(tmp_path / "a")])
    check_weight_path(str(tmp_path / "a"), [str(tmp_path / "a")])
    with pytest.raises(ProtocolError, match="outside"):
        check_weight_path(str(tmp_path / "ab"), [str(tmp_path / "a")])  # a prefix is not a parent
    one, other = run_weights_dir("k" * 32), run_weights_dir("j" * 32)
    assert one != other and one == run_weights_dir("k" * 32) and "k" * 8 not in one  # derived, not the key
