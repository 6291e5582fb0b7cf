"""transformers' greedy outputs for end-to-end parity checks (computed once per prompt set)."""

from __future__ import annotations

from functools import lru_cache

from ringserve.text_tokenizer import TextTokenizer

PROMPTS = (
    "Once upon a time", "def fibonacci(n):", "你好，世界！今天天气很好", "emoji 🧬🦊 and accents é ñ",
    "import os\nimport sys\n", "The quick brown fox jumps over the lazy dog. " * 6,
    "class Foo:\n    def __init__(self):", "a", "上海 北京 深圳 广州 杭州",
    "Once upon a time there was",  # shares a prefix with the first prompt
)


@lru_cache(maxsize=4)
def greedy_reference(model_dir: str, prompts: tuple[str, ...], new_tokens: int) -> dict[str, list[int]]:
    """prompt -> exactly `new_tokens` greedy ids (EOS masked, as min_new_tokens does on our side)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = TextTokenizer.from_model(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = {}
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        gen = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        out[p] = gen[0, ids.shape[1]:].tolist()
    return out


def greedy_body(prompt: str, new_tokens: int) -> dict:
    return {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                                                "min_new_tokens": new_tokens}}
