"""The TRL adapter's protocol (stppo_agent/integrations/trl) against the Gymnasium env it wraps: scripted episodes
played through the adapter's tools score and observe exactly what the same turns give in ``gymnasium.make`` of the
env, for right and wrong answers, partial F1, multiple-choice letters, failed searches, invalid turns and the turn
budget. TRL itself is not needed: TRL inspects an environment class, it does not subclass anything of its."""

from __future__ import annotations

import inspect

import gymnasium as gym
import pytest
from transformers.utils import get_json_schema

from stppo_agent.integrations.trl import SearchEnvironment, search_environment, training_dataset
from stppo_envs.actions import INVALID_ACTION_MESSAGE
from stppo_envs.retrieval import Hit, RetrievalError

NQ_QUESTION = "What is the profession of Zaeththeiv Penda?"  # demo NQ question 0, gold "linguist"
MEDQA_QUESTION = "Which organ does Largreind palsy mainly affect?"  # demo MedQA question 0, gold B (pancreas)


class ScriptedRetriever:
    """Two fixed passages for any query; a query containing ``unreachable`` fails as a retrieval error."""

    def search(self, query: str, k: int = 10) -> list[Hit]:
        if "unreachable" in query:
            raise RetrievalError(f"index unreachable for {query!r}")
        hits = [Hit("d1", 2.0, "Zaeththeiv Penda", "Zaeththeiv Penda (born 1803) is a linguist."),
                Hit("d2", 1.0, "Largreind palsy", "Largreind palsy mainly affects the pancreas.")]
        return hits[:k]

    def batch_search(self, queries, k: int = 10) -> list[list[Hit]]:
        return [self.search(query, k) for query in queries]


RETRIEVER = ScriptedRetriever()


def play_gym(env_id: str, kwargs: dict, index: int, turns: list[tuple[str, str]]) -> tuple[list[str], float]:
    """(observations, final reward) of the Gymnasium env given the same turns as Search-R1 action text."""
    env = gym.make(env_id, disable_env_checker=True, **kwargs)
    env.reset(options={"index": index})
    observations, reward = [], 0.0
    for kind, content in turns:
        observation, reward, terminated, truncated, _ = env.step(f"<{kind}> {content} </{kind}>")
        observations.append(observation)
        if terminated or truncated:
            break
    return observations, float(reward)


def play_adapter(environment: SearchEnvironment, index: int, turns: list[tuple[str, str]]) -> tuple[list, float]:
    """(what each tool call returned, or the ValueError it raised, as TRL would see it; get_reward())."""
    environment.reset(index=index, prompt=[{"role": "user", "content": ""}])
    returned = []
    for kind, content in turns:
        try:
            returned.append(getattr(environment, kind)(content))
        except ValueError as error:
            returned.append(error)
    return returned, environment.get_reward()


CASES = {  # name: (env id, env kwargs, question index, turns, the reward the env's scorer must give)
    "right answer after a search": ("stppo/NQ-v0", {}, 0, [("search", "Zaeththeiv Penda"), ("answer", "linguist")],
                                    1.0),
    "wrong answer": ("stppo/NQ-v0", {}, 0, [("answer", "chemist")], 0.0),
    "partial F1": ("stppo/NQ-v0", {"reward": "f1"}, 0, [("answer", "a famous linguist")], 2 / 3),
    "failed search, then right": ("stppo/NQ-v0", {}, 0, [("search", "unreachable Penda"), ("answer", "Linguist")],
                                  1.0),
    "MCQ right letter": ("stppo/MedQA-v0", {}, 0, [("search", "Largreind palsy"), ("answer", "B")], 1.0),
    "MCQ option text": ("stppo/MedQA-v0", {}, 0, [("answer", "pancreas")], 1.0),
    "MCQ wrong letter": ("stppo/MedQA-v0", {}, 0, [("answer", "C")], 0.0),
    "invalid turn costs the format reward": ("stppo/NQ-v0", {"format_reward": 0.2}, 0,
                                             [("search", "  "), ("answer", "linguist")], 0.8),
    "format reward of a clean answer": ("stppo/NQ-v0", {"format_reward": 0.2}, 0, [("answer", "chemist")], 0.2),
    "search on the last turn ends unanswered": ("stppo/NQ-v0", {"max_turns": 2}, 0,
                                                [("search", "Penda"), ("search", "Penda"), ("answer", "linguist")],
                                                0.0),
    "never answered": ("stppo/NQ-v0", {}, 0, [("search", "Zaeththeiv Penda")], 0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tools_score_and_observe_as_the_gymnasium_env(case):
    env_id, extra, index, turns, expected = CASES[case]
    kwargs = dict(retriever=RETRIEVER, **extra)
    returned, reward = play_adapter(search_environment(env_id, **kwargs)(), index, turns)
    observations, gym_reward = play_gym(env_id, kwargs, index, turns)
    assert reward == pytest.approx(expected) and gym_reward == pytest.approx(expected)
    searches = [(got, seen) for (kind, _), got, seen in zip(turns, returned, observations) if kind == "search"]
    for got, seen in searches:  # a served search returns the env's observation; one the env refused raises
        assert got == seen if not isinstance(got, ValueError) else seen in ("", INVALID_ACTION_MESSAGE)


def test_a_search_returns_the_envs_information_block_and_a_failure_says_why():
    environment = search_environment("stppo/NQ-v0", retriever=RETRIEVER)()
    environment.reset(index=0)
    found = environment.search("Zaeththeiv Penda")
    assert found == ('\n\n<information>Doc 1(Title: "Zaeththeiv Penda") Zaeththeiv Penda (born 1803) is a linguist.'
                     '\nDoc 2(Title: "Largreind palsy") Largreind palsy mainly affects the pancreas.</information>\n\n')
    failed = environment.search("unreachable Penda")
    assert failed.startswith("\n\n<information>Search failed: index unreachable for 'unreachable Penda'")
    assert environment.env.turn == 2  # each tool call is one turn of the env


def test_calls_the_env_refuses_raise_with_the_reason():
    environment = search_environment("stppo/NQ-v0", retriever=RETRIEVER)()
    environment.reset(index=0)
    with pytest.raises(ValueError, match="invalid search: empty <search> block"):
        environment.search(" ")
    assert environment.env.turn == 1  # the refused search used a turn, as in the env
    with pytest.raises(ValueError, match="invalid answer: nested action tags"):
        environment.answer("<search>x</search>")
    environment.answer("linguist")
    with pytest.raises(ValueError, match=r"the episode is over \(answer\(\) was called\)"):
        environment.answer("chemist")
    assert environment.get_reward() == 1.0  # a call after the end changes nothing


def test_the_turn_budget_ends_the_episode_unanswered():
    environment = search_environment("stppo/NQ-v0", retriever=RETRIEVER, max_turns=2)()
    environment.reset(index=0)
    environment.search("Penda")
    with pytest.raises(ValueError, match="turn 2 of 2 was the last: the search was not run"):
        environment.search("Penda again")
    with pytest.raises(ValueError, match="all 2 turns were used"):
        environment.answer("linguist")
    assert environment.get_reward() == 0.0


def test_reset_poses_the_indexed_question_and_forgets_the_last_episode():
    """TRL keeps a pool of environments and resets them for every batch: a reused one must not carry a reward."""
    environment = search_environment("stppo/NQ-v0", retriever=RETRIEVER)()
    prompt = environment.reset(index=0, prompt=[{"role": "user", "content": ""}])
    assert prompt.endswith(f"Question: {NQ_QUESTION}\n") and "`search` tool" in prompt and "`answer` tool" in prompt
    environment.answer("linguist")
    assert environment.get_reward() == 1.0
    second = environment.reset(index=1)
    assert "Kumsteth Viththae" in second and environment.get_reward() == 0.0
    environment.answer("linguist")  # question 1's gold is chemist
    assert environment.get_reward() == 0.0


def test_a_multiple_choice_prompt_lists_the_options():
    prompt = search_environment("stppo/MedQA-v0", retriever=RETRIEVER)().reset(index=0)
    assert f"Question: {MEDQA_QUESTION}\nOptions:\nA. kidney\nB. pancreas\nC. lung\nD. skin\n" in prompt
    assert "letter of the correct option" in prompt


def test_only_search_and_answer_become_tools():
    """TRL turns every public method but reset and get_reward into a tool, described by its docstring."""
    public = {name for name, _ in inspect.getmembers(SearchEnvironment, inspect.isfunction) if not name.startswith("_")}
    assert public - {"reset", "get_reward"} == {"search", "answer"}
    environment = search_environment("stppo/NQ-v0", retriever=RETRIEVER)()
    for tool, argument in ((environment.search, "query"), (environment.answer, "answer")):
        schema = get_json_schema(tool)["function"]
        assert schema["parameters"]["required"] == [argument]
        assert schema["parameters"]["properties"][argument]["type"] == "string"


def test_the_factory_shares_one_retriever_and_refuses_bad_settings_early():
    factory = search_environment("stppo/NQ-v0")  # the demo BM25 index
    first, second = factory(), factory()
    assert first.env.retriever is second.env.retriever and first.env is not second.env
    assert len(factory) == len(first.env.examples) and factory.max_turns == first.env.max_turns == 4
    first.reset(index=0)
    assert "Zaeththeiv Penda" in first.search("Zaeththeiv Penda profession")  # the real index answers
    with pytest.raises(ValueError, match="not a search-QA env"):
        search_environment("stppo/Toy-v0")
    with pytest.raises(ValueError, match="Registered stppo envs"):
        search_environment("stppo/NQ-v9")
    with pytest.raises(ValueError, match="topk and max_turns must be >= 1"):
        search_environment("stppo/NQ-v0", retriever=RETRIEVER, topk=0)


def test_the_dataset_routes_each_row_to_its_question_and_environment():
    factories = {"general": search_environment("stppo/NQ-v0", retriever=RETRIEVER),
                 "multihop": search_environment("stppo/HotpotQA-v0", retriever=RETRIEVER),
                 "medical": search_environment("stppo/MedQA-v0", retriever=RETRIEVER)}
    dataset = training_dataset(factories)
    assert len(dataset) == sum(len(f) for f in factories.values())
    for name, factory in factories.items():
        rows = dataset.filter(lambda row: row["environment"] == name)
        assert rows["index"] == list(range(len(factory)))
        row = rows[len(factory) - 1]
        assert row["prompt"] == [{"role": "user", "content": ""}]
        environment = factory()
        # TRL's multi-environment mode passes the row without its `environment` field to reset
        prompt = environment.reset(**{k: v for k, v in row.items() if k != "environment"})
        assert environment.env.example.question in prompt
        assert environment.env.example is environment.env.examples[len(factory) - 1]
    single = training_dataset(factories["general"], repeats=2)
    assert "environment" not in single.column_names and single["index"] == list(range(len(factories["general"]))) * 2
    with pytest.raises(TypeError, match="expected a search_environment"):
        training_dataset({"general": lambda: None})
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        training_dataset(factories["general"], repeats=0)
