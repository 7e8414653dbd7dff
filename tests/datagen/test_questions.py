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
