"""Input a user gives by mistake is refused with the fix named, and files saved with a UTF-8 BOM load like others
(probes of session 13: each test failed on the code before its fix)."""

from __future__ import annotations

import codecs
import json
import re

import pytest

from stppo_envs.data.loading import load_examples

from .cli_in_process import stppo


def test_a_csv_saved_with_a_utf8_bom_loads_like_one_without(tmp_path):
    # Excel's "CSV UTF-8" export starts the file with a byte-order mark; the header's first name must not keep it.
    text = 'id,question,golden_answers\nb1,Who wrote Velmaria?,"Jane Doe"\nb2,Where is Ostrand?,inland\n'
    plain, bom = tmp_path / "plain.csv", tmp_path / "bom.csv"
    plain.write_text(text, encoding="utf-8")
    bom.write_bytes(codecs.BOM_UTF8 + text.encode("utf-8"))
    with_bom = load_examples("nq", dataset=bom)
    assert [(e.id, e.question, tuple(e.golden_answers)) for e in with_bom] == \
        [(e.id, e.question, tuple(e.golden_answers)) for e in load_examples("nq", dataset=plain)]
    assert [e.id for e in with_bom] == ["b1", "b2"]



@pytest.mark.parametrize("names, twice", [("nq,hotpotqa,nq", "nq"), ("mmlu_med,mmlu-medical", "mmlu_med")])
def test_eval_refuses_a_benchmark_named_twice(tmp_path, capsys, names, twice):
    # evaluated twice it wrote two records of one benchmark: the QA average counted it twice, compare read one
    done = stppo("eval", "--agent", "oracle", "--benchmarks", names, "--limit", "1",
                 "--output-dir", str(tmp_path / "out"), capsys=capsys)
    assert done.returncode == 1 and f"--benchmarks names {twice} twice" in done.stderr
    assert not (tmp_path / "out").exists()


def test_eval_refuses_a_search_error_limit_outside_zero_to_one(tmp_path, capsys):
    # -1 reported "searches failed (nq 0.0%; limit -100.0%)" for searches that never failed
    with pytest.raises(SystemExit):
        stppo("eval", "--agent", "oracle", "--benchmarks", "nq", "--limit", "1", "--max-search-error-rate", "-0.1",
              "--output-dir", str(tmp_path / "out"), capsys=capsys)
    assert "--max-search-error-rate: must be a share in [0, 1], got -0.1" in capsys.readouterr().err
    done = stppo("eval", "--agent", "oracle", "--benchmarks", "nq", "--limit", "1", "--max-search-error-rate", "0",
                 "--output-dir", str(tmp_path / "ok"), capsys=capsys)
    assert done.returncode == 0
    assert [r["benchmark"] for r in json.loads((tmp_path / "ok" / "results.json").read_text())] == ["nq"]


@pytest.mark.parametrize("field, value, says", [
    # clipping to norm 0 zeroed every gradient: no learning; a negative clip coefficient ascended the loss
    ("optimizer.max_grad_norm", 0.0, "optimizer.max_grad_norm must be > 0"),
    ("optimizer.max_grad_norm", -1.0, "optimizer.max_grad_norm must be > 0"),
    # a negative rate stopped the run: "0% of searches failed"
    ("monitor.max_search_error_rate", -1.0, "monitor.max_search_error_rate must be in [0, 1]"),
    ("monitor.max_search_error_rate", 1.5, "monitor.max_search_error_rate must be in [0, 1]"),
    ("optimizer.actor_lr", -1e-3, "optimizer.actor_lr must be >= 0"),
    ("optimizer.critic_lr", -1e-3, "optimizer.critic_lr must be >= 0"),
    ("optimizer.weight_decay", -0.1, "optimizer.weight_decay must be >= 0"),
    ("optimizer.warmup_steps", -5, "optimizer.warmup_steps must be >= 0"),
    ("rollout.vllm_gpu_memory_utilization", 1.5, "rollout.vllm_gpu_memory_utilization must be in (0, 1]"),
])
def test_train_config_refuses_nonsensical_optimizer_and_stop_settings(field, value, says):
    from stppo_agent.training.config import TrainConfig

    section, _, key = field.partition(".")
    config = TrainConfig(algo="ppo", env="stppo/Toy-v0", model="tiny", output_dir="unused", **{section: {key: value}})
    with pytest.raises(ValueError, match=f"^{re.escape(says)}"):
        config.validate()
    TrainConfig(algo="ppo", env="stppo/Toy-v0", model="tiny", output_dir="unused").validate()


def test_eval_refuses_two_datasets_for_one_benchmark(tmp_path, capsys):
    # the second silently replaced the first (a dict); which file was evaluated depended on the flags' order
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, answer in ((first, "x"), (second, "y")):
        path.write_text(json.dumps({"id": "q1", "question": "Who?", "golden_answers": [answer]}) + "\n")
    done = stppo("eval", "--agent", "oracle", "--benchmarks", "nq", "--retriever", "demo", "--dataset", f"nq={first}",
                 "--dataset", f"NQ={second}", "--output-dir", str(tmp_path / "out"), capsys=capsys)
    assert done.returncode == 1 and "--dataset names nq twice" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.json", "corpus.jsonl.gz"])
def test_a_corpus_saved_with_a_utf8_bom_reads_like_one_without(tmp_path, name):
    # a dataset file with a BOM loaded, the corpus beside it was refused: "Unexpected UTF-8 BOM"
    import gzip

    from stppo_envs.retrieval.indexing import iter_contents

    records = [{"id": "d1", "contents": "\"Velmaria\"\nVelmaria is a country."}, {"id": "d2", "title": "Ostrand",
                                                                               "text": "Ostrand is inland."}]
    text = (json.dumps(records) if name == "corpus.json" else "\n".join(map(json.dumps, records)) + "\n")
    data = codecs.BOM_UTF8 + text.encode("utf-8")
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert list(iter_contents(path)) == [("d1", "\"Velmaria\"\nVelmaria is a country."),
                                         ("d2", "\"Ostrand\"\nOstrand is inland.")]


def test_a_keyed_pubmedqa_json_with_a_utf8_bom_loads_like_one_without(tmp_path):
    # with the BOM its first line no longer started with "{": read as records, the PMIDs became field names
    records = {"123": {"QUESTION": "Does X help?", "final_decision": "yes", "CONTEXTS": ["c"]},
               "456": {"QUESTION": "Does Y help?", "final_decision": "no", "CONTEXTS": ["d"]}}
    path = tmp_path / "ori_pqal.json"
    path.write_bytes(codecs.BOM_UTF8 + json.dumps(records, indent=1).encode("utf-8"))
    assert [(e.id, e.question) for e in load_examples("pubmedqa", dataset=path)] == \
        [("123", "Does X help?"), ("456", "Does Y help?")]


def _sft_config(monkeypatch, capsys, *args):
    import stppo_agent.training.sft as sft

    seen = []

    def captured(config):
        seen.append(config)
        raise ValueError("captured")  # the training itself is not the point

    monkeypatch.setattr(sft, "train_sft", captured)
    done = stppo("sft", "--model", "tiny", "--output-dir", "unused", *args, capsys=capsys)
    return done, (seen[0] if seen else None)


def test_sft_uses_the_dataset_given_for_a_benchmark_spelt_another_way(monkeypatch, capsys):
    # --benchmarks NQ --dataset nq=PATH: the dataset was keyed "nq", looked up as "NQ", and the demo set played
    done, config = _sft_config(monkeypatch, capsys, "--benchmarks", "NQ,mmlu-medical", "--dataset", "nq=data/nq.jsonl",
                               "--dataset", "mmlu_med=data/mmlu", "--retriever", "bm25:idx")
    assert "captured" in done.stderr
    assert [config.datasets.get(name) for name in config.benchmarks] == ["data/nq.jsonl", "data/mmlu"]


@pytest.mark.parametrize("args, says", [
    (("--benchmarks", "nq", "--dataset", "hotpotqa=data/h.jsonl"), "--dataset given for hotpotqa"),
    (("--benchmarks", "nq,NQ"), "--benchmarks names nq twice"),
])
def test_sft_refuses_a_stray_dataset_and_a_benchmark_named_twice(monkeypatch, capsys, args, says):
    done, config = _sft_config(monkeypatch, capsys, *args)
    assert done.returncode == 1 and says in done.stderr and config is None


def test_replay_refuses_another_rollout_staleness_than_the_recorded_one(tmp_path):
    # the recorded tokens were sampled by weights K iterations old; a replay with another K took its behaviour
    # log-probs from other weights than those that sampled them (iteration 3 of a K=1 recording replayed with K=2
    # logged other ratios and clip fractions, while temperature, top_p and top_k are refused)
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
    from stppo_agent.training.replay import replay_config
    from stppo_agent.training.trainer import Trainer

    from .test_trainer import toy_config

    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    run = tmp_path / "run"
    Trainer(toy_config(model, run, "ppo", iterations=1,
                       rollout=dict(prompts_per_iteration=2, samples_per_prompt=2, staleness=1),
                       optimizer=dict(mini_batch_size=4, micro_batch_size=4, epochs=1),
                       logging=dict(save_rollouts=True))).train()
    for other in (0, 2):
        with pytest.raises(ValueError, match=r"rollout.staleness=1 recorded, rollout.staleness=%d asked" % other):
            replay_config(run, "grpo", str(tmp_path / "unused"), [f"rollout.staleness={other}"])
    assert replay_config(run, "grpo", str(tmp_path / "unused"),
                         ["rollout.stale_objective=decoupled"]).rollout.staleness == 1
