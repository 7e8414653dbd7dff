"""Every verifier with right, wrong and malformed answers; the auto choice; threads."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from datasets_prep.task import Task
from datasets_prep.verifiers import VerifierError, available, choose, get, score


def T(**kw) -> Task:
    base = {"id": "t", "domain": "general", "problem_statement": "q?", "ground_truth": "x"}
    base.update(kw)
    return Task(**base)


def unchecked(**kw) -> Task:
    """A task whose ground truth validation would refuse (as one built with model_construct
    or read by an older version): scoring must still raise, never return 0."""
    base = {"id": "t", "domain": "general", "problem_statement": "q?", "ground_truth": "x",
            "input_files": {}, "qa_type": None, "verifier": "auto", "metadata": {}}
    base.update(kw)
    return Task.model_construct(**base)


# ------------------------------------------------------------------------- math
@pytest.mark.parametrize("answer", ["\\boxed{1/2}", "The answer is \\boxed{\\frac{1}{2}}", "0.5", "so we get\n\\boxed{0.5}"])
def test_math_right(answer):
    assert score(T(domain="math", ground_truth="\\frac{1}{2}", qa_type="math"), answer).score == 1


@pytest.mark.parametrize("answer", ["\\boxed{1/3}", "0.6", "x+1"])
def test_math_wrong(answer):
    r = score(T(domain="math", ground_truth="1/2", qa_type="math"), answer)
    assert r.score == 0 and r.verifier == "math"


@pytest.mark.parametrize("answer", [None, "", "   ", "\\boxed{", "no idea at all"])
def test_math_malformed(answer):
    r = score(T(domain="math", ground_truth="1/2", qa_type="math"), answer)
    assert r.score == 0 and r.reason


def test_math_off_main_thread_is_safe():
    t = T(domain="math", ground_truth="\\sqrt{2}", qa_type="math")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda a: score(t, a).score, ["\\boxed{\\sqrt{2}}", "\\boxed{2^{1/2}}", "\\boxed{1.5}"] * 3))
    assert results == [1, 1, 0] * 3


def test_math_unparseable_ground_truth_raises():
    with pytest.raises(VerifierError):
        get("math")("1", "   ", None)


# ------------------------------------------------------------------ multiple choice
@pytest.mark.parametrize("answer,expected", [
    ("B", 1), ("\\boxed{B}", 1), ("The answer is B.", 1), ("Answer: (B)", 1), ('{"answer": "B"}', 1),
    ("B. b", 1), ("(B) b", 1), ("**B**", 1), ("Some reasoning first.\nB. b", 1), ("A. a is wrong", 0),
    ("C", 0), ("A, B", 0), ("", 0), ("I am not sure", 0), ("Z", 0),
])
def test_choice_single(answer, expected):
    t = T(domain="chem", qa_type="single_choice", ground_truth="B", metadata={"choices": ["a", "b", "c", "d"]})
    assert score(t, answer).score == expected


def test_choice_multi_f1():
    t = T(domain="chem", qa_type="multi_choice", ground_truth="A,C")
    assert score(t, "A, C").score == 1
    assert score(t, "C and A").score == 1
    assert score(t, "A").score == pytest.approx(2 / 3)
    assert score(t, "A,B,C").score == pytest.approx(0.8)
    assert score(t, "B, D").score == 0
    assert score(t, "").score == 0
    assert score(t, "none of them").score == 0


def test_choice_bad_ground_truth():
    with pytest.raises(VerifierError, match="option letters"):
        score(unchecked(qa_type="single_choice", ground_truth="forty"), "A")


# ------------------------------------------------------------------------ numeric
@pytest.mark.parametrize("answer,expected", [
    ("9.81 m/s^2", 1), ("9.8", 1), ("\\boxed{9.81\\,\\text{m/s}^2}", 1), ("981 cm/s^2", 1),
    ("9.0 m/s^2", 0), ("9.81 s", 0), ("fast", 0), ("", 0), ("9.81 florps", 0),
])
def test_numeric_units(answer, expected):
    t = T(domain="physics", qa_type="numeric", ground_truth={"value": 9.81, "unit": "m/s^2", "rel_tol": 0.01})
    r = score(t, answer)
    assert r.score == expected, r.reason


def test_numeric_plain_and_scientific():
    t = T(qa_type="numeric", ground_truth=1500)
    assert score(t, "1,500").score == 1
    assert score(t, "1.5e3").score == 1
    assert score(t, "1.5 \\times 10^{3}").score == 1
    assert score(t, "Answer: 1499").score == 1  # within 1%
    assert score(t, "1400").score == 0


def test_numeric_converts_units():
    t = T(qa_type="numeric", ground_truth={"value": 2.5, "unit": "kJ"})
    assert score(t, "2500 J").score == 1
    assert score(t, "2.5 kJ").score == 1
    assert "not compatible" in score(t, "2.5 kg").reason


def test_numeric_percent_and_exact_counts():
    pct = T(qa_type="numeric", ground_truth={"value": 11.19, "unit": "percent"})
    assert score(pct, "11.2%").score == 1
    exact = T(qa_type="numeric", ground_truth=7, metadata={"rel_tol": 0.0})
    assert score(exact, "7").score == 1 and score(exact, "7.01").score == 0


def test_numeric_bad_ground_truth():
    with pytest.raises(VerifierError):
        score(unchecked(qa_type="numeric", ground_truth="lots"), "3")


# --------------------------------------------------------------------------- text
def test_exact_normalised():
    t = T(qa_type="exact", ground_truth="Lady Macbeth")
    assert score(t, "LADY MACBETH").score == 1
    assert score(t, "the lady macbeth.").score == 1
    assert score(t, "Answer: Lady Macbeth").score == 1
    assert score(t, "Macbeth").score == 0
    assert score(t, None).score == 0


def test_exact_any_of_list():
    t = T(qa_type="exact", ground_truth=["Fe", "iron"])
    assert score(t, "Iron").score == 1 and score(t, "fe").score == 1 and score(t, "Cu").score == 0


def test_rouge_and_open():
    ref = "The cat sat on the mat near the door"
    assert score(T(ground_truth=ref), ref, "rouge").score == pytest.approx(1.0)
    partial = score(T(ground_truth=ref), "a cat sat on a mat", "rouge").score
    assert 0 < partial < 1
    assert score(T(ground_truth=ref), "quantum chromodynamics", "rouge").score == 0
    # open: math first (1/2 == 0.5), then ROUGE-L
    assert score(T(qa_type="open", ground_truth="1/2"), "\\boxed{0.5}").score == 1
    r = score(T(qa_type="open", ground_truth=ref), "the cat sat on the mat")
    assert 0 < r.score < 1 and "ROUGE-L" in r.reason
    assert score(T(qa_type="open", ground_truth=ref), "").score == 0


# -------------------------------------------------------------- instruction (IFBench)
IF_GT = {"instruction_id_list": ["format:title_case"], "kwargs": [{}]}


def test_instruction_right_wrong_malformed():
    t = T(domain="instruct_follow", qa_type="instruction", ground_truth=IF_GT)
    right = score(t, "This Is A Title Case Sentence")
    assert right.score == 1, right.reason
    assert score(t, "this is not title case at all").score == 0
    assert score(t, "").score == 0


def test_instruction_loose_vs_strict():
    gt = {"instruction_id_list": ["format:no_whitespace"], "kwargs": [{}]}
    t = T(domain="instruct_follow", qa_type="instruction", ground_truth=gt)
    answer = "Sure, here it is:\nnowhitespacehere"
    assert score(t, answer, "instruction").score == 1  # loose drops the first line
    assert score(t, answer, "instruction_strict").score == 0


def test_instruction_needs_word_tokenize_offline():
    # count:conjunctions uses nltk.word_tokenize -> needs punkt_tab, trained locally
    gt = {"instruction_id_list": ["words:odd_even_syllables"], "kwargs": [{}]}
    r = score(T(qa_type="instruction", ground_truth=gt), "Hello there my good friend, today is fine.")
    assert r.score in (0, 1) and "instructions followed" in r.reason


def test_instruction_unsupported_reported_not_crashed():
    gt = {"instruction_id_list": ["ratio:stop_words", "format:title_case"], "kwargs": [{"percentage": 10}, {}]}
    r = score(T(qa_type="instruction", ground_truth=gt), "A Title Case Answer")
    assert r.score == 1 and "not checkable offline: ratio:stop_words" in r.reason
    only = {"instruction_id_list": ["words:start_verb"], "kwargs": [{}]}
    with pytest.raises(VerifierError, match="part-of-speech"):
        score(T(qa_type="instruction", ground_truth=only), "Run now")


def test_instruction_ground_truth_as_peer_json_text():
    t = T(domain="instruct_follow", qa_type="instruction", ground_truth=json.dumps(IF_GT))
    assert score(t, "Hello World Again").score == 1
    with pytest.raises(VerifierError):
        score(unchecked(qa_type="instruction", ground_truth="not json"), "x")


# ---------------------------------------------------------------- auto / registry
def test_auto_choice():
    assert choose(T(domain="math")) == "math"
    assert choose(T(domain="chem", ground_truth="C")) == "choice_single"
    assert choose(T(domain="chem", ground_truth={"value": 18.015, "unit": "g/mol"})) == "numeric"
    assert choose(T(domain="biomed", ground_truth="A,D")) == "choice_multi"
    assert choose(T(domain="anything", qa_type="Multiple Choice", ground_truth="A,B")) == "choice_multi"
    assert choose(T(domain="physics", ground_truth={"value": 1, "unit": "m"})) == "numeric"
    assert choose(unchecked(domain="instruct_follow", ground_truth={"instruction_id_list": []})) == "instruction"
    assert choose(T(domain="long_context", ground_truth="some text")) == "open"
    assert choose(T(verifier="rouge", qa_type="math")) == "rouge"
    assert set(available()) >= {"auto", "math", "choice_single", "choice_multi", "numeric", "exact", "rouge",
                                "open", "instruction", "instruction_strict", "judge"}


def test_unknown_verifier_named():
    with pytest.raises(VerifierError, match="unknown verifier 'nope'"):
        score(T(), "x", "nope")


# -------------------------------------------------------------------------- judge
class _JudgeHandler(BaseHTTPRequestHandler):
    replies: list[str] = []
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"body": body, "auth": self.headers.get("Authorization")})
        content = type(self).replies.pop(0)
        out = json.dumps({
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


@pytest.fixture
def judge_server(monkeypatch):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _JudgeHandler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    monkeypatch.setenv("SANDFLOW_JUDGE_BASE_URL", f"http://127.0.0.1:{srv.server_address[1]}/v1")
    monkeypatch.setenv("SANDFLOW_JUDGE_MODEL", "scripted-judge")
    monkeypatch.setenv("SANDFLOW_JUDGE_API_KEY", "sk-test-secret")
    _JudgeHandler.replies, _JudgeHandler.seen = [], []
    yield _JudgeHandler
    srv.shutdown()
    srv.server_close()


def test_judge_over_real_http(judge_server):
    judge_server.replies += ['{"score": 1, "reason": "same meaning"}', "```json\n{\"score\": 0.0, \"reason\": \"wrong\"}\n```",
                             "I cannot decide"]
    from sandflow.config import load_settings

    judge = load_settings().judge_endpoint()  # the application resolves SANDFLOW_JUDGE_*
    t = T(ground_truth="Paris", metadata={"question": "Capital of France?"})
    r = score(t, "It is Paris.", "judge", judge=judge)
    assert r.score == 1 and "same meaning" in r.reason and "sk-test-secret" not in r.model_dump_json()
    sent = judge_server.seen[0]
    assert sent["auth"] == "Bearer sk-test-secret" and sent["body"]["temperature"] == 0
    assert "Capital of France?" in sent["body"]["messages"][0]["content"]
    assert score(t, "Lyon", "judge", judge=judge).score == 0
    with pytest.raises(VerifierError, match="no score"):
        score(t, "hmm", "judge", judge=judge)
    assert score(t, "", "judge", judge=judge).score == 0  # empty answers never reach the judge
    assert len(judge_server.seen) == 3


def test_judge_unconfigured(monkeypatch):
    monkeypatch.delenv("SANDFLOW_JUDGE_BASE_URL", raising=False)
    monkeypatch.delenv("SANDFLOW_JUDGE_MODEL", raising=False)
    from sandflow.config import load_settings

    with pytest.raises(VerifierError, match="SANDFLOW_JUDGE_BASE_URL"):
        score(T(), "x", "judge", judge=load_settings().judge_endpoint())


# ------------------------------------ issue #11: an unusable ground truth is never a 0
NESTED = {"a": {"b": 1}}


@pytest.mark.parametrize("name", ["exact", "rouge", "open", "math", "numeric", "choice_single",
                                  "choice_multi", "instruction", "instruction_strict"])
@pytest.mark.parametrize("answer", ["The answer is 4", "", None])
def test_a_nested_dict_ground_truth_raises_at_scoring_for_every_verifier(name, answer):
    """Was: 'open'/'math'/'exact' scored str(dict) against the answer and returned 0 (and an
    empty answer returned 0 before the ground truth was even looked at)."""
    t = unchecked(ground_truth=NESTED)
    with pytest.raises(VerifierError):
        score(t, answer, name)
    with pytest.raises(VerifierError):
        get(name)(answer, NESTED, t)


def test_auto_scoring_of_a_nested_dict_raises():
    for kw in ({"domain": "math"}, {"domain": "general"}, {"qa_type": "exact"}, {"domain": "physics"}):
        with pytest.raises(VerifierError):
            score(unchecked(ground_truth=NESTED, **kw), "4")


def test_check_ground_truth_names_the_verifier():
    from datasets_prep.verifiers import check_ground_truth

    assert check_ground_truth(T(qa_type="exact", ground_truth=["a", 1, 2.5])) == "exact"
    assert check_ground_truth(T(qa_type="numeric", ground_truth={"value": "9.81", "unit": "m/s^2"})) == "numeric"
    with pytest.raises(VerifierError, match="ground_truth: the 'exact' verifier cannot use it"):
        check_ground_truth(unchecked(ground_truth=NESTED), "exact")
    # the judge can show any JSON value to its model as the reference
    assert check_ground_truth(T(verifier="judge", ground_truth=NESTED)) == "judge"
