"""``stppo_envs.prompts``: Search-R1's templates, the question mark, options and numbered
documents, the template hash."""

from __future__ import annotations

from stppo_envs.retrieval import Hit, RetrievalError

# --- prompts ---------------------------------------------------------------------------------------------------

def test_search_r1_question_strips_and_adds_one_question_mark():
    from stppo_envs.prompts import search_r1_question

    assert search_r1_question(" who wrote the iliad ") == "who wrote the iliad?"
    assert search_r1_question("Is it? ") == "Is it?" and search_r1_question("   ") == ""


def test_render_prompt_fills_options_only_for_choices():
    from stppo_envs.prompts import render_prompt

    assert render_prompt("{question}|{options}|", "q") == "q||"
    assert render_prompt("{question}|{options}|", "q", {"A": "x", "B": "y"}) == "q|A. x\nB. y|"


def test_format_information_numbers_docs_one_per_line():
    from stppo_envs.prompts import format_information

    hits = [Hit("1", 2.0, "Paris", "Capital. "), Hit("2", 1.0, "Rome", "Eternal.", title_line="Rome")]
    assert format_information(hits) == \
        '\n\n<information>Doc 1(Title: "Paris") Capital. \nDoc 2(Title: Rome) Eternal.</information>\n\n'
    assert format_information([]) == "\n\n<information></information>\n\n"


def test_search_failure_observation_collapses_whitespace_and_keeps_200_characters():
    from stppo_envs.prompts import search_failure_observation

    assert search_failure_observation(RetrievalError("a\n\tb  c")) == \
        "\n\n<information>Search failed: a b c</information>\n\n"
    assert search_failure_observation(RetrievalError("x" * 300)) == \
        "\n\n<information>Search failed: " + "x" * 200 + "</information>\n\n"
    assert search_failure_observation(TimeoutError()) == \
        "\n\n<information>Search failed: TimeoutError</information>\n\n"


def test_template_hash_is_the_first_12_hex_of_the_sha256_of_the_unit_separated_templates():
    import hashlib

    from stppo_envs.prompts import SEARCH_R1_MCQ_TEMPLATE, SEARCH_R1_TEMPLATE, template_hash

    expected = hashlib.sha256((SEARCH_R1_TEMPLATE + "\x1f" + SEARCH_R1_MCQ_TEMPLATE).encode()).hexdigest()[:12]
    assert template_hash(SEARCH_R1_TEMPLATE, SEARCH_R1_MCQ_TEMPLATE) == expected
    assert template_hash("a", "b") != template_hash("ab") and len(template_hash("a")) == 12


def test_the_templates_are_search_r1s_text():
    from stppo_envs.prompts import SEARCH_R1_MCQ_TEMPLATE, SEARCH_R1_TEMPLATE

    assert SEARCH_R1_TEMPLATE.endswith("For example, <answer> Beijing </answer>. Question: {question}\n")
    assert "call a search engine by <search> query </search> and it will return the top searched results " \
           "between <information> and </information>." in SEARCH_R1_TEMPLATE
    assert SEARCH_R1_MCQ_TEMPLATE.endswith(
        "for example <answer> B </answer>. Question: {question}\nOptions:\n{options}\n")
