"""Clean: exact and near duplicates (MinHash LSH, rensa) and 13-gram decontamination."""

from __future__ import annotations

import pytest

from datasets_prep.dedup import Contamination, dedup

BASE = (
    "Which river flows through Paris for thirteen kilometres and is crossed by thirty seven "
    "bridges, the oldest standing one being the Pont Neuf finished in 1607?"
)


def test_exact_and_near_duplicates_are_dropped_naming_the_kept_item():
    items = [
        ("a", BASE),
        ("b", BASE.upper().replace(",", " ;")),  # same words: exact after normalisation
        ("c", BASE.replace("1607", "1608")),  # one word changed: near
        ("d", "How do honey bees tell each other where the food is? By the waggle dance."),
    ]
    verdicts = {v.item_id: v for v in dedup(items)}
    assert verdicts["a"].kept and verdicts["d"].kept
    assert (verdicts["b"].reason, verdicts["b"].detail) == ("exact_duplicate", "a")
    assert (verdicts["c"].reason, verdicts["c"].detail) == ("near_duplicate", "a")


def test_different_texts_sharing_a_few_words_are_both_kept():
    other = "Which river flows through Rome? The Tiber, which the Ponte Milvio crosses north of the city."
    verdicts = dedup([("a", BASE), ("b", other)])
    assert all(v.kept for v in verdicts)


def test_a_13_gram_shared_with_an_evaluation_set_is_contamination():
    c = Contamination()
    c.add("eval-set", ["Question 4: " + BASE + " Answer: the Seine."])
    short = "Which river flows through Paris?"  # fewer than 13 words in common: clean
    verdicts = {v.item_id: v for v in dedup([("x", BASE), ("y", short)], contamination=c)}
    assert verdicts["x"].reason == "contaminated" and verdicts["x"].detail.startswith("eval-set: shares the 13-gram")
    assert verdicts["y"].kept


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        dedup([("a", "x")], threshold=0)
    with pytest.raises(ValueError, match="n-gram"):
        Contamination(n=0)


def test_every_built_in_suite_question_pasted_into_a_question_is_caught():
    """Issue #37: 26 of the 60 `math` questions have fewer than 13 words, so no 13-gram
    of theirs exists and, pasted verbatim, none was caught. The short ones are caught by
    an exact (normalised) match; the sets are loaded and added as the clean stage does."""
    from datagen.build import _task_text
    from datasets_prep.prepare import load_taskset
    from datasets_prep.suites import SUITES

    c = Contamination()
    questions: list[tuple[str, str]] = []
    for name in SUITES:
        ts = load_taskset(name)
        c.add(name, (_task_text(t) for t in ts.tasks))
        questions += [(f"{name}/{t.id}", str(t.metadata.get("question") or t.problem_statement))
                      for t in ts.tasks]
    assert sum(1 for _, q in questions if len(q.split()) < 13) >= 26
    missed = [qid for qid, q in questions
              if c.match(f"From the document, answer this: {q.upper()}\nThe answer is 42.") is None]
    assert missed == []
    hit = c.match("Please work out: Divide 18026 by 2!")
    assert hit is not None and "exact match" in hit
    # what is not an evaluation item stays clean: a question of a corpus, and a set's
    # template line that more than half of its items share
    assert c.match("Which river flows through Paris for thirteen kilometres?") is None
    only_math = Contamination()
    only_math.add("math", (_task_text(t) for t in load_taskset("math").tasks))
    assert only_math.match("What is 2 + 2? Give your final answer in \\boxed{}.") is None


def test_a_short_evaluation_item_is_an_exact_match_only():
    c = Contamination()
    c.add("tiny", ["What is 7 times 6?", "Paris"])
    assert c.match("Quick one. WHAT IS 7 TIMES 6 ?") is not None
    assert c.match("What is 7 times 60?") is None  # the words, not a prefix of them
    assert c.match("paris") is not None  # a one-word item: the whole text only
    assert c.match("The Seine flows through Paris.") is None
