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
