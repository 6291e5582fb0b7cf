"""Build the default model: a small random-weight Llama with a real byte-level BPE tokenizer.

No weights can be downloaded on the machines this project is developed on, so the system serves a
model it builds itself, once and deterministically (fixed seed, fixed corpus order). Its text is
meaningless; it exists so that every path (tokenizer, chat template, multi-byte characters split
across tokens, EOS handling, the whole engine) runs offline exactly as it would on a real model.

    python -m ringserve.default_model [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = ROOT / ".cache" / "models" / "ringserve-tiny-llama"
BUILD_VERSION = 1  # bump to rebuild every cached copy

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """Llama hyperparameters. The default is about 4.5M parameters."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    seed: int = 0


# A ~100M-parameter shape of the same family, for benchmarks.
SHAPES = {
    "tiny": ModelShape(),
    "100m": ModelShape(vocab_size=8192, hidden_size=768, intermediate_size=2048,
                       num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
}


def _log(msg: str) -> None:
    print(f"[default-model] {msg}", flush=True)


def _corpus(max_bytes: int = 4_000_000) -> list[str]:
    """Installed Python sources (present on every machine) plus generated CJK, emoji and accents."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    rng = random.Random(1234)
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 1500)] + list("你好世界谢谢再见中文日本語한국어")
    emoji = [chr(c) for c in range(0x1F600, 0x1F640)] + ["👍🏽", "👨‍👩‍👧", "🇯🇵", "❤️"]
    accents = ["é", "è", "ñ", "ü", "e\u0301", "a\u0308", "ß", "ø", "Å"]
    for _ in range(4000):
        words = [
            "".join(rng.choice(cjk) for _ in range(rng.randint(1, 4)))
            if rng.random() < 0.6 else rng.choice(emoji) + rng.choice(accents)
            for _ in range(rng.randint(3, 12))
        ]
        texts.append(" ".join(words) + "\n")
    texts.extend(["你好，世界！", "こんにちは", "안녕하세요"] * 50)
    return texts


def build_tokenizer(shape: ModelShape):
    """Train a byte-level BPE on the corpus; returns a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    corpus = _corpus()
    _log(f"training byte-level BPE (vocab {shape.vocab_size}) on {len(corpus)} texts")
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tok


def build_weights(shape: ModelShape) -> dict[str, np.ndarray]:
    """Random float32 Llama weights with HF names. lm_head is scaled up so that greedy choices are
    decisive (a near-tie between two logits would make float rounding decide the token)."""
    rng = np.random.default_rng(shape.seed)
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    hd = h // shape.num_attention_heads
    kv = shape.num_key_value_heads * hd

    def normal(*dims: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * std).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(v, h, std=1.0)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "self_attn.q_proj.weight"] = normal(h, h, std=0.08)
        w[p + "self_attn.k_proj.weight"] = normal(kv, h, std=0.08)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h, std=0.08)
        w[p + "self_attn.o_proj.weight"] = normal(h, h, std=0.04)
        w[p + "mlp.gate_proj.weight"] = normal(i, h, std=0.05)
        w[p + "mlp.up_proj.weight"] = normal(i, h, std=0.05)
        w[p + "mlp.down_proj.weight"] = normal(h, i, std=0.03)
    w["model.norm.weight"] = np.ones(h, np.float32)
    w["lm_head.weight"] = normal(v, h, std=0.25)
    return w


def _config(shape: ModelShape, tok) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": tok.token_to_id("<s>"),
        "eos_token_id": tok.token_to_id("</s>"),
    }


def build(out: Path, shape: ModelShape = ModelShape(), force: bool = False) -> Path:
    """Build the model directory at `out` unless an identical build is already there."""
    marker = out / "ringserve_build.json"
    want = {"build_version": BUILD_VERSION, **asdict(shape)}
    if not force and marker.exists() and json.loads(marker.read_text()) == want:
        _log(f"up to date: {out}")
        return out
    t0 = time.monotonic()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _log("step 1/3: tokenizer")
    tok = build_tokenizer(shape)
    tok.save(str(tmp / "tokenizer.json"))
    eos_ids = [tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")]
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": shape.max_position_embeddings,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (tmp / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}, indent=2))
    _log(f"step 2/3: weights ({shape.num_hidden_layers} layers, hidden {shape.hidden_size})")
    from safetensors.numpy import save_file

    weights = build_weights(shape)
    n_params = sum(a.size for a in weights.values())
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _log("step 3/3: config, generation_config")
    (tmp / "config.json").write_text(json.dumps(_config(shape, tok), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": eos_ids,
        "do_sample": False,
    }, indent=2))
    marker_tmp = tmp / "ringserve_build.json"
    marker_tmp.write_text(json.dumps(want))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _log(f"built {n_params / 1e6:.1f}M parameters in {time.monotonic() - t0:.1f}s: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_MODEL_DIR}")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    out = args.out or (DEFAULT_MODEL_DIR if args.shape == "tiny"
                       else DEFAULT_MODEL_DIR.with_name(f"ringserve-{args.shape}-llama"))
    build(out, SHAPES[args.shape], force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
