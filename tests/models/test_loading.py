"""``stppo_agent.models.loading``: which model and tokenizer are loaded from where and how
(the transformers loaders replaced by recorders: path, dtype, gguf_file, num_labels), critics and references."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.utils import logging as hf_logging

from stppo_agent.models import loading
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from tests.support.models import Recorder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("pins_models") / "model", word_tokenizer(), hidden=16, layers=1)


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
