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
#   verl   verl.trainer.main_ppo with stppo_st_ppo and the stppo training engine (clip-bias correction on verl's
#          FSDP2 engine), the stppo_env agent loop on the demo NQ set, vLLM rollouts, ITERATIONS steps, over every
#          visible GPU; skipped, with a message, when verl or vllm is not importable by VERL_PYTHON (docs/verl.md).
#          Adds a few minutes (Ray and vLLM start-up); never run by this project's CI (it has no GPU)
#
# Each run is time-boxed and the script goes on past a failure; it prints one line per run from metrics.jsonl
# and exits non-zero if a run that was not skipped failed. Settings (environment variables):
#   ENV (default stppo/NQ-v0,stppo/HotpotQA-v0: needs pyserini for the demo BM25 index; stppo/Toy-v0 needs
#   nothing), RUNS (default "vllm hf fsdp2"), ITERATIONS (3), OUT (/tmp/stppo-gpu-smoke), PYTHON (python3),
#   DEVICE (cuda; cpu only to try the script itself out), SMOKE_SETTINGS (extra "--set k=v" words),
#   RUN_TIMEOUT (seconds per run, 150), VERL_PYTHON (the interpreter of verl's venv; default PYTHON: verl pins
#   transformers<5.11), VERL_TIMEOUT (seconds for the verl run, 600).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-smollm2}"
ENV_IDS="${ENV:-stppo/NQ-v0,stppo/HotpotQA-v0}"
RUNS="${RUNS:-vllm hf fsdp2 verl}"
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

SETTINGS=(--set device="$DEVICE" --set precision.dtype=bfloat16 --set rollout.prompts_per_iteration=32 --set rollout.samples_per_prompt=2
          --set optimizer.mini_batch_size=64 --set optimizer.micro_batch_size=16 --set rollout.max_new_tokens_per_turn=128 --set rollout.max_turns=3
          --set rollout.max_total_tokens=2048 --set logging.progress=false --set logging.tensorboard=false)
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

verl_run() {  # ST-PPO through verl: the stppo engine must apply the correction (actor/stppo/clip_bias_norm logged)
  local vpy="${VERL_PYTHON:-$PY}" dir="$OUT/verl" model
  if ! "$vpy" -c "import verl, vllm" 2>/dev/null; then
    echo "verl: skipped (verl and vllm are not both importable by $vpy; pip install -e '.[verl]' and vllm)"; return
  fi
  rm -rf "${dir:?}"; mkdir -p "$dir"
  model=$("$vpy" -c "from stppo_agent.models.default_model import resolve_model; print(resolve_model('$MODEL'))")
  "$vpy" - "$dir" <<'PY'
import sys
from stppo_agent.integrations.verl.data import export_verl
export_verl(["nq"], "train", sys.argv[1], max_turns=3)  # the bundled demo set (its BM25 index needs pyserini)
export_verl(["nq"], "test", sys.argv[1], max_turns=3, limit=16)
PY
  printf -- '- name: stppo_env\n  _target_: stppo_agent.integrations.verl.agent_loop.StppoEnvAgentLoop\n  retriever: demo\n  topk: 3\n  max_new_tokens_per_turn: 128\n' > "$dir/agent_loops.yaml"
  local overrides v1=False
  overrides=$("$vpy" -m stppo_agent.integrations.verl.settings st_ppo)  # selects the stppo engine too
  "$vpy" -c "import transfer_queue" 2>/dev/null && v1=True  # verl's V1 trainer needs verl[verl-core]
  # shellcheck disable=SC2086  # one override per word
  if ! timeout "${VERL_TIMEOUT:-600}" "$vpy" -m verl.trainer.main_ppo $overrides \
      data.train_files="[$dir/nq_train.parquet]" data.val_files="[$dir/nq_test.parquet]" \
      data.train_batch_size=16 data.val_batch_size=16 data.max_prompt_length=1024 data.max_response_length=512 \
      actor_rollout_ref.model.path="$model" actor_rollout_ref.actor.optim.lr=1e-6 \
      actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
      actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=1 \
      actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
      actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
      actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
      actor_rollout_ref.rollout.agent.agent_loop_config_path="$dir/agent_loops.yaml" \
      critic.strategy=fsdp2 critic.optim.lr=1e-5 critic.model.path="$model" critic.ppo_micro_batch_size_per_gpu=2 \
      trainer.n_gpus_per_node="$GPUS" trainer.nnodes=1 trainer.total_training_steps="$ITERATIONS" \
      trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 trainer.logger="[console]" \
      trainer.use_v1="$v1" trainer.default_local_dir="$dir/checkpoints" \
      > "$OUT/verl.log" 2>&1; then
    echo "verl: FAILED (log: $OUT/verl.log)"; tail -n 25 "$OUT/verl.log"; failed+=(verl); return
  fi
  if ! grep -q "actor/stppo/clip_bias_norm" "$OUT/verl.log"; then  # the engine did not run: not ST-PPO
    echo "verl: FAILED (no actor/stppo/clip_bias_norm in $OUT/verl.log)"; failed+=(verl); return
  fi
  echo "verl   steps=$(grep -c 'actor/stppo/clip_bias_norm' "$OUT/verl.log")" \
       "$(grep -o 'actor/stppo/clip_bias_\(norm\|scale\):[^ ]*' "$OUT/verl.log" | tail -n 2 | tr '\n' ' ')"
}

mkdir -p "$OUT"
for run in $RUNS; do
  case "$run" in
    vllm)
      if "$PY" -c "import vllm" 2>/dev/null; then
        EXTRA=(--set rollout.backend=vllm); train vllm "$PY"
      else
        echo "vllm: skipped (vllm is not installed here)"
      fi ;;
    hf) EXTRA=(--set rollout.backend=hf); train hf "$PY" ;;
    fsdp2) EXTRA=(--set rollout.backend=hf --set distributed.strategy=fsdp2)
           train fsdp2 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$GPUS" ;;
    verl) verl_run ;;
    *) echo "unknown run $run (known: vllm hf fsdp2 verl)"; failed+=("$run") ;;
  esac
done
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
