"""The operation routes against the fake tokenizer: SGLang's shapes, validation, auth, OpenAPI."""

from __future__ import annotations

import httpx

from tests.gateway.fake_tokenizer import FakeTokenizer

ROUTES = ("/pause_generation", "/continue_generation", "/update_weights_from_disk", "/start_profile",
          "/stop_profile", "/get_load", "/abort_request")


def test_abort_all_and_by_rid(http: httpx.Client, fake: FakeTokenizer) -> None:
    assert http.post("/abort_request", json={"abort_all": True}).json() == {"abort_all": True, "num_aborted": 3}
    assert fake.servicer.ops == [("AbortAll", "")]
    assert http.post("/abort_request", json={"rid": "live"}).json() == {"rid": "live", "found": True}
    r = http.post("/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


def test_pause_modes_continue_and_health(http: httpx.Client, fake: FakeTokenizer) -> None:
    r = http.post("/pause_generation", json={"mode": "retract"})
    assert r.status_code == 200
    assert r.json()["status"] == "ok" and r.json()["num_requests"] == 2
    health = http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "paused", "mode": "retract"}
    assert http.post("/pause_generation").status_code == 200  # no body: mode abort
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert http.post("/continue_generation").json()["status"] == "ok"
    assert http.get("/health").content == b""
    assert [m for _, m in fake.servicer.ops if _ == "PauseGeneration"] == ["retract", "abort", "in_place"]
    bad = http.post("/pause_generation", json={"mode": "sideways"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"


def test_update_weights_from_disk(http: httpx.Client, fake: FakeTokenizer) -> None:
    r = http.post("/update_weights_from_disk", json={"model_path": "/models/new", "weight_version": "step-7"})
    assert r.status_code == 200
    assert r.json() == {"success": True, "message": "Succeeded.", "num_paused_requests": 1,
                        "weight_version": "step-7"}
    assert http.get("/get_model_info").json()["weight_version"] == "step-7"
    r = http.post("/update_weights_from_disk", json={"model_path": "/nowhere"})
    assert r.status_code == 400 and r.json()["success"] is False and "model_path" in r.json()["message"]
    for body, param in (({}, "model_path"), ({"model_path": "/m", "load_format": "pt"}, "load_format"),
                        ({"model_path": "/m", "is_async": True}, "is_async"),
                        ({"model_path": "/m", "lora_path": "x"}, "lora_path")):
        r = http.post("/update_weights_from_disk", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_profile_routes(http: httpx.Client, fake: FakeTokenizer) -> None:
    r = http.post("/start_profile", json={"output_dir": "/tmp/p", "num_steps": 5, "activities": ["CPU", "GPU"]})
    assert r.status_code == 200 and r.text == "Start profiling.\n"
    assert fake.servicer.ops[-1] == ("StartProfile", "/tmp/p|5|CPU,GPU")
    assert http.get("/start_profile").status_code == 200
    r = http.post("/stop_profile")
    assert r.status_code == 200 and "/tmp/x.pt.trace.json" in r.text
    for body, param in (({"activities": ["MEM"]}, "activities.0"), ({"merge_profiles": True}, "merge_profiles"),
                        ({"num_steps": -1}, "num_steps"), ({"start_step": 3}, "start_step")):
        r = http.post("/start_profile", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_get_load(http: httpx.Client) -> None:
    loads = http.get("/get_load").json()
    assert loads[0] == {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 3, "num_tokens": 40, "address": "s0",
                        "connected": True}
    assert loads[1]["dp_rank"] == 1 and loads[1]["num_reqs"] == 0


def test_operations_need_the_api_key_and_are_documented(gateway: str) -> None:
    for path in ROUTES:
        method = "GET" if path == "/get_load" else "POST"
        r = httpx.request(method, gateway + path, json={}, timeout=10)
        assert r.status_code == 401, path
    spec = httpx.get(gateway + "/openapi.json", timeout=10).json()
    assert set(ROUTES) <= set(spec["paths"])
