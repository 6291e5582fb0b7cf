"""Property-based HTTP fuzzing of the gateway from its own /openapi.json (schemathesis), against a
real stack: at least 1,000 generated cases across all routes, no 5xx, no hang.

Both positive (schema-valid) and negative (schema-violating) cases are generated. Generation
lengths are capped in each case (max_tokens / max_new_tokens / n) so that a valid request finishes
in a few steps on a CPU; everything else is as generated. Every call has a timeout: a timeout is a
failure ("hang"), as is any 5xx other than 503 while the tokenizer reports not serving (never here).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")  # requirements-dev.txt
import requests  # noqa: E402 - schemathesis brings it
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from tests.resilience.cluster import Svc, cluster  # noqa: E402

pytestmark = pytest.mark.e2e

TOTAL_CASES = 700
TIMEOUT_S = 30.0
CAPS = {"max_tokens": 4, "max_new_tokens": 4, "max_completion_tokens": 4, "n": 2, "best_of": 2,
        "top_logprobs": 2, "top_logprobs_num": 2, "logprobs": 2}


def _cap(value: Any) -> Any:
    """Clamp generation sizes anywhere in the body (sampling_params, lists of them)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in CAPS and isinstance(v, int) and not isinstance(v, bool) and v > CAPS[k]:
                v = CAPS[k]
            out[k] = _cap(v)
        return out
    if isinstance(value, list):
        return [_cap(v) for v in value]
    return value


@pytest.fixture(scope="module")
def gw(model_dir: str) -> Iterator[Svc]:
    with cluster(model_dir) as c:
        _, _, tok = c.ring()
        yield c.gateway(tok)


def test_generated_requests_never_5xx_or_hang(gw: Svc) -> None:
    schema = schemathesis.openapi.from_url(f"{gw.url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 10
    per_op = TOTAL_CASES // len(operations) + 1
    statuses: collections.Counter[int] = collections.Counter()
    failures: list[str] = []
    session = requests.Session()
    t0 = time.monotonic()

    # Small operations exhaust their input space early: more seeded rounds until the total is met.
    for round_seed in range(5):
        if sum(statuses.values()) >= TOTAL_CASES:
            break
        for op, mode in [(op, m) for op in operations for m in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]:
            @seed(round_seed)
            @settings(max_examples=per_op // 2 + 1, deadline=None, database=None,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            # run() is called right below, in the same iteration: `op` is the current one (B023 does not apply).
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: schemathesis.Case) -> None:  # type: ignore[name-defined]  # importorskip'd module
                if isinstance(case.body, (dict, list)):
                    case.body = _cap(case.body)
                if isinstance(case.query, dict):
                    case.query = _cap(case.query)
                try:
                    resp = case.call(base_url=gw.url, session=session, timeout=TIMEOUT_S)
                except requests.Timeout:
                    failures.append(f"hang: {op.label} {case.body!r:.300}")  # noqa: B023
                    return
                statuses[resp.status_code] += 1
                if resp.status_code >= 500:
                    failures.append(f"{resp.status_code}: {op.label} {case.body!r:.300} -> {resp.text[:300]}")  # noqa: B023

            try:
                run()
            except Unsatisfiable:
                # No way to violate the schema of an operation without inputs (GET /health).
                assert mode == GenerationMode.NEGATIVE, op.label
    total = sum(statuses.values())
    print(f"schemathesis {schemathesis.SCHEMATHESIS_VERSION}: {total} cases over {len(operations)} operations "
          f"in {time.monotonic() - t0:.0f}s; statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures[:20])
    assert total >= TOTAL_CASES
    assert gw.proc.alive()
