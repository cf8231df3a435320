#!/usr/bin/env bash
# verl.trainer.main_ppo on NQ + HotpotQA with Qwen2.5 and this project's env as the agent loop, with the settings of
# Search-R1's PPO recipe (train_batch_size 512, mini-batch 256, actor lr 1e-6, critic lr 1e-5, KL 0.001 in the
# reward, gamma = lam = 1, top-3 passages, max_turns 2 of Search-R1 = 3 env steps here). docs/verl.md.
#
# ALGO=st_ppo by default: the turn-level ratio and the clip-bias correction, which the stppo training engine applies
# on verl's FSDP2 engine; the settings step selects it (VERL_ENGINE_VENDOR=stppo in every Ray worker, actor strategy
# fsdp2) and the run logs actor/stppo/clip_bias_norm and clip_bias_scale every step. ALGO=turn_ppo: the same ratio
# without the correction.
#
# Needs: a GPU node with vLLM, `pip install -e ".[verl]"` (the verl.plugins entry point registers the stppo_*
# losses, the stppo_env agent loop and the stppo engine in every Ray worker), and a retrieval server per node:
#   stppo serve --retriever bm25:INDEX_DIR --port 8000
set -euo pipefail
ALGO=${ALGO:-st_ppo}
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
DATA=${DATA:-$HOME/data/stppo_verl}
RETRIEVER=${RETRIEVER:-http://127.0.0.1:8000}
GPUS=${GPUS:-8}
MAX_TURNS=3
OVERRIDES=$(python -m stppo_agent.integrations.verl.settings "$ALGO")  # fails here for a preset verl cannot run
case " $OVERRIDES " in  # the correction presets set the actor's strategy themselves (the engine is FSDP2's)
  *" actor_rollout_ref.actor.strategy="*) ;;
  *) OVERRIDES="$OVERRIDES actor_rollout_ref.actor.strategy=fsdp2" ;;
esac

python - <<PY
from stppo_agent.integrations.verl.data import export_verl
export_verl(["nq", "hotpotqa"], "train", "$DATA", dataset="hub", max_turns=$MAX_TURNS)
export_verl(["nq", "hotpotqa"], "test", "$DATA", dataset="hub", max_turns=$MAX_TURNS, limit=512)
PY
cat > "$DATA/agent_loops.yaml" <<YAML
- name: stppo_env
  _target_: stppo_agent.integrations.verl.agent_loop.StppoEnvAgentLoop
  retriever: $RETRIEVER
  topk: 3
  max_new_tokens_per_turn: 500
  max_observation_tokens: 500
YAML

# verl's default (V1) trainer imports transfer_queue, which only `pip install "verl[verl-core]"` brings (with video
# decoders this project does not need); without it, verl's classic trainer runs the same recipe
USE_V1=False
python -c "import transfer_queue" 2>/dev/null && USE_V1=True

# shellcheck disable=SC2086  # one override per word
python -m verl.trainer.main_ppo \
  $OVERRIDES \
  trainer.use_v1="$USE_V1" \
  data.train_files="[$DATA/nq_train.parquet,$DATA/hotpotqa_train.parquet]" \
  data.val_files="[$DATA/nq_test.parquet,$DATA/hotpotqa_test.parquet]" \
  data.train_batch_size=512 data.val_batch_size=256 \
  data.max_prompt_length=4096 data.max_response_length=2048 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=256 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=1 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$DATA/agent_loops.yaml" \
  critic.strategy=fsdp2 \
  critic.optim.lr=1e-5 \
  critic.model.path="$MODEL" \
  critic.ppo_micro_batch_size_per_gpu=8 \
  trainer.n_gpus_per_node="$GPUS" trainer.nnodes=1 \
  trainer.total_training_steps=1005 \
  trainer.project_name=stppo_verl trainer.experiment_name="$ALGO-nq-hotpotqa" \
  "$@"
