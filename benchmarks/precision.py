"""bfloat16 autocast (autocast_dtype) against float32 on the same model and batch, in one run.

    python benchmarks/precision.py [--model PATH] [--batch 8] [--length 512] [--repeats 3]

- speed: forward+backward of a causal LM (loss on the last 100 positions, as a trainer's response span) in float32
  and under bfloat16 autocast with float32 weights and output head (stppo_agent/models/precision.py), alternated;
  prints the median seconds of each and the median and range of the repeats' ratios. A CPU without AMX measured
  below 1 (0.85x on an AVX512-BF16 CPU), which is why ``autocast_dtype=auto`` picks bfloat16 on a CPU only with
  AMX; the first line says what auto picks here.
- noise (on the bundled demo corpus' text): log-probs of the same weights and tokens computed under autocast in
  left-padded micro-batches of 2 and in one batch (scoring and training group and pad rows differently), and
  float32 against autocast: mean, p99 and max of |d log p|. Clipping at 0.2 starts at |d log p| = log 1.2 = 0.18:
  on-policy ratios must stay far below it.

Default model: a random Llama of SmolLM2-135M's shape (hidden 576, 30 layers, SmolLM2's tokenizer). The noise
figures depend on the weights: the README's and docs/stability.md's were measured with ``--model`` set to the
stability study's SmolLM2 warm start (runs/stability/sft).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repository on sys.path)
import torch

from stppo_agent.models.loading import load_actor
from stppo_agent.models.precision import autocast_forward, cpu_has_amx_bf16, resolve_autocast_dtype


def default_model() -> Path:
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer
    from stppo_agent.models.tiny import build_tiny_llama

    tokenizer = load_tokenizer(str(smollm2_path()))
    return build_tiny_llama(Path(tempfile.mkdtemp()) / "model", tokenizer, hidden=576, layers=30)


def demo_text_ids(model_path, batch: int, length: int) -> torch.Tensor:
    """Real text (the bundled demo corpus, tokenised by the model's tokenizer), cut into batch rows."""
    import json

    from stppo_agent.models.loading import load_tokenizer

    corpus = Path(__file__).resolve().parents[1] / "stppo_envs" / "data" / "demo" / "corpus.jsonl"
    text = "\n".join(json.loads(line)["contents"] for line in corpus.read_text().splitlines() if line.strip())
    tokens = load_tokenizer(str(model_path))(text, add_special_tokens=False)["input_ids"]
    if len(tokens) < batch * length:
        raise SystemExit(f"the demo corpus has {len(tokens)} tokens, fewer than --batch x --length")
    return torch.tensor(tokens[:batch * length]).view(batch, length)


def forward_backward(model, ids: torch.Tensor) -> float:
    started = time.perf_counter()
    logits = model(input_ids=ids, logits_to_keep=101).logits[:, :-1].float()
    targets = ids[:, -100:]
    loss = -torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


@torch.no_grad()
def logprobs(model, ids: torch.Tensor, micro: int, pad: int = 0) -> torch.Tensor:
    """Log-probs of the last 100 tokens of each row, ``micro`` rows per forward; with ``pad``, row k of a
    micro-batch gets k * pad positions of left padding (masked), as rows of other lengths would give it."""
    parts = []
    for start in range(0, ids.shape[0], micro):
        part = ids[start:start + micro]
        widths = [pad * k for k in range(part.shape[0])]
        total = part.shape[1] + max(widths)
        padded = torch.zeros((part.shape[0], total), dtype=part.dtype)
        mask = torch.zeros((part.shape[0], total), dtype=torch.long)
        for k, extra in enumerate(widths):
            offset = max(widths) - extra
            padded[k, offset + extra:] = part[k]
            mask[k, offset + extra:] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=padded, attention_mask=mask, position_ids=positions,
                       logits_to_keep=101).logits[:, :-1].float()
        parts.append(torch.log_softmax(logits, -1).gather(-1, part[:, -100:].unsqueeze(-1)).squeeze(-1))
    return torch.cat(parts)


def describe(diff: torch.Tensor) -> str:
    diff = diff.abs().flatten()
    beyond = float((diff > math.log(1.2)).double().mean())
    return (f"mean {diff.mean():.1e}  p99 {torch.quantile(diff, 0.99):.1e}  max {diff.max():.1e}  "
            f"beyond log 1.2: {beyond:.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = args.model or default_model()
    full, mixed = load_actor(path), autocast_forward(load_actor(path), "bfloat16")
    ids = demo_text_ids(path, args.batch, args.length)
    forward_backward(full, ids[:2, :128]), forward_backward(mixed, ids[:2, :128])  # warm-up
    seconds = {"float32": [], "bfloat16": []}
    for _ in range(args.repeats):  # alternated, so machine noise hits both alike
        seconds["float32"].append(forward_backward(full, ids))
        seconds["bfloat16"].append(forward_backward(mixed, ids))
    fp32, bf16 = statistics.median(seconds["float32"]), statistics.median(seconds["bfloat16"])
    speedups = [f / b for f, b in zip(seconds["float32"], seconds["bfloat16"])]  # paired: one per repeat
    print(f"model {path}; batch {args.batch} x {args.length} tokens; CPU AMX bf16: {cpu_has_amx_bf16()} "
          f"(autocast_dtype=auto would pick {resolve_autocast_dtype('auto', torch.device('cpu')) or 'float32'})")
    print(f"forward+backward  float32 {fp32:.2f} s   bfloat16 autocast {bf16:.2f} s   speed-up "
          f"{statistics.median(speedups):.2f}x ({min(speedups):.2f}-{max(speedups):.2f} over {args.repeats} repeats)")
    grouped, whole = logprobs(mixed, ids, 2, pad=37), logprobs(mixed, ids, args.batch)
    print(f"|d log p| autocast, padded micro-batches of 2 vs one batch: {describe(grouped - whole)}")
    print(f"|d log p| float32 vs autocast:                              {describe(logprobs(full, ids, 2) - whole)}")


if __name__ == "__main__":
    main()
