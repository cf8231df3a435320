#!/usr/bin/env bash
# GPU smoke check, under 5 minutes on one H100/H200: the trainer end to end on the GPU, three ways.
#
#   bash benchmarks/gpu_smoke.sh [MODEL]      MODEL: a Hugging Face folder or name (default: smollm2)
#
#   vllm   rollouts by a colocated vLLM engine, weights synced after every update (strategy ddp); skipped, with a
#          message, when vllm is not installed (`pip install 'stppo[vllm]'`)
#   hf     rollouts by transformers' generate (strategy ddp, one process)
#   fsdp2  strategy fsdp2 under torchrun over every visible GPU (parameters, gradients and AdamW state sharded;
#          rollouts on the gathered actor)
#
# Each run is time-boxed and the script goes on past a failure; it prints one line per run from metrics.jsonl
# and exits non-zero if a run that was not skipped failed. Settings (environment variables):
#   ENV (default stppo/NQ-v0,stppo/HotpotQA-v0: needs pyserini for the demo BM25 index; stppo/Toy-v0 needs
#   nothing), RUNS (default "vllm hf fsdp2"), ITERATIONS (3), OUT (/tmp/stppo-gpu-smoke), PYTHON (python3),
#   DEVICE (cuda; cpu only to try the script itself out), SMOKE_SETTINGS (extra "--set k=v" words),
#   RUN_TIMEOUT (seconds per run, 150).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-smollm2}"
ENV_IDS="${ENV:-stppo/NQ-v0,stppo/HotpotQA-v0}"
RUNS="${RUNS:-vllm hf fsdp2}"
ITERATIONS="${ITERATIONS:-3}"
OUT="${OUT:-/tmp/stppo-gpu-smoke}"
PY="${PYTHON:-python3}"
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 PYTHONUNBUFFERED=1
DEVICE="${DEVICE:-cuda}"
GPUS=$("$PY" -c "import torch; print(max(1, torch.cuda.device_count()))")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: no GPU"
"$PY" - <<'PY'
import importlib.util, torch, transformers
vllm = importlib.util.find_spec("vllm")
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      "transformers", transformers.__version__, "vllm", __import__("vllm").__version__ if vllm else "not installed")
PY

SETTINGS=(--set device="$DEVICE" --set dtype=bfloat16 --set prompts_per_iteration=32 --set samples_per_prompt=2
          --set mini_batch_size=64 --set micro_batch_size=16 --set max_new_tokens_per_turn=128 --set max_turns=3
          --set max_total_tokens=2048 --set progress=false --set tensorboard=false)
[[ "$ENV_IDS" == *Toy* ]] || SETTINGS+=(--set env_kwargs.split=train)
read -r -a EXTRA_SETTINGS <<< "${SMOKE_SETTINGS:-}"
SETTINGS+=("${EXTRA_SETTINGS[@]}")
failed=()

train() {  # train NAME LAUNCHER... -- SETTINGS...
  local name="$1"; shift
  rm -rf "${OUT:?}/$name"
  if ! timeout "${RUN_TIMEOUT:-150}" "$@" -m stppo_agent.cli train --algo st_ppo --env "$ENV_IDS" --model "$MODEL" \
      --output-dir "$OUT/$name" --iterations "$ITERATIONS" "${SETTINGS[@]}" "${EXTRA[@]}" \
      > "$OUT/$name.log" 2>&1; then
    echo "$name: FAILED (log: $OUT/$name.log)"; tail -n 25 "$OUT/$name.log"; failed+=("$name"); return
  fi
  "$PY" - "$OUT/$name" "$name" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
last = records[-1]
print(f"{sys.argv[2]:6s} iterations={len(records)} reward={last['reward']:.3f} "
      f"rollout_tok/s={last['rollout_tokens_per_s']:.0f} update_tok/s={last['update_tokens_per_s']:.0f} "
      f"clip_bias_scale={last.get('clip_bias_scale', 1):.3f} iteration_s={last['iteration_seconds']:.1f} "
      f"peak_gpu_GiB={last.get('gpu_peak_memory_gib', float('nan')):.2f}")
PY
}

mkdir -p "$OUT"
for run in $RUNS; do
  case "$run" in
    vllm)
      if "$PY" -c "import vllm" 2>/dev/null; then
        EXTRA=(--set generation_backend=vllm); train vllm "$PY"
      else
        echo "vllm: skipped (vllm is not installed here)"
      fi ;;
    hf) EXTRA=(--set generation_backend=hf); train hf "$PY" ;;
    fsdp2) EXTRA=(--set generation_backend=hf --set strategy=fsdp2)
           train fsdp2 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$GPUS" ;;
    *) echo "unknown run $run (known: vllm hf fsdp2)"; failed+=("$run") ;;
  esac
done
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
