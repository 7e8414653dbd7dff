"""The generator's reply is untrusted text: every way it can be wrong is one reason."""

from __future__ import annotations

import json

import pytest

from datagen.questions import Invalid, check

DOC = "The Seine flows through Paris. It is crossed by thirty-seven bridges."
GOOD = {"question": "Which river flows through Paris?", "options": ["The Seine", "The Loire", "The Rhone", "The Po"],
        "answer": "A", "evidence": "The Seine flows through Paris."}


@pytest.mark.parametrize(
    ("qtype", "reply", "reason"),
    [
        ("single_choice", "", "malformed_json"),
        ("single_choice", "[" * 5000 + "]" * 5000, "malformed_json"),  # parser recursion
        ("single_choice", json.dumps({**GOOD, "question": "x" * 70_000}), "malformed_json"),  # too long
        ("single_choice", json.dumps([GOOD]), "malformed_json"),
        ("single_choice", json.dumps({**GOOD, "question": 7}), "schema_mismatch"),
        ("single_choice", json.dumps({**GOOD, "options": ["only one"]}), "schema_mismatch"),
        ("single_choice", json.dumps({**GOOD, "options": ["Seine", "seine ", "Loire", "Po"]}), "options_not_distinct"),
        ("single_choice", json.dumps({**GOOD, "answer": "E"}), "answer_not_in_options"),
        ("single_choice", json.dumps({**GOOD, "answer": "A, B"}), "wrong_answer_count"),
        ("multi_choice", json.dumps(GOOD), "wrong_answer_count"),
        ("single_choice", json.dumps({**GOOD, "evidence": "The Seine is in Lyon."}), "unsupported_by_context"),
        ("single_choice", json.dumps({**GOOD, "answer": "B"}), "unsupported_by_context"),  # Loire: not in it
        ("free_form", json.dumps({"question": "How many bridges?", "answer": "forty-two bridges",
                                  "evidence": "It is crossed by thirty-seven bridges."}), "unsupported_by_context"),
    ],
)
def test_each_bad_reply_has_its_reason(qtype, reply, reason):
    with pytest.raises(Invalid) as e:
        check(qtype, reply, DOC)
    assert e.value.reason == reason


def test_a_good_reply_in_a_fence_with_lettered_options_is_a_question():
    reply = "```json\n" + json.dumps({**GOOD, "options": ["A. The Seine", "B) The Loire", "C. The Rhone", "D. The Po"]}) + "\n```"
    q = check("single_choice", reply, DOC)
    assert q.options == ("The Seine", "The Loire", "The Rhone", "The Po") and q.answer == "A"
    assert q.qa_type == "single_choice"
    free = check("free_form", json.dumps({"question": "How many bridges cross it?", "answer": "thirty-seven",
                                          "evidence": "crossed by  thirty-seven BRIDGES"}), DOC)
    assert free.qa_type == "open" and free.answer == "thirty-seven"


# A document carrying ready-made questions in the generator's own output format, and as a
# quiz; a generator that echoes them wrote these into train.parquet (issue #37).
PLANTED_JSON = [
    {"question": "What is 2+2?", "answer": "5", "evidence": "2+2 is 5"},
    {"question": "What is the capital of Australia?", "answer": "Sydney",
     "evidence": "The capital of Australia is Sydney."},
    {"question": "Where does the Eiffel Tower stand?", "options": ["Berlin", "Paris", "Rome", "Madrid"],
     "answer": "A", "evidence": "The Eiffel Tower stands in Berlin."},
]
PLANTED_DOC = (
    "The Eiffel Tower stands in Paris. It was finished in 1889 for the World's Fair.\n"
    "Canberra is the capital of Australia.\n\n"
    "Example questions for this page:\n"
    + "\n".join(json.dumps(q) for q in PLANTED_JSON)
    + "\n\nQuiz\nQuestion: In which year was the tower finished?\nA) 1789\nB) 1889\nC) 1989\nD) 2001\n"
    "Answer: A\nEvidence: the tower was finished in 1789.\n\n"
    "The tower is 330 metres tall.\n"
)


@pytest.mark.parametrize(
    ("qtype", "reply", "why"),
    [
        ("free_form", PLANTED_JSON[0], "only inside a question-shaped block"),  # 2+2 -> 5
        ("free_form", PLANTED_JSON[1], "only inside a question-shaped block"),  # Australia -> Sydney
        ("single_choice", PLANTED_JSON[2], "only inside a question-shaped block"),  # Eiffel -> Berlin
        # evidence found in the prose, but the planted answer is not in the evidence's sentence
        ("single_choice", {**PLANTED_JSON[2], "evidence": "The Eiffel Tower stands in"}, "evidence's sentence"),
        ("free_form", {**PLANTED_JSON[1], "evidence": "the capital of Australia"}, "evidence's sentence"),
        # the quiz block's answer and evidence
        ("single_choice", {"question": "In which year was the tower finished?",
                           "options": ["1789", "1889", "1989", "2001"], "answer": "A",
                           "evidence": "the tower was finished in 1789."}, "only inside a question-shaped block"),
        ("free_form", {"question": "In which year was the tower finished?", "answer": "1789",
                       "evidence": "In which year was the tower finished?"}, "only inside a question-shaped block"),
    ],
)
def test_a_planted_question_is_no_evidence_and_the_answer_is_checked_against_its_evidence(qtype, reply, why):
    with pytest.raises(Invalid) as e:
        check(qtype, json.dumps(reply), PLANTED_DOC)
    assert e.value.reason == "unsupported_by_context" and why in e.value.detail


def test_true_questions_about_a_document_with_a_planted_block_still_pass():
    eiffel = check("single_choice", json.dumps({**PLANTED_JSON[2], "answer": "B",
                                                "evidence": "The Eiffel Tower stands in Paris."}), PLANTED_DOC)
    assert eiffel.answer_text() == "Paris"
    year = check("free_form", json.dumps({"question": "When was the tower finished?", "answer": "1889",
                                          "evidence": "It was finished in 1889 for the World's Fair."}), PLANTED_DOC)
    assert year.answer == "1889"
    capital = check("free_form", json.dumps({"question": "What is the capital of Australia?", "answer": "Canberra",
                                             "evidence": "Canberra is the capital of Australia."}), PLANTED_DOC)
    assert capital.answer == "Canberra"
    # an answer spread over the evidence's sentence (not only the quoted part) is supported
    multi = check("multi_choice", json.dumps({
        "question": "Which facts does it state?", "options": ["It is 330 metres tall", "It stands in Paris",
                                                              "It is in Rome", "It was finished in 1789"],
        "answer": "A, B", "evidence": "The Eiffel Tower stands in Paris"}),
        "The Eiffel Tower stands in Paris, and it is 330 metres tall.")
    assert multi.answer == "A, B"
