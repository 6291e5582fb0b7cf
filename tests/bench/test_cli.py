"""`python -m bench` flags."""

from __future__ import annotations

import pytest

from bench.__main__ import parse


def test_defaults_and_stream_interval() -> None:
    args = parse([])
    assert args.stream_interval == 1
    # the one command: every target, transformers generate / generate_batch included
    assert set(args.targets) == {"gateway", "native", "grpc", "engine", "vllm", "transformers", "smg"}
    assert parse(["--stream-interval", "4", "--targets", "gateway,vllm"]).stream_interval == 4


def test_unknown_target_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse(["--targets", "gateway,nope"])


def test_dtype_once_or_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.scheduler.kernels import cpu_linear

    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: True)
    args = parse(["--models", "smollm2-135m-instruct,tiny"])
    assert args.model_dtypes == [("smollm2-135m-instruct", "bfloat16"), ("tiny", "bfloat16")]
    args = parse(["--models", "smollm2-135m-instruct,tiny", "--dtype", "best,float32"])
    assert args.model_dtypes == [("smollm2-135m-instruct", "bfloat16"), ("tiny", "float32")]
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    assert parse(["--models", "tiny"]).model_dtypes == [("tiny", "float32")]
    for bad in ("float64", "best,float32"):  # not a dtype; two for one model
        with pytest.raises(SystemExit):
            parse(["--models", "tiny", "--dtype", bad])


def test_kv_cache_dtype_takes_the_names_both_servers_share() -> None:
    assert parse(["--models", "tiny"]).kv_cache_dtype == "auto"
    assert parse(["--models", "tiny", "--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        parse(["--models", "tiny", "--kv-cache-dtype", "float8"])
