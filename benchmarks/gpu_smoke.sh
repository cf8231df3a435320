#!/usr/bin/env bash
# GPU smoke check (under 5 minutes on one H100/H200): the trainer end to end with the vLLM backend, then the
# same with the HF backend for comparison, on the bundled demo data. Needs a CUDA build of torch and vllm
# installed (`pip install 'stppo[vllm]'`); prints throughput lines from metrics.jsonl.
#   bash benchmarks/gpu_smoke.sh [MODEL]        MODEL: a Hugging Face folder/name (default: smollm2)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-smollm2}"
OUT="${OUT:-/tmp/stppo-gpu-smoke}"
PY="${PYTHON:-python3}"
export HF_DATASETS_DISABLE_PROGRESS_BARS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'vllm', vllm.__version__)"
for backend in vllm hf; do
  rm -rf "$OUT/$backend"
  timeout 140 "$PY" -m stppo_agent.cli train --algo st_ppo --env stppo/NQ-v0,stppo/HotpotQA-v0 --model "$MODEL" \
    --output-dir "$OUT/$backend" --iterations 3 \
    --set generation_backend=$backend --set device=cuda --set dtype=bfloat16 \
    --set prompts_per_iteration=32 --set samples_per_prompt=2 --set mini_batch_size=64 --set micro_batch_size=8 \
    --set max_new_tokens_per_turn=256 --set max_turns=3 --set max_total_tokens=2048 \
    --set env_kwargs.split=train --set progress=false
  "$PY" - "$OUT/$backend" "$backend" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
last = records[-1]
print(f"{sys.argv[2]:5s} iterations={len(records)} reward={last['reward']:.3f} "
      f"rollout_tok/s={last['rollout_tokens_per_s']:.0f} update_tok/s={last['update_tokens_per_s']:.0f} "
      f"clip_bias_scale={last.get('clip_bias_scale', 1):.3f} iteration_s={last['iteration_seconds']:.1f}")
PY
done
