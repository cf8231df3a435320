"""``stppo_agent.models.precision``: the precision rules per device, CPU flags, autocast
with float32 heads."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from stppo_agent.models import precision


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
