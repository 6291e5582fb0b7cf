"""gRPC core's settings reach every service process before grpc loads (ringserve/grpc_env.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ringserve import grpc_env

PROBE = ("import os, sys; import {pkg}; loaded = 'grpc' in sys.modules; import {module}; "
         "print(loaded, os.environ.get('GRPC_EXPERIMENTS'))")


@pytest.mark.parametrize(("pkg", "module"), [("services", "services.tokenizer.server"),
                                             ("gateway", "gateway.app")])
def test_a_service_package_sets_them_before_grpc_is_imported(pkg: str, module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(pkg=pkg, module=module)], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == ["False", grpc_env.EXPERIMENTS]


def test_a_value_the_user_set_is_kept() -> None:
    env = {**os.environ, "GRPC_EXPERIMENTS": "-event_engine_dns"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(pkg="services", module="services.detokenizer.server")],
                         env=env, check=True, capture_output=True, text=True).stdout.split()
    assert out == ["False", "-event_engine_dns"]
