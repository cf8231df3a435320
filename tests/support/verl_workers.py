"""What the tests that run verl's engine on CPU share (tests/integrations/verl/test_engine.py and
test_training_worker.py): a CPU platform for verl, a multi-turn batch of a tiny Llama in verl's field names, and
worker processes on gloo.

verl fixes its platform at the first import of its engine module, so the workers register the CPU platform first
(``python tests/integrations/verl/<file>.py worker ...`` with ``VERL_USE_EXTERNAL_PLUGINS=none``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.paths import REPO

PLATFORM = "stppo_test_cpu"
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
# float32 everywhere; verl's engine and this project's computation differ in summation order (FSDP2 reduce-scatter
# and gloo averaging across ranks, padded and micro-batched vs. unpadded whole-batch forward): equal up to rounding
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


# -- the batch: prompts + multi-turn responses (observation runs with mask 0), old log-probs off the current ones ----
RESPONSES = [  # per row: (assistant tokens, observation tokens) per turn
    [(3, 2), (4, 3), (2, 0)],
    [(5, 0)],
    [(1, 1), (2, 2), (1, 1), (3, 0)],
    [(2, 4), (6, 0)],
]
PROMPT_LENS = [3, 2, 4, 3]


def make_batch(model_dir: Path, seed: int = 0, spread: float = 0.6, on_policy_rows: tuple[int, ...] = ()) -> dict:
    """Left-padded prompts, right-padded responses, verl's field names; old log-probs = current + noise, so that
    some tokens (and whole turns) clip, except on ``on_policy_rows`` (old = current: nothing clips there)."""
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
    vocab = model.config.vocab_size
    batch = len(RESPONSES)
    prompt_len = max(PROMPT_LENS)
    response_len = max(sum(a + o for a, o in row) for row in RESPONSES) + 1
    prompts = torch.zeros(batch, prompt_len, dtype=torch.long)
    responses = torch.zeros(batch, response_len, dtype=torch.long)
    attention = torch.zeros(batch, prompt_len + response_len, dtype=torch.long)
    response_mask = torch.zeros(batch, response_len, dtype=torch.long)
    for b, row in enumerate(RESPONSES):
        length = PROMPT_LENS[b]
        prompts[b, prompt_len - length:] = torch.randint(3, vocab, (length,), generator=generator)
        attention[b, prompt_len - length:prompt_len] = 1
        position = 0
        for assistant, observation in row:
            response_mask[b, position:position + assistant] = 1
            position += assistant + observation
        responses[b, :position] = torch.randint(3, vocab, (position,), generator=generator)
        attention[b, prompt_len:prompt_len + position] = 1
    input_ids = torch.cat([prompts, responses], 1)
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        current = response_log_probs(model, input_ids, attention, position_ids, response_len)
    noise = spread * torch.randn(current.shape, generator=generator)
    noise[list(on_policy_rows)] = 0.0
    old = current + noise
    advantages = 4 * torch.randn(current.shape, generator=generator)  # ||C|| > kappa = 1: the correction rescales
    return {"prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention,
            "position_ids": position_ids, "response_mask": response_mask, "old_log_probs": old * response_mask,
            "advantages": advantages * response_mask}


def response_log_probs(model, input_ids, attention, position_ids, response_len) -> torch.Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids).logits
    logits = logits[:, -response_len - 1:-1].float()
    targets = input_ids[:, -response_len:]
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def register_cpu_platform():
    """A CPU platform for verl (it has none): registered through verl's platform plugin API and made current."""
    import contextlib
    import types

    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    @PlatformRegistry.register(platform=PLATFORM)
    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = types.SimpleNamespace(is_available=lambda: True, empty_cache=lambda: None,
                                              synchronize=lambda *a: None, manual_seed=lambda s: None,
                                              manual_seed_all=lambda s: None, current_device=lambda: "cpu",
                                              device_count=lambda: 1, set_device=lambda d: None,
                                              memory_allocated=lambda *a: 0, memory_reserved=lambda *a: 0,
                                              max_memory_allocated=lambda *a: 0, max_memory_reserved=lambda *a: 0,
                                              mem_get_info=lambda *a: (0, 0), reset_peak_memory_stats=lambda *a: None,
                                              get_device_name=lambda *a: "cpu")

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    set_platform(CPUPlatform())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_model_configs(model_path: str, **engine_settings):
    """verl's model and FSDP2 engine configs for the tiny Llama on CPU: sdpa attention, padded inputs, float32
    parameters and reduction (so that verl and this project's computation agree up to float32 rounding)."""
    from verl.workers.config import FSDPEngineConfig, HFModelConfig

    model = HFModelConfig(path=model_path, use_remove_padding=False, load_tokenizer=True,
                          override_config={"attn_implementation": "sdpa"})
    engine = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", use_torch_compile=False, seed=0,
                              mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
                              **engine_settings)
    return model, engine


def launch_workers(script: str, args: dict, world: int, timeout: float = 900) -> tuple[list[int], list[str]]:
    """Run ``world`` processes of ``python script worker ARGS`` on gloo (a free port); (exit codes, logs)."""
    port = free_port()
    processes = []
    for rank in range(world):
        process_env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_ENGINE_VENDOR": "stppo",
                       "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "PYTHONPATH": str(REPO)}
        processes.append(subprocess.Popen([sys.executable, script, "worker", json.dumps(args)], env=process_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [process.communicate(timeout=timeout)[0] for process in processes]
    finally:
        for process in processes:  # a rank left waiting on a dead partner
            if process.poll() is None:
                process.kill()
    return [process.returncode for process in processes], logs
