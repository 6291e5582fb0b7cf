"""Pure pieces of the gateway: config, sizes, error mapping, API key parsing, request conversion."""

from __future__ import annotations

import grpc
import pytest

from gateway.auth import key_from_header, key_ok
from gateway.config import load_config, parse_size
from gateway.convert import OPENAI_PARAMS, sampling_from_native, sampling_from_openai, split_prompt
from gateway.errors import GatewayError, from_status
from gateway.native_protocol import NativeSamplingParams
from gateway.protocol import CompletionRequest


def test_config_flags_env_and_key_file(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nfile-key\n\n")
    cfg = load_config(["--api-key", "a", "--api-key", "b", "--api-key-file", str(keys), "--no-public-health"],
                      env={"RINGSERVE_MAX_BODY_BYTES": "1MiB", "RINGSERVE_TOKENIZER": "h:1"})
    assert cfg.api_keys() == ("a", "b", "file-key") and cfg.max_body == 1024**2
    assert cfg.tokenizer == "h:1" and cfg.public_health is False and cfg.public_metrics is True
    assert cfg.served_model_name is None
    with pytest.raises(SystemExit):
        load_config(["--max-body-bytes", "lots"], env={})


def test_parse_size() -> None:
    assert parse_size("8MiB") == 8 * 1024**2 and parse_size("500kB") == 500_000 and parse_size("7") == 7
    with pytest.raises(ValueError):
        parse_size("1.5GB")


def test_error_mapping() -> None:
    e = from_status(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.max_new_tokens: too large", OPENAI_PARAMS)
    assert (e.status, e.param, e.body()["error"]["type"]) == (400, "max_tokens", "invalid_request_error")
    assert from_status(grpc.StatusCode.INVALID_ARGUMENT, "bad things happened").param is None
    e = from_status(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.stop_regex[1]: bad", OPENAI_PARAMS)
    assert e.param == "stop_regex[1]"
    no_map = from_status(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.stop[0]: x")
    assert no_map.param == "sampling_params.stop[0]"
    assert from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full").headers == {"Retry-After": "1"}
    assert from_status(grpc.StatusCode.UNAVAILABLE, "x").status == 503
    assert from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "x").status == 504
    assert from_status(grpc.StatusCode.ALREADY_EXISTS, "rid: in use").status == 409
    assert from_status(grpc.StatusCode.INTERNAL, "x").status == 500


def test_keys() -> None:
    assert key_from_header("Bearer abc ") == "abc" and key_from_header("abc") == "abc"
    keys = (b"one", b"two")
    assert key_ok("two", keys) and not key_ok("tw", keys) and not key_ok("", keys)


def test_sampling_conversion() -> None:
    req = CompletionRequest(prompt="x", stop="END", n=2, seed=5, top_k=3, response_format={"type": "json_object"})
    sp = sampling_from_openai(req, 7)
    assert list(sp.stop) == ["END"] and (sp.n, sp.seed, sp.top_k, sp.max_new_tokens) == (2, 5, 3, 7)
    assert not sp.HasField("temperature") and sp.json_schema == '{"type": "object"}'
    assert split_prompt([1, 2]) == [[1, 2]] and split_prompt(["a", "b"]) == ["a", "b"]
    with pytest.raises(GatewayError):
        split_prompt([])


def test_logit_bias_and_stop_regex_conversion() -> None:
    req = CompletionRequest(prompt="x", logit_bias={"5": 100, "-3": -1.5}, stop_regex="a+b")
    sp = sampling_from_openai(req, 7)
    assert dict(sp.logit_bias) == {5: 100.0, -3: -1.5}  # the tokenizer checks the ids against the vocab
    assert list(sp.stop_regex) == ["a+b"]
    native = sampling_from_native(NativeSamplingParams(logit_bias={"7": 2}, stop_regex=["x", "y\\d"]))
    assert dict(native.logit_bias) == {7: 2.0} and list(native.stop_regex) == ["x", "y\\d"]
    for key in ("abc", "1.5", " 5", "1_0", "\u0663", str(2**31)):
        with pytest.raises(GatewayError) as e:
            sampling_from_openai(CompletionRequest(prompt="x", logit_bias={key: 1}), 7)
        assert (e.value.status, e.value.param) == (400, "logit_bias")
    # The tokenizer's errors name the proto field; an OpenAI client sees its own name.
    assert OPENAI_PARAMS["sampling_params.logit_bias"] == "logit_bias"
    assert OPENAI_PARAMS["sampling_params.stop_regex"] == "stop_regex"
