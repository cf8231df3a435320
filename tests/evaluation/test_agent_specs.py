"""``stppo_agent.evaluation.agent_specs``: what ``--agent SPEC`` builds,
``hf:RUN@...`` resolved to a checkpoint, the hf: agent cache, registered agents."""

from __future__ import annotations

import pytest

from stppo_agent.evaluation import agent_specs, hf_agent
from stppo_agent.evaluation.agent_specs import (
    SCRIPTED_AGENTS,
    SPEC_HELP,
    build_agent,
    check_agent_spec,
    register_agent,
    resolve_agent_spec,
)
from stppo_agent.evaluation.agents import DEFAULT_MAX_OBSERVATION_TOKENS, NoSearchAgent, OracleAgent
from stppo_agent.evaluation.evaluate import EvalSettings, evaluate_benchmark
from stppo_agent.evaluation.openai_agent import OpenAIChatAgent
from tests.support.evaluation import QA, view
from tests.support.retrievers import KeywordRetriever


# -- agent_specs.py ---------------------------------------------------------------------------------------------
def test_agent_specs_build_agent_picks_the_agent_the_spec_names(monkeypatch):
    assert type(build_agent("oracle", [QA])) is OracleAgent
    assert build_agent("gold-search", [QA]).act([view(turn=0, max_turns=1)])[0].endswith("Shakespeare </answer>")
    seen = []
    monkeypatch.setattr(agent_specs, "_hf_agent", lambda path, tokens, cut: seen.append((path, tokens)) or "hf")
    assert build_agent("hf:some/model", [QA], max_new_tokens=33) == "hf" and seen == [("some/model", 33)]
    assert build_agent("hf:other", []) == "hf" and seen[-1] == ("other", 256)
    agent = build_agent("openai:http://h:1/v1#m:7b", [], max_new_tokens=12)
    assert type(agent) is OpenAIChatAgent and (agent.url, agent.model, agent.max_tokens) == (
        "http://h:1/v1/chat/completions", "m:7b", 12)
    assert build_agent("openai:http://h:1/v1#m", []).max_tokens == 256
    with pytest.raises(ValueError, match="unknown agent spec 'oracel' \\(did you mean oracle\\?\\)"):
        build_agent("oracel", [QA])


def test_agent_specs_check_refuses_bare_prefixes_and_unknown_names_with_the_help():
    for spec in ("oracle", "hf:x", "openai:y"):
        check_agent_spec(spec)
    for spec in ("hf:", "openai:", "", "hf", "HF:x"):
        with pytest.raises(ValueError, match=f"unknown agent spec {spec!r}"):
            check_agent_spec(spec)
    with pytest.raises(ValueError) as info:
        check_agent_spec("no-serch")
    assert str(info.value) == ("unknown agent spec 'no-serch' (did you mean no-search?); agent specs: hf:PATH (a "
                               "checkpoint folder, or hf:smollm2), hf:RUN@best|@latest|@healthy|@STEP (a checkpoint "
                               "of a training run), openai:http://HOST:PORT/v1#MODEL, gold-search, no-search, oracle, "
                               "search-copy")
    assert SPEC_HELP == str(info.value).split("; ", 1)[1]


def test_agent_specs_register_agent_checks_the_name_and_lists_the_plugin_in_the_help():
    factory = lambda examples: NoSearchAgent()  # noqa: E731
    for bad in ("", "hf:x", "openai:y", "a:b", 3, None):
        with pytest.raises(ValueError, match=r"agent names must be non-empty and have no ':' \(it marks hf:/openai: "
                                             r"specs\), got " + repr(bad).replace("(", r"\(")):
            register_agent(bad, factory)
    with pytest.raises(ValueError, match="agent 'oracle' is already registered; choose another name"):
        register_agent("oracle", factory)
    register_agent("mine", factory)
    assert SCRIPTED_AGENTS["mine"] is factory and type(build_agent("mine", [])) is NoSearchAgent
    with pytest.raises(ValueError) as info:
        check_agent_spec("mien")
    assert str(info.value).endswith("#MODEL, gold-search, mine, no-search, oracle, search-copy")
    assert "(did you mean mine?)" in str(info.value)


def test_agent_specs_the_hf_agent_cache_keys_on_path_tokens_and_the_folders_files(monkeypatch, tmp_path):
    made = []

    class Fake:
        def __init__(self, path, max_new_tokens, max_observation_tokens):
            made.append((path, max_new_tokens))

    monkeypatch.setattr(hf_agent, "HFAgent", Fake)
    agent_specs._cached_hf_agent.cache_clear()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"12")
    (folder / "sub").mkdir()
    first = agent_specs._hf_agent(str(folder), 8)
    assert agent_specs._hf_agent(str(folder), 8) is first and made == [(str(folder), 8)]
    assert agent_specs._hf_agent(str(folder), 9) is not first  # another token limit: another agent
    assert agent_specs._hf_agent(str(folder), 8, 700) is not first  # another observation cut: another agent
    stat = (folder / "w.bin").stat()
    assert agent_specs._folder_stamp(str(folder)) == (("w.bin", 2, stat.st_mtime_ns),)
    (folder / "w.bin").write_bytes(b"123")
    assert agent_specs._hf_agent(str(folder), 8) is not first and made[-1] == (str(folder), 8)
    assert agent_specs._folder_stamp("smollm2") == () and agent_specs._folder_stamp(str(folder / "w.bin")) == ()
    agent_specs._cached_hf_agent.cache_clear()


def test_agent_specs_run_likeness_and_local_paths():
    assert agent_specs._is_local_path("./m") and agent_specs._is_local_path("/m") and agent_specs._is_local_path("~m")
    assert agent_specs._is_local_path("a/b/c") and agent_specs._is_local_path("a\\b")
    assert not agent_specs._is_local_path("org/name") and not agent_specs._is_local_path("name")


def test_agent_specs_run_like_folders(tmp_path):
    assert not agent_specs.is_run_like(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    assert not agent_specs.is_run_like(tmp_path / "file")
    assert not agent_specs.is_run_like(tmp_path)  # a folder with none of a run's files
    for name in ("checkpoints", "config.yaml", "metrics.jsonl"):
        run = tmp_path / name.replace(".", "_")
        run.mkdir()
        (run / name).write_text("")
        assert agent_specs.is_run_like(run)
        (run / "config.json").write_text("{}")
        assert not agent_specs.is_run_like(run)  # a model folder


def make_run(root, steps=(3,), extra=()):
    root.mkdir(parents=True)
    for step in steps:
        (root / "checkpoints" / f"step-{step}").mkdir(parents=True)
    (root / "checkpoints").mkdir(exist_ok=True)
    for name in extra:
        (root / name).write_text("")
    return root


def test_agent_specs_resolve_names_the_checkpoint_chosen(monkeypatch, tmp_path):
    from stppo_agent.runs import run_folder

    asked = []
    monkeypatch.setattr(run_folder, "pick_checkpoint", lambda run, which: asked.append((run, which)) or (
        run / "checkpoints" / "step-3", f"the {which} one"))
    run = make_run(tmp_path / "run")
    assert resolve_agent_spec(f"hf:{run}@best") == (f"hf:{run}/checkpoints/step-3/actor",
                                                    f"hf:{run}@best -> the best one")
    assert asked[-1] == (run, "best")
    for which in ("latest", "healthy", "7"):
        assert resolve_agent_spec(f"hf:{run}@{which}")[1] == f"hf:{run}@{which} -> the {which} one"
        assert asked[-1] == (run, which)
    assert resolve_agent_spec(f"hf:{run}") == (f"hf:{run}/checkpoints/step-3/actor", f"hf:{run} -> the latest one")
    assert asked[-1] == (run, "latest")
    assert resolve_agent_spec("oracle") == ("oracle", None)
    assert resolve_agent_spec("openai:http://h/v1#m") == ("openai:http://h/v1#m", None)
    with pytest.raises(ValueError, match=r"@bset: choose @latest, @best, @healthy or a step number \(did you mean "
                                         r"@best\?\)"):
        resolve_agent_spec(f"hf:{run}@bset")
    with pytest.raises(ValueError, match="unknown agent spec"):
        resolve_agent_spec("hf:")
    at = make_run(tmp_path / "at@home" / "run")  # the checkpoint is chosen after the last '@'
    assert resolve_agent_spec(f"hf:{at}@healthy")[0] == f"hf:{at}/checkpoints/step-3/actor"
    assert asked[-1] == (at, "healthy")


def test_agent_specs_resolve_keeps_model_folders_and_hub_names(monkeypatch, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_agent_spec(f"hf:{model}") == (f"hf:{model}", None)
    assert resolve_agent_spec("hf:org/name") == ("hf:org/name", None)
    assert resolve_agent_spec("hf:org/name@v2") == ("hf:org/name@v2", None)  # not a run: '@' is part of the name
    assert resolve_agent_spec("hf:smollm2") == ("hf:smollm2", None)
    with pytest.raises(FileNotFoundError, match="~nosuchuser27/m does not exist"):
        resolve_agent_spec("hf:~nosuchuser27/m")  # spelt like a path: a missing folder, never a hub name
    with pytest.raises(FileNotFoundError, match="~nosuchuser27 does not exist"):
        resolve_agent_spec("hf:~nosuchuser27")
    with pytest.raises(ValueError, match="model 'smolm2' is neither a folder nor a known alias"):
        resolve_agent_spec("hf:smolm2")
    with pytest.raises(FileNotFoundError, match="is a model folder \\(config.json\\), not a training run: use "
                                                f"hf:{model} without @best"):
        resolve_agent_spec(f"hf:{model}@best")


def test_agent_specs_resolve_says_what_a_folder_without_checkpoints_holds(monkeypatch, tmp_path):
    run = make_run(tmp_path / "run", steps=(), extra=("config.yaml",))
    with pytest.raises(FileNotFoundError) as info:
        resolve_agent_spec(f"hf:{run}@latest")
    assert str(info.value) == (f"{run} holds no checkpoint (checkpoints/ is empty), so there is no @latest; "
                               "it holds: checkpoints/, config.yaml")
    (run / "checkpoints" / "junk").mkdir()
    (run / "checkpoints" / "a.txt").write_text("")
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint \(checkpoints/ holds only a.txt, junk\), so "
                                                r"there is no @latest"):
        resolve_agent_spec(f"hf:{run}")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text('{"a": 1}\n\n{"a": 2}\n')
    with pytest.raises(FileNotFoundError) as info:
        resolve_agent_spec(f"hf:{stopped}@best")
    assert str(info.value) == (f"{stopped} holds no checkpoint; it holds: metrics.jsonl (2 records). A run writes "
                               "checkpoints/step-N every checkpoint.every iterations and at its end")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"^{empty} holds no checkpoint; it is empty. A run"):
        resolve_agent_spec(f"hf:{empty}@3")
    (tmp_path / "afile").write_text("")
    with pytest.raises(FileNotFoundError, match="afile is a file, not a run folder$"):
        resolve_agent_spec(f"hf:{tmp_path / 'afile'}@latest")


def test_agent_specs_resolve_lists_a_missing_folders_parent_with_a_suggestion(tmp_path):
    (tmp_path / "runs" / "tour").mkdir(parents=True)
    (tmp_path / "runs" / ".hidden").mkdir()
    with pytest.raises(FileNotFoundError) as info:
        resolve_agent_spec(f"hf:{tmp_path}/runs/tuor/toy")
    assert str(info.value) == (f"{tmp_path}/runs/tuor/toy does not exist; {tmp_path}/runs holds: tour "
                               "(did you mean tour?)")
    with pytest.raises(FileNotFoundError, match="does not exist; .*runs holds: tour"):
        resolve_agent_spec(f"hf:{tmp_path}/runs/tuor@best")
    (tmp_path / "none").mkdir()
    assert agent_specs.missing_folder(tmp_path / "none" / "x") == f"{tmp_path}/none/x does not exist; " \
                                                                   f"{tmp_path}/none is empty"
    many = tmp_path / "many"
    many.mkdir()
    for i in range(13):
        (many / f"f{i:02d}").write_text("")
    text = agent_specs.missing_folder(many / "zzz")
    assert text.endswith("f09, f10, f11, ...") and "f12" not in text
    (many / "f12").unlink()
    assert agent_specs.missing_folder(many / "zzz").endswith("f10, f11")  # exactly twelve: all shown
    (tmp_path / "plain").write_text("")
    assert agent_specs.missing_folder(tmp_path / "plain" / "x") == f"{tmp_path}/plain/x does not exist"


def test_agent_specs_listing_counts_records_and_cuts_after_twelve(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"a": 1}\n')
    (tmp_path / "d").mkdir()
    assert agent_specs.folder_listing(tmp_path) == "d/, metrics.jsonl (1 record)"
    for i in range(12):
        (tmp_path / f"x{i:02d}").write_text("")
    assert agent_specs.folder_listing(tmp_path).endswith("x09, ... (2 more)")
    assert agent_specs.folder_listing(tmp_path, limit=14).endswith("x11")
    (tmp_path / "metrics.jsonl").write_bytes(b'{"a": "\xff\xfe"}\n{}\n')  # a torn multi-byte character
    assert "metrics.jsonl (2 records)" in agent_specs.folder_listing(tmp_path)


def test_agent_specs_resolve_adds_the_listing_when_no_checkpoint_verifies(tmp_path):
    run = make_run(tmp_path / "run", steps=(5, 2), extra=("config.yaml",))
    with pytest.raises(FileNotFoundError) as info:
        resolve_agent_spec(f"hf:{run}@latest")
    assert str(info.value) == (f"{run} has no checkpoint that verifies; {run} holds: checkpoints/, config.yaml; "
                               "checkpoints/ holds: step-2, step-5")
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_a_checkpoint_rewritten_in_place_is_loaded_afresh(monkeypatch, tmp_path):
    class Fake:
        def __init__(self, path, max_new_tokens, max_observation_tokens):
            self.path = path

    monkeypatch.setattr(hf_agent, "HFAgent", Fake)
    agent_specs._cached_hf_agent.cache_clear()
    try:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        (folder / "w.bin").write_bytes(b"12")
        first = agent_specs._hf_agent(str(folder), 8)
        assert agent_specs._hf_agent(str(folder), 8) is first
        (folder / "w.bin").write_bytes(b"123")
        second = agent_specs._hf_agent(str(folder), 8)
        assert second is not first and agent_specs._hf_agent(str(folder), 8) is second
    finally:
        agent_specs._cached_hf_agent.cache_clear()


def test_the_observation_cut_and_token_budget_reach_the_agent_builder(monkeypatch):
    built = []

    def build_agent(spec, examples, max_new_tokens=256, max_observation_tokens=DEFAULT_MAX_OBSERVATION_TOKENS):
        built.append((spec, max_new_tokens, max_observation_tokens))
        return NoSearchAgent()

    monkeypatch.setattr(agent_specs, "build_agent", build_agent)
    settings = EvalSettings("nq", limit=1, retriever=KeywordRetriever(), max_new_tokens=33,
                            max_observation_tokens=77)
    result = evaluate_benchmark("no-search", settings)
    assert built == [("no-search", 33, 77)]
    assert result["provenance"]["max_new_tokens"] == 33 and result["provenance"]["max_observation_tokens"] == 77
