"""Pins of the evaluation agents (issue 27): what `stppo evaluate --agent SPEC` builds from a spec, the scripted
baselines' actions, the settings an hf: agent hands its generation backend, the request an openai: agent sends,
and the tables' layout. Test names start with the module they pin (the mutation loop selects by that prefix)."""

from __future__ import annotations

import threading

import pytest

from stppo_agent.evaluation import agent_specs, hf_agent, openai_agent
from stppo_agent.evaluation.agent_specs import (
    SCRIPTED_AGENTS,
    SPEC_HELP,
    build_agent,
    check_agent_spec,
    register_agent,
    resolve_agent_spec,
)
from stppo_agent.evaluation.agents import (
    EpisodeView,
    GoldSearchAgent,
    NoSearchAgent,
    OracleAgent,
    SearchCopyAgent,
    best_overlapping_option,
    by_id,
    gold_answers,
)
from stppo_agent.evaluation.openai_agent import OpenAIChatAgent, messages
from stppo_agent.evaluation.tables import fixed_width_table
from stppo_envs import Example, Segment

QA = Example("q1", "Who wrote Hamlet?", ("Shakespeare", "William Shakespeare"), "nq",
             metadata={"supporting_titles": ["Hamlet", "Stratford"]})
MCQ = Example("m1", "Which lowers glucose?", ("insulin", "B"), "medqa", choices={"A": "aspirin", "B": "insulin"},
              answer_letter="B")


def view(turn=0, transcript=None, example=QA, max_turns=None, episode_id=None, choices=None):
    transcript = transcript or (Segment("user", f"PROMPT {example.question}", -1),)
    return EpisodeView(example.id, example.question, choices, tuple(transcript), turn, max_turns, episode_id)


# -- agents.py --------------------------------------------------------------------------------------------------
def test_agents_episode_view_defaults_its_episode_id_to_the_example_and_shows_the_last_segment():
    episode = view(transcript=[Segment("user", "p", -1), Segment("assistant", "a", 0), Segment("environment", "o", 0)])
    assert episode.episode_id == "q1" and episode.max_turns is None and episode.last_observation == "o"
    assert view(episode_id="q1#2").episode_id == "q1#2"


def test_agents_oracle_and_no_search_say_exactly_these_actions():
    assert OracleAgent([QA, MCQ]).act([view(), view(example=MCQ)]) == [
        "<think>I know this.</think>\n<answer> Shakespeare </answer>",
        "<think>I know this.</think>\n<answer> B </answer>"]  # the first golden answer; the letter for MCQ
    assert NoSearchAgent().act([view(), view()]) == ["<think>I will not search.</think>\n<answer> ∅ </answer>"] * 2
    assert gold_answers([QA, MCQ]) == {"q1": "Shakespeare", "m1": "B"}
    assert OracleAgent.name == "oracle" and NoSearchAgent.name == "no-search"


def test_agents_by_id_refuses_a_repeated_id_and_keeps_the_order():
    other = Example("q2", "Capital of Peru?", ("Lima",), "nq")
    assert by_id([other, QA]) == [other, QA]
    with pytest.raises(ValueError, match=r"example id 'q1' occurs more than once; scripted agents look examples up "
                                         r"by id, so each needs its own"):
        by_id([QA, other, QA])


def test_agents_gold_search_searches_the_question_then_each_missing_hop_then_answers():
    agent = GoldSearchAgent([QA])
    assert agent.name == "gold-search"
    assert agent.act([view(turn=0, max_turns=4)]) == [
        "<think>I need to look this up.</think>\n<search> Who wrote Hamlet? </search>"]
    seen_first = [Segment("user", "p", -1), Segment("assistant", "s", 0),
                  Segment("environment", 'Doc 1(Title: "Hamlet") text', 0)]
    assert agent.act([view(turn=1, transcript=seen_first, max_turns=4)]) == [
        "<think>I still need to know about Stratford.</think>\n<search> Stratford </search>"]
    # a title in an assistant segment was not retrieved: only the environment's segments count
    said_not_seen = [Segment("user", 'p (Title: "Hamlet")', -1), Segment("assistant", '(Title: "Stratford")', 0),
                     Segment("environment", "nothing", 0)]
    assert "know about Hamlet" in agent.act([view(turn=1, transcript=said_not_seen, max_turns=4)])[0]
    both = seen_first + [Segment("environment", 'Doc 1(Title: "Stratford") x', 1)]
    answer = "<think>The documents answer it.</think>\n<answer> Shakespeare </answer>"
    assert agent.act([view(turn=2, transcript=both, max_turns=4)]) == [answer]
    # the last turn answers whatever is missing: turn 2 of 3 (max_turns - 1), and turn 0 of a one-turn episode
    assert agent.act([view(turn=2, transcript=seen_first, max_turns=3)]) == [answer]
    assert agent.act([view(turn=1, transcript=seen_first, max_turns=3)])[0].startswith("<think>I still need")
    assert agent.act([view(turn=0, max_turns=1)]) == [answer]
    assert agent.act([view(turn=0, max_turns=2)])[0].endswith("<search> Who wrote Hamlet? </search>")
    assert agent.act([view(turn=5, transcript=seen_first)])[0].startswith("<think>I still need")  # no limit known
    single = Example("s1", "Capital of Peru?", ("Lima",), "nq")  # no supporting titles: one search, then answer
    assert GoldSearchAgent([single]).act([view(turn=1, example=single, transcript=seen_first)]) == [
        "<think>The documents answer it.</think>\n<answer> Lima </answer>"]


def test_agents_search_copy_searches_once_then_copies_the_top_title_or_the_best_option():
    agent = SearchCopyAgent()
    assert agent.name == "search-copy"
    assert agent.act([view()]) == ["<think>Let me look it up.</think>\n<search> Who wrote Hamlet? </search>"]
    docs = 'Doc 1(Title: "Shakespeare") wrote it\nDoc 2(Title: "Marlowe") did not'
    turn1 = [Segment("user", "p", -1), Segment("assistant", "s", 0), Segment("environment", "old", 0),
             Segment("environment", docs, 0)]
    assert agent.act([view(turn=1, transcript=turn1)]) == ["<answer> Shakespeare </answer>"]
    nothing = turn1[:-1] + [Segment("environment", "no documents", 0)]
    assert agent.act([view(turn=1, transcript=nothing)]) == ["<answer> unknown </answer>"]
    mcq = turn1[:-1] + [Segment("environment", "insulin is a hormone", 0)]
    assert agent.act([view(turn=1, transcript=mcq, example=MCQ, choices=MCQ.choices)]) == ["<answer> B </answer>"]


def test_agents_best_overlapping_option_counts_every_occurrence_and_breaks_ties_to_the_first_letter():
    assert best_overlapping_option("Insulin, insulin and aspirin", {"A": "aspirin", "B": "insulin"}) == "B"
    assert best_overlapping_option("aspirin insulin", {"B": "insulin", "A": "aspirin"}) == "A"
    assert best_overlapping_option("nothing here", {"C": "x", "D": "y"}) == "C"
    assert best_overlapping_option("the red car", {"A": "blue car", "B": "red car"}) == "B"


def test_agents_the_scripted_registry_builds_each_baseline():
    assert sorted(SCRIPTED_AGENTS) == ["gold-search", "no-search", "oracle", "search-copy"]
    for name, cls in (("oracle", OracleAgent), ("no-search", NoSearchAgent), ("search-copy", SearchCopyAgent),
                      ("gold-search", GoldSearchAgent)):
        agent = SCRIPTED_AGENTS[name]([QA])
        assert type(agent) is cls and agent.name == name


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


# -- hf_agent.py ------------------------------------------------------------------------------------------------
class FakeTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [len(w) for w in text.split()]}

    def decode(self, ids, skip_special_tokens=False):
        return ("S:" if skip_special_tokens else "") + " ".join(map(str, ids))


class FakeModel:
    def __init__(self, path, dtype):
        self.path, self.dtype, self.device, self.evaluated = path, dtype, None, False

    def to(self, device):
        self.device = device
        return self

    def eval(self):
        self.evaluated = True
        return self


class Generation:
    def __init__(self, ids):
        self.token_ids = ids


class FakeBackend:
    def __init__(self, model, tokenizer, sampling, batch_size, reuse_cache):
        self.model, self.sampling, self.batch_size, self.reuse_cache = model, sampling, batch_size, reuse_cache
        self.tokenizer = tokenizer
        self.calls, self.ended = [], 0

    def generate(self, contexts, max_new_tokens, keys):
        self.calls.append(([list(c) for c in contexts], max_new_tokens, list(keys)))
        return [Generation([7] * (i + 1)) for i in range(len(contexts))]

    def end_rollout(self):
        self.ended += 1


@pytest.fixture
def fake_hf(monkeypatch):
    from stppo_agent.models import default_model, loading

    monkeypatch.setattr(default_model, "resolve_model", lambda path: f"resolved/{path}")
    monkeypatch.setattr(loading, "load_tokenizer", lambda path: FakeTokenizer() if path.startswith("resolved/") else
                        None)
    monkeypatch.setattr(loading, "load_actor", FakeModel)
    monkeypatch.setattr(hf_agent, "HFGenerationBackend", FakeBackend)


def test_hf_agent_hands_its_settings_to_the_loader_and_the_backend(fake_hf):
    from stppo_agent.rollouts.sampling import SamplingSettings

    agent = hf_agent.HFAgent("ckpt")
    assert agent.name == "hf:ckpt" and agent.model.path == "resolved/ckpt" and agent.model.dtype == "float32"
    assert agent.model.device == "cpu" and agent.model.evaluated  # no GPU here
    assert agent.backend.model is agent.model and agent.backend.tokenizer is agent.tokenizer
    assert isinstance(agent.tokenizer, FakeTokenizer)
    assert agent.backend.sampling == SamplingSettings(greedy=True) and agent.backend.batch_size == 16
    assert agent.backend.reuse_cache is True and (agent.max_new_tokens, agent.max_observation_tokens) == (256, 512)
    sampling = SamplingSettings(temperature=0.7, top_p=0.9)
    other = hf_agent.HFAgent("p", max_new_tokens=5, max_observation_tokens=2, sampling=sampling, device="meta",
                             batch_size=3, dtype="bfloat16", reuse_cache=False)
    assert (other.model.device, other.model.dtype, other.backend.sampling) == ("meta", "bfloat16", sampling)
    assert (other.backend.batch_size, other.backend.reuse_cache, other.max_new_tokens,
            other.max_observation_tokens) == (3, False, 5, 2)


def test_hf_agent_goes_to_the_gpu_when_there_is_one(fake_hf, monkeypatch):
    monkeypatch.setattr(hf_agent.torch.cuda, "is_available", lambda: True)
    assert hf_agent.HFAgent("ckpt").model.device == "cuda"
    assert hf_agent.HFAgent("ckpt", device="cpu").model.device == "cpu"


def test_hf_agent_keeps_each_episodes_tokens_and_counts_what_it_generated(fake_hf):
    agent = hf_agent.HFAgent("ckpt", max_new_tokens=6, max_observation_tokens=2)
    first = [view(episode_id="a", transcript=[Segment("user", "aa b", -1)]),
             view(episode_id="b", transcript=[Segment("user", "ccc", -1)])]
    assert agent.act(first) == ["S:7", "S:7 7"]
    assert agent.backend.calls[-1] == ([[1, 2, 1], [1, 3]], 6, ["a", "b"]) and agent.backend.ended == 1
    assert (agent.generated_tokens("a"), agent.generated_tokens("b"), agent.generated_tokens("zz")) == (1, 2, 0)
    obs = [Segment("user", "aa b", -1), Segment("assistant", "x", 0), Segment("environment", "dddd ee fff", 0)]
    assert agent.act([view(turn=1, episode_id="b", transcript=obs)]) == ["S:7"]
    # the observation cut to max_observation_tokens, appended to the episode's own context; no new rollout
    assert agent.backend.calls[-1] == ([[1, 3, 7, 7, 4, 2]], 6, ["b"]) and agent.backend.ended == 1
    assert agent.generated_tokens("b") == 3 and agent.generated_tokens("a") == 1
    agent.act([view(episode_id="b", transcript=[Segment("user", "x", -1)])])  # a new set: the old state goes
    assert agent.backend.ended == 2 and agent.generated_tokens("a") == 0 and agent.generated_tokens("b") == 1
    with pytest.raises(ValueError, match=r"two episodes of one batch share an episode_id: \['b', 'b'\]"):
        agent.act([view(episode_id="b"), view(episode_id="b")])


# -- openai_agent.py --------------------------------------------------------------------------------------------
class Response:
    def __init__(self, body, status=200):
        self.body, self.status = body, status

    def raise_for_status(self):
        if self.status >= 400:
            import requests

            raise requests.HTTPError(f"{self.status} Server Error")

    def json(self):
        if isinstance(self.body, Exception):
            raise self.body
        return self.body


def fake_post(monkeypatch, *bodies):
    sent = []

    def post(url, json, timeout, headers):
        sent.append({"url": url, "json": json, "timeout": timeout, "headers": headers})
        body = bodies[min(len(sent), len(bodies)) - 1]
        return body if isinstance(body, Response) else Response(body)

    monkeypatch.setattr(openai_agent.requests, "post", post)
    return sent


def reply(content, finish="stop", stop_reason=None):
    choice = {"message": {"content": content}, "finish_reason": finish}
    if stop_reason is not ...:
        choice["stop_reason"] = stop_reason
    return {"choices": [choice]}


def test_openai_agent_sends_the_model_messages_and_sampling_settings(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    sent = fake_post(monkeypatch, reply("<search> x </search>"))
    agent = OpenAIChatAgent.from_spec("http://h:8/v1/#qwen")
    assert agent.name == "openai:http://h:8/v1/#qwen" and agent.url == "http://h:8/v1/chat/completions"
    transcript = [Segment("user", "prompt", -1), Segment("assistant", "act", 0), Segment("environment", "", 0),
                  Segment("environment", "obs", 0)]
    assert agent.act([view(turn=1, transcript=transcript)]) == ["<search> x </search>"]
    assert sent == [{"url": "http://h:8/v1/chat/completions", "timeout": 120.0,
                     "headers": {"Authorization": "Bearer EMPTY"},
                     "json": {"model": "qwen", "max_tokens": 256, "temperature": 0.0,
                              "stop": ["</search>", "</answer>"],
                              "messages": [{"role": "user", "content": "prompt"},
                                           {"role": "assistant", "content": "act"},
                                           {"role": "user", "content": "obs"}]}}]
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    assert OpenAIChatAgent("http://h/apiX", "m").url == "http://h/apiX/chat/completions"
    agent = OpenAIChatAgent("https://h/v1", "m", max_tokens=9, temperature=0.5, timeout=3.0)
    agent.act([view()])
    assert sent[-1]["headers"] == {"Authorization": "Bearer sk-env"} and sent[-1]["timeout"] == 3.0
    assert (sent[-1]["json"]["max_tokens"], sent[-1]["json"]["temperature"]) == (9, 0.5)
    assert OpenAIChatAgent("http://h", "m", api_key="sk-arg").api_key == "sk-arg"


def test_openai_agent_messages_alternate_roles_and_skip_empty_segments():
    transcript = [Segment("user", "p", -1), Segment("assistant", "a1", 0), Segment("environment", "o1", 0),
                  Segment("assistant", "", 1), Segment("assistant", "a2", 1)]
    assert messages(view(turn=2, transcript=transcript)) == [
        {"role": "user", "content": "p"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "o1"}, {"role": "assistant", "content": "a2"}]


def test_openai_agent_puts_the_stop_string_back(monkeypatch):
    agent = OpenAIChatAgent("http://h/v1", "m")
    cases = [(reply("<search> q", stop_reason="</search>"), "<search> q</search>"),  # vLLM names the stop string
             (reply("<answer> a", stop_reason=128001), "<answer> a</answer>"),  # a token id: close the open tag
             (reply("<search> q", finish=None, stop_reason="</search>"), "<search> q</search>"),
             (reply("<answer> a", stop_reason="EOS"), "<answer> a</answer>"),
             (reply("<answer> a", stop_reason=...), "<answer> a</answer>"),
             (reply("<search> q", finish="length"), "<search> q"),  # cut by max_tokens: nothing to close
             (reply("<search> q </search> <answer> a", stop_reason=...), "<search> q </search> <answer> a</answer>"),
             (reply("<answer> a </answer>", stop_reason=...), "<answer> a </answer>"),
             (reply("plain", stop_reason=...), "plain"),
             (reply(None), "")]
    for body, expected in cases:
        fake_post(monkeypatch, body)
        assert agent.act([view()]) == [expected], body


def test_openai_agent_reports_a_failed_endpoint_as_a_connection_error(monkeypatch):
    import requests

    agent = OpenAIChatAgent("http://h/v1", "m")
    for body in (Response({}, 500), Response({"choices": []}), Response({"x": 1}), Response(ValueError("no json")),
                 Response(requests.ConnectionError("refused"))):
        fake_post(monkeypatch, body)
        with pytest.raises(ConnectionError, match="chat endpoint http://h/v1/chat/completions failed: "):
            agent.act([view()])


def test_openai_agent_from_spec_refuses_malformed_specs():
    for spec in ("http://h/v1", "http://h/v1#", "h:8/v1#m", "ftp://h#m"):
        with pytest.raises(ValueError, match=f"openai agent spec must be openai:http://HOST:PORT/v1#MODEL, got "
                                             f"openai:{spec}$"):
            OpenAIChatAgent.from_spec(spec)
    agent = OpenAIChatAgent.from_spec("https://h/v1#org/m#2", max_tokens=4, concurrency=2)
    assert (agent.model, agent.max_tokens, agent.concurrency, agent.timeout) == ("org/m#2", 4, 2, 120.0)


def test_openai_agent_sends_concurrency_requests_at_once_in_order(monkeypatch):
    lock, state, all_in = threading.Lock(), {"now": 0, "most": 0, "wait": 0.01}, threading.Event()

    def post(url, json, timeout, headers):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            if state["now"] == 4:
                all_in.set()
        all_in.wait(state["wait"])  # held until every request is in flight (a loaded machine starts threads late)
        with lock:
            state["now"] -= 1
        return Response(reply(json["messages"][0]["content"], finish="length"))

    monkeypatch.setattr(openai_agent.requests, "post", post)
    episodes = [view(transcript=[Segment("user", f"p{i}", -1)]) for i in range(4)]
    assert OpenAIChatAgent("http://h", "m", concurrency=1).act(episodes) == ["p0", "p1", "p2", "p3"]
    assert state["most"] == 1
    state["wait"] = 10.0
    assert OpenAIChatAgent("http://h", "m").act(episodes) == ["p0", "p1", "p2", "p3"]
    assert state["most"] == 4  # the default (16) sends every episode's request at once
    pools = []

    class Pool(openai_agent.ThreadPoolExecutor):
        def __init__(self, workers):
            pools.append(workers)
            super().__init__(workers)

    monkeypatch.setattr(openai_agent, "ThreadPoolExecutor", Pool)
    OpenAIChatAgent("http://h", "m").act(episodes)
    OpenAIChatAgent("http://h", "m", concurrency=3).act(episodes)
    assert pools == [16, 3]


# -- tables.py --------------------------------------------------------------------------------------------------
def test_tables_columns_are_as_wide_as_their_widest_cell_two_spaces_apart():
    table = fixed_width_table(["a", "bbbb", "c"], [["xyz", "1", "22"], ["q", "", "3"]])
    assert table == "a    bbbb  c\n---  ----  --\nxyz  1     22\nq          3"
    assert fixed_width_table(["name"], []) == "name\n----"
