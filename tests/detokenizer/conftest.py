"""Fixtures for the detokenizer tests: two tokenizer types and a step runner."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ringserve.message import DecodeParams, Finish, StepBatch, TextDelta, TokenDelta
from ringserve.text_tokenizer import TextTokenizer
from services.detokenizer.detokenizer import Detokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Stop here, then go on.",
    "Serving language models means streaming text one token at a time.",
    "naïve café résumé — façade, coöperate, Zoë. e\u0301 a\u0308 n\u0303",
    "東京は日本の首都です。我们喜欢机器学习。한국어 텍스트도 있습니다.",
    "Emoji: 😀 😃 🚀 🎉 👍🏽 👨‍👩‍👧 ❤️ and flags 🇯🇵🇫🇷.",
] * 20

TEXTS = [
    "hello world, the fox is quick",
    "東京は日本の首都です。我们喜欢机器学习",
    "Emoji 😀🚀 family 👨‍👩‍👧 thumbs 👍🏽 flag 🇯🇵",
    "combining: e\u0301 a\u0308 o\u0302\u0323 Zoë naïve",
    "mixed ascii 中文 and ✨ sparkles ✨ end",
]


def build_sentencepiece_bpe() -> TextTokenizer:
    """A Llama-2/SentencePiece-style BPE: Metaspace, byte fallback, small alphabet (so CJK and
    emoji fall back to <0xNN> byte tokens split across several ids)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(
        replacement="\u2581", prepend_scheme="first")])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=70, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces are ordinary vocab entries, as in SentencePiece
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    special = frozenset(t_id for t_id, t in tok.get_added_tokens_decoder().items() if t.special)
    return TextTokenizer(tokenizer=tok, model_dir=None, chat_template=None, bos_token="<s>",  # type: ignore[arg-type]
                         eos_token="</s>", eos_token_ids=[2], context_length=2048, special_ids=special)


@pytest.fixture(scope="session")
def tiny_tok(model_dir: str) -> TextTokenizer:
    return TextTokenizer.from_model(model_dir)


@pytest.fixture(scope="session")
def sp_tok() -> TextTokenizer:
    return build_sentencepiece_bpe()


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Cut ids into consecutive chunks of the given sizes (cycled), each at least one id."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = max(1, sizes[k % len(sizes)]) if sizes else 1
        out.append(ids[i:i + n])
        i, k = i + n, k + 1
    return out


def run_request(det: Detokenizer, chunks: list[list[int]], params: DecodeParams,
                finish: Finish | None = None, rid: str = "r") -> list[TextDelta]:
    """Feed one request's chunks as consecutive steps; the last chunk carries the finish."""
    out: list[TextDelta] = []
    offset = 0
    if not chunks:
        chunks = [[]]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        delta = TokenDelta(rid=rid, ids=list(chunk), offset=offset, params=params if i == 0 else None,
                           finish=(finish or Finish("length")) if last else None)
        offset += len(chunk)
        batches, _ = det.step(StepBatch([delta]))
        for b in batches:
            out.extend(b.deltas)
    return out


@pytest.fixture
def runner() -> Callable[..., list[TextDelta]]:
    return run_request
