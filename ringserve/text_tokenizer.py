"""A Hugging Face tokenizer loaded without torch: tokenizer.json, chat template, EOS ids.

`transformers.PreTrainedTokenizerFast` imports torch, and the gateway, tokenizer and detokenizer
images must not carry torch, so this reads the same files with the `tokenizers` library and renders
chat templates with jinja2 in a sandbox, the way transformers does. Decoding is
`tokenizers.Tokenizer.decode`, which is what transformers' fast tokenizers call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

# The tokenizers library's Rust thread pool spins (sched_yield) after every batch call: measured as a
# fifth of the detokenizer's CPU on two cores shared with the scheduler's forward. Each call here is
# small (one step's deltas, one prompt), so it gains nothing from the pool. Set before the import;
# a deployment may still turn it on.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer  # noqa: E402


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (its own raise_exception, or a render error)."""


def resolve_model_dir(model: str) -> Path:
    """The model directory `model` names (ringserve.model_source; a GGUF must be converted already)."""
    from ringserve.model_source import resolve_model

    return resolve_model(model, prepare=False)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _token_str(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are either strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


@dataclass
class TextTokenizer:
    """Tokenizer, chat template and the model facts the text side needs."""

    tokenizer: Tokenizer
    model_dir: Path
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    context_length: int
    clean_up_tokenization_spaces: bool = False
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_model(cls, model: str, chat_template: str | None = None) -> TextTokenizer:
        """`chat_template` overrides the model's own (--chat-template): a file's path, or the template
        text itself."""
        model_dir = resolve_model_dir(model)
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tcfg = _read_json(model_dir / "tokenizer_config.json")
        cfg = _read_json(model_dir / "config.json")
        gen = _read_json(model_dir / "generation_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        for name in ("chat_template.jinja",):
            if template is None and (model_dir / name).exists():
                template = (model_dir / name).read_text(encoding="utf-8")
        if template is None and (model_dir / "chat_template.json").exists():
            template = _read_json(model_dir / "chat_template.json").get("chat_template")
        if chat_template:
            template = read_chat_template(chat_template)
        eos_token = _token_str(tcfg.get("eos_token"))
        eos_ids = _as_list(gen.get("eos_token_id")) or _as_list(cfg.get("eos_token_id"))
        if not eos_ids and eos_token is not None and (eos_id := tok.token_to_id(eos_token)) is not None:
            eos_ids = [eos_id]
        text_cfg = cfg.get("text_config", cfg)
        context = int(text_cfg.get("max_position_embeddings") or tcfg.get("model_max_length") or 2048)
        special = frozenset(t.id for t in _added_tokens(tok) if t.special)
        return cls(tokenizer=tok, model_dir=model_dir, chat_template=template,
                   bos_token=_token_str(tcfg.get("bos_token")), eos_token=eos_token,
                   eos_token_ids=eos_ids, context_length=context,
                   clean_up_tokenization_spaces=bool(tcfg.get("clean_up_tokenization_spaces", False)),
                   special_ids=special)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up(text) if self.clean_up_tokenization_spaces else text

    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        texts = self.tokenizer.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
        return [clean_up(t) for t in texts] if self.clean_up_tokenization_spaces else texts

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id decoded alone (what OpenAI logprobs call a token)."""
        return self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)

    @cached_property
    def _template(self) -> Any:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Render messages to the prompt text (special tokens are part of the template), as
        transformers' apply_chat_template does: `tools` (OpenAI's tool dicts) is the template's
        `tools` variable, None when there are none; `template_kwargs` are more template variables
        (e.g. enable_thinking)."""
        if not self.chat_template:
            raise ChatTemplateError("the model has no chat template")
        extra = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & extra.keys())
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs: {reserved[0]!r} is set by the server")
        try:
            text = self._template.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - any template failure is the caller's input problem
            raise ChatTemplateError(f"chat template failed: {e}") from e
        if continue_final_message and messages:
            last = messages[-1].get("content") or ""
            cut = text.rfind(last)
            if cut < 0:
                raise ChatTemplateError("continue_final_message: last message not found in rendered text")
            text = text[: cut + len(last)]
        return text

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message, tools,
                                        template_kwargs)
        return self.encode(text, add_special_tokens=False)


# What the server itself passes to a chat template; chat_template_kwargs cannot override them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"})


def read_chat_template(value: str) -> str:
    """--chat-template: the text of the file it names, or the value itself when it names no file
    (a template always contains "{{" or "{%", which no sensible path does)."""
    if "{" not in value:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--chat-template: no such file: {value}")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":  # a chat_template.json
            return str(json.loads(text)["chat_template"])
        return text
    return value


def _added_tokens(tok: Tokenizer) -> list[Any]:
    decoder = tok.get_added_tokens_decoder()  # {id: AddedToken}
    for i, t in decoder.items():
        t.id = i  # type: ignore[attr-defined]
    return list(decoder.values())


# transformers' clean_up_tokenization, in its order. Every pattern starts with a space and every rewrite
# only deletes spaces (the detokenizer's streaming clean-up relies on both).
CLEANUP_RULES = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def clean_up(text: str) -> str:
    """transformers' clean_up_tokenization, for tokenizers that ask for it."""
    for pattern, repl in CLEANUP_RULES:
        text = text.replace(pattern, repl)
    return text


def default_model() -> str:
    """MODEL / RINGSERVE_MODEL, else the default model (SmolLM2-135M-Instruct, ringserve.model_source)."""
    from ringserve.model_source import DEFAULT_MODEL

    return os.environ.get("RINGSERVE_MODEL") or os.environ.get("MODEL") or DEFAULT_MODEL
