# Two entry points for a fresh machine (both idempotent):
#   make demo   -- install into .venv and run the embedded default (`stppo demo`, CPU)
#   make test   -- install with the test extras into .venv and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stppo-installed

VERL_VENV ?= .venv-verl
VERL_STAMP := $(VERL_VENV)/.stppo-installed
VERL_PY := $(VERL_VENV)/bin/python

TRL_VENV ?= .venv-trl
TRL_STAMP := $(TRL_VENV)/.stppo-installed
TRL_PY := $(TRL_VENV)/bin/python

.PHONY: demo test install mutants

install: $(STAMP)

# torch first and pinned: a bare `torch` requirement pulls a multi-GB CUDA build on CPU-only machines.
# Where torch is already importable (a GPU machine with its own build) it is left alone.
# pip byte-compiles every installed file on one core (half of the install's time); compileall does it on all cores
# afterwards. Compiled files matter here: with PYTHONDONTWRITEBYTECODE set (as on the CI machines) a venv without
# them recompiles torch and transformers in every process, ~8 s more per test subprocess. A package's own file that
# does not compile (test data in old syntax) is skipped, as pip skips it: hence `|| true`.
SITE_PACKAGES = $$($(1) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile "torch==2.13.0"
	$(PY) -m pip install -q --no-compile -e ".[dev,models]"
	$(PY) -m compileall -qq -j 0 $(call SITE_PACKAGES,$(PY)) > /dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/stppo demo

# Two pytest workers, one test file each at a time (files keep their module fixtures and their order), one OpenMP
# thread per worker so that the two do not fight over the cores (issue 28: 13 min sequential on 2 cores). The verl
# venv's install and tests run beside them as a third process, their output kept in .venv-verl/tests.log (shown
# whole if they fail, else its last line) so that the main suite's progress stays readable: the two workers leave 7%
# of the two cores idle, and run after them the verl part added 1.5-2 min to `make test` (631 s -> 594 s).
.PHONY: test-main test-verl
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory -j2 test-main test-verl test-trl

test-main: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-verl: $(VERL_STAMP)
	STPPO_REQUIRE_VERL=1 OMP_NUM_THREADS=1 $(VERL_PY) -m pytest -q tests/integrations/verl stppo_agent/integrations \
		tests/rollouts/test_turn_loop_on_a_real_tokenizer.py tests/rollouts/test_turn_cache.py \
		> $(VERL_VENV)/tests.log 2>&1 || { cat $(VERL_VENV)/tests.log; exit 1; }
	@echo "verl venv: $$(tail -n 1 $(VERL_VENV)/tests.log)"

# The verl bridge's tests run against verl itself, in a virtual environment of its own: verl 0.9 pins
# transformers<5.11, which the project's own environment does not have to follow. The rollout tests run there too,
# so the project is checked under verl's pins as well.
# The verl venv is layered on .venv: a .pth file puts .venv's site-packages after its own, so pip finds torch,
# pyserini, faiss, datasets ... already installed and adds only verl, what verl needs beyond them and its own pins
# (transformers, tokenizers, huggingface_hub, packaging), which come first on its path ("Not uninstalling ...
# outside environment" is pip leaving .venv's versions alone). 33 s instead of 110 s, 0.6 GB instead of 2.8.
$(VERL_STAMP): $(STAMP) pyproject.toml Makefile
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	echo $(call SITE_PACKAGES,$(PY)) > $(call SITE_PACKAGES,$(VERL_PY))/_stppo_layered_on_venv.pth
	$(VERL_PY) -m pip install -q --no-compile -e ".[dev,verl]"
	$(VERL_PY) -m compileall -qq -j 0 $(call SITE_PACKAGES,$(VERL_PY)) > /dev/null || true
	touch $(VERL_STAMP)

# The TRL side (stppo_agent/integrations/trl, docs/trl.md, benchmarks/peers.py) in a venv of its own, layered on
# .venv as the verl one is: TRL is not forced on every user, and its pins (trl>=1.16 needs Python 3.11) stay out of
# the project's environment. pip adds trl alone (its other requirements are already in .venv): 30 s, 32 MB. Its
# tests (TRL's GRPOTrainer through the adapter, docs/trl.md's example, `benchmarks/peers.py --quick`) run after
# test-verl, beside the main suite, with their output kept in .venv-trl/tests.log. The adapter's own protocol tests
# (tests/integrations/trl/test_environment.py) need no TRL: they run in the main suite.
.PHONY: test-trl
test-trl: $(TRL_STAMP)
	STPPO_REQUIRE_TRL=1 OMP_NUM_THREADS=1 $(TRL_PY) -m pytest -q tests/integrations/trl/test_grpo_trainer.py \
		tests/integrations/trl/test_docs_example.py tests/integrations/trl/test_peers_benchmark_quick.py \
		> $(TRL_VENV)/tests.log 2>&1 || { cat $(TRL_VENV)/tests.log; exit 1; }
	@echo "trl venv: $$(tail -n 1 $(TRL_VENV)/tests.log)"

$(TRL_STAMP): $(STAMP) pyproject.toml Makefile
	test -x $(TRL_PY) || $(PYTHON) -m venv $(TRL_VENV)
	echo $(call SITE_PACKAGES,$(PY)) > $(call SITE_PACKAGES,$(TRL_PY))/_stppo_layered_on_venv.pth
	$(TRL_PY) -m pip install -q --no-compile -e ".[dev,trl]"
	$(TRL_PY) -m compileall -qq -j 0 $(call SITE_PACKAGES,$(TRL_PY)) > /dev/null || true
	touch $(TRL_STAMP)

# Mutation testing (not in CI), in slices of an hour or more each on 2 cores: `make mutants SLICE=envs` (scoring,
# action parsing, the env and vector env, prompts, retrieval client/server/cache), `SLICE=evaluation` (evaluation,
# results, comparisons, the rollout loop and its budget), `SLICE=algorithms` (the algorithms' math), `SLICE=rollouts`
# (sampling, generation, KV-cache reuse, batches, statistics), `SLICE=training` (the trainer and its units, sft),
# `SLICE=data` (data loading and adapters, the retrieval backends and indexes), `SLICE=runs` (checkpoints, replay,
# run records, the collapse monitors), `SLICE=cli` (the commands), `SLICE=models` (model loading and precision, the
# process group and shared retrieval, plugins); no SLICE: all of them. Settings in pyproject.toml [tool.mutmut]; results in mutants/
# (`.venv/bin/mutmut browse` to read the survivors); NOTES.md has the scores and the equivalent mutants per module,
# taken in one process with tests/support/mutants_in_process.py (faster; its docstring says how).
MUTANTS_envs := "stppo_envs.scoring.*" "stppo_envs.actions.*" "stppo_envs.env.*" "stppo_envs.vector.*" \
	"stppo_envs.prompts.*" "stppo_envs.retrieval.base.*" "stppo_envs.retrieval.remote.*" "stppo_envs.retrieval.server.*"
MUTANTS_evaluation := "stppo_agent.evaluation.*" "stppo_agent.rollouts.turn_loop.*"
MUTANTS_algorithms := "stppo_agent.algorithms.*"
MUTANTS_rollouts := "stppo_agent.rollouts.*"
MUTANTS_training := "stppo_agent.training.*"
MUTANTS_data := "stppo_envs.data.*" "stppo_envs.retrieval.bm25.*" "stppo_envs.retrieval.dense.*" \
	"stppo_envs.retrieval.dense_build.*" "stppo_envs.retrieval.encoder.*" "stppo_envs.retrieval.indexing.*" \
	"stppo_envs.retrieval.factory.*" "stppo_envs.retrieval._pyserini.*" "stppo_envs.toy.*" "stppo_envs.spaces.*" \
	"stppo_envs.suggest.*"
MUTANTS_runs := "stppo_agent.runs.*" "stppo_agent.monitoring.*"
MUTANTS_cli := "stppo_agent.cli.*"
MUTANTS_models := "stppo_agent.models.*" "stppo_agent.distributed.*" "stppo_agent.plugins.*"
SLICE ?=
MUTANTS ?= $(if $(SLICE),$(MUTANTS_$(SLICE)),)
mutants: $(STAMP)
	$(PY) -m pip install -q -e ".[mutation]"
	HF_DATASETS_DISABLE_PROGRESS_BARS=1 $(VENV)/bin/mutmut run --max-children 2 $(MUTANTS)
	$(VENV)/bin/mutmut results --all true > mutants/summary.txt || true
	$(PY) -c "import re,collections as c;r=re.findall(r'^\s*(\S+?)\.x\S*: ([a-z ]+)$$',open('mutants/summary.txt').read(),re.M);\
	n=c.defaultdict(c.Counter);[n[m].update([s]) for m,s in r];\
	[print(f'{m:48} {dict(n[m])}') for m in sorted(n)]"
