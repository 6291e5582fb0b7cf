"""GrammarMasker: only constrained rows change, the buffer is reused, the reference apply agrees with
xgrammar's kernel, and metrics are updated."""

from __future__ import annotations

import json

import torch
from prometheus_client import CollectorRegistry

from services.scheduler.grammar import GrammarBackend, GrammarMasker, GrammarMetrics


def test_mixed_batch_masks_only_constrained_rows(backend) -> None:
    compiled = backend.compile("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}}))
    matchers = [None, compiled.matcher(), None, compiled.matcher()]
    logits = torch.randn(4, backend.vocab_size, generator=torch.Generator().manual_seed(0))  # [B, V]
    before = logits.clone()
    masker = GrammarMasker(backend, max_batch_size=8)
    buf = masker.bitmask
    assert masker.apply(logits, matchers) == 2
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row in (1, 3):
        finite = torch.isfinite(logits[row])
        assert 0 < int(finite.sum()) < backend.vocab_size
        assert torch.equal(logits[row][finite], before[row][finite])  # allowed logits untouched
    assert masker.apply(logits, [None] * 4) == 0
    assert masker.bitmask is buf  # one buffer for every step


def test_buffer_grows_for_a_bigger_batch(backend) -> None:
    compiled = backend.compile("regex", "[ab]+")
    masker = GrammarMasker(backend, max_batch_size=2)
    logits = torch.zeros(5, backend.vocab_size)
    assert masker.apply(logits, [compiled.matcher() for _ in range(5)]) == 5
    assert masker.bitmask.shape[0] == 5 and bool(torch.isinf(logits).any(dim=1).all())


def test_reference_apply_matches_xgrammar_kernel(backend) -> None:
    compiled = backend.compile("regex", "[0-9]{1,3}(,[0-9]{1,3})*")
    matchers = [compiled.matcher(), None, compiled.matcher()]
    assert matchers[2].accept_token(backend.info.decoded_vocab.index(b"7"))
    bitmask = backend.allocate_bitmask(3)
    backend.fill_bitmasks([matchers[0], matchers[2]], bitmask, [0, 2])
    logits = torch.randn(3, backend.vocab_size)
    ours = logits.clone()
    backend.apply_bitmask(logits, bitmask, [0, 2])            # xgrammar's CPU kernel
    GrammarBackend.apply_bitmask(backend, ours, bitmask, [0, 2])  # the portable torch reference
    assert torch.equal(torch.isinf(logits), torch.isinf(ours))
    assert not torch.equal(torch.isinf(logits[0]), torch.isinf(logits[2]))  # different states, masks


def test_mask_time_is_observed(backend) -> None:
    reg = CollectorRegistry()
    metrics = GrammarMetrics("m", registry=reg)
    masker = GrammarMasker(backend, 2, metrics=metrics)
    masker.apply(torch.zeros(2, backend.vocab_size), [backend.compile("regex", "x").matcher(), None])
    assert reg.get_sample_value("sglang:grammar_mask_seconds_count", {"model_name": "m"}) == 1
    assert masker.last_seconds > 0
