"""The three LIS-RL question types: the JSON a generator must return, and its checks.

A generator's reply is untrusted text. It becomes a question only when sandflow's own
checks pass, each failure with one reason (the synth stage's funnel):

    malformed_json          not one JSON object (a ```json fence is tolerated)
    schema_mismatch         a field missing, empty or of the wrong type, or too long
    options_not_distinct    two options the same after normalisation
    answer_not_in_options   an answer letter outside the options ("E" of four)
    wrong_answer_count      single choice with several letters, multi choice with one
    unsupported_by_context  the lexical test: the evidence is not in the document, or only
                            inside a question-shaped block of it, or the answer's words
                            are not in the evidence's sentence

The lexical test is what "the answer is supported by the context" costs without another
model call: the evidence must occur in the document (whitespace and case folded) outside
any question-shaped block (a JSON object with question/answer keys, a quiz's
"Question: / A) / Answer:" lines: what a document says about its own questions is no
evidence), and most content words of the answer (the correct options' text for choice
questions) must occur in the sentence(s) the evidence lies in: the answer is checked
against its evidence, not against the whole document. A document that talks the
generator into writing something else (an injected instruction, a planted block of
questions the generator echoes) fails it.

Types map to the LIS-RL contract: single choice -> `single_choice` (exact match),
multi choice "A, C" -> `multi_choice` (F1), free form -> `open` (math-verify, then
ROUGE-L).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
TYPES = ("single_choice", "multi_choice", "free_form")
QA_TYPE = {"single_choice": "single_choice", "multi_choice": "multi_choice", "free_form": "open"}
REASONS = (
    "malformed_json",
    "schema_mismatch",
    "options_not_distinct",
    "answer_not_in_options",
    "wrong_answer_count",
    "unsupported_by_context",
)
MAX_FIELD_CHARS = 2000
_WORD = re.compile(r"\w+")
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
_LETTER_SEP = re.compile(r"[,;\s]+")
_OPTION_LETTER = re.compile(r"^\(?[A-Ha-h][).:]\s+")
MAX_OPTIONS = 8
MIN_ANSWER_SUPPORT = 0.6  # share of the answer's content words found in the document

_STOP = frozenset(
    ["a", "an", "the", "of", "in", "on", "at", "to", "for", "and", "or", "but", "is", "are", "was", "were", "be", "been", "by", "with", "from", "as", "that", "this", "these", "those", "it", "its", "which", "who", "what", "when", "where", "why", "how", "do", "does", "did", "not", "no", "yes"]
)


def json_schema(qtype: str) -> dict[str, Any]:
    """The JSON schema of one question of `qtype` (sent as structured output)."""
    props: dict[str, Any] = {
        "question": {"type": "string", "minLength": 1},
        "answer": {"type": "string", "minLength": 1},
        "evidence": {"type": "string", "minLength": 1},
    }
    required = ["question", "answer", "evidence"]
    if qtype == "single_choice":
        props["options"] = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 4, "maxItems": 4}
        props["answer"] = {"type": "string", "enum": list("ABCD")}
        required.insert(1, "options")
    elif qtype == "multi_choice":
        props["options"] = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 4, "maxItems": 5}
        props["answer"] = {"type": "string", "pattern": "^[A-E](, [A-E])+$"}
        required.insert(1, "options")
    elif qtype != "free_form":
        raise ValueError(f"question type {qtype!r}: use one of {', '.join(TYPES)}")
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@dataclass(frozen=True)
class Question:
    """A checked question, with what it came from."""

    qtype: str
    question: str
    answer: str  # letters "A" / "A, C" for choice types, the phrase for free form
    evidence: str
    options: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def qa_type(self) -> str:
        return QA_TYPE[self.qtype]

    def text(self) -> str:
        """The text duplicates and contamination are judged on."""
        return "\n".join([self.question, *self.options, self.answer_text()])

    def answer_text(self) -> str:
        if not self.options:
            return self.answer
        return " ; ".join(self.options[LETTERS.index(x)] for x in self.letters())

    def letters(self) -> list[str]:
        return [x.strip() for x in self.answer.split(",") if x.strip()]

    def key(self, piece_id: str) -> str:
        blob = json.dumps([piece_id, self.qtype, self.question, list(self.options), self.answer])
        return "q-" + hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class Invalid(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _fold(text: str) -> str:
    return " ".join(text.split()).lower()


def content_words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


MAX_REPLY_CHARS = 64_000  # a question is a few hundred characters; more is not one


def parse_json(content: str | None) -> dict[str, Any]:
    """The one JSON object of a reply. The reply is the endpoint's text, untrusted: its
    length is bounded before parsing, and nesting deep enough to exhaust the parser's
    recursion is malformed JSON, not a crash of the stage."""
    if not content or not content.strip():
        raise Invalid("malformed_json", "the reply is empty")
    if len(content) > MAX_REPLY_CHARS:
        raise Invalid("malformed_json", f"the reply is {len(content):,} characters, over {MAX_REPLY_CHARS:,}")
    text = content.strip()
    fence = _FENCE.match(text) if text.startswith("```") else None
    if fence:
        text = fence.group(1)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise Invalid("malformed_json", f"not JSON ({e.msg} at offset {e.pos})") from None
    except RecursionError:
        raise Invalid("malformed_json", "nested too deeply to be a question") from None
    if not isinstance(obj, dict):
        raise Invalid("malformed_json", f"a JSON {type(obj).__name__}, not an object")
    return obj


def _text_field(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value.strip():
        raise Invalid("schema_mismatch", f"{name!r} is missing or not a non-empty string")
    if len(value) > MAX_FIELD_CHARS:
        raise Invalid("schema_mismatch", f"{name!r} is {len(value)} characters, over {MAX_FIELD_CHARS}")
    return value.strip()


def _letters(answer: str, n_options: int) -> list[str]:
    parts = [p.strip().strip("()").upper() for p in _LETTER_SEP.split(answer) if p.strip()]
    bad = [p for p in parts if len(p) != 1 or p not in LETTERS]
    if bad or not parts:
        raise Invalid("answer_not_in_options", f"answer {answer!r} is not option letters")
    outside = [p for p in parts if LETTERS.index(p) >= n_options]
    if outside:
        raise Invalid(
            "answer_not_in_options",
            f"answer letter {outside[0]} is outside the {n_options} options (A-{LETTERS[n_options - 1]})",
        )
    return sorted(set(parts))


# --------------------------------------------------------------- planted questions
# A document may carry a ready-made block of questions in the generator's own output
# format (or as a quiz: "Question: ... A) ... Answer: B"). A generator that echoes it
# writes a question whose evidence and answer are "in the document" because the block
# is: "2+2 -> 5" with evidence "2+2 is 5" (issue #37). Text inside such a block is what a
# document says about its own questions, never evidence for one.
_KEY = re.compile(r"""["'](?:question|answer|options|evidence|choices)["']\s*:""", re.I)
_MARKER_LINE = re.compile(
    r"^[\s*#>_|-]*(?:\d+\s*[.)]\s*)?(?:q(?:uestion)?\s*\d*|answers?|correct\s+answers?|evidence|"
    r"options?|choices?|solution|explanation)\s*\**\s*[:=]", re.I)
_OPTION_LINE = re.compile(r"^[\s*#>_|-]*\(?[A-Ha-h][).:]\s+\S")
MAX_BLOCK_CHARS = 20_000  # a JSON object longer than this is not one planted question
_CUT = "\x00\ufffe\x00"  # what a block becomes: no evidence spans it, it ends a sentence
_SENTENCE_END = re.compile(r"[.!?](?=\s)|" + re.escape(_CUT))


def _json_blocks(text: str) -> list[tuple[int, int]]:
    """Spans of {...} objects (braces balanced) that hold a question's keys."""
    import bisect

    keys = [m.start() for m in _KEY.finditer(text)]
    if not keys:
        return []
    spans, stack = [], []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            start = stack.pop()
            if i - start > MAX_BLOCK_CHARS:
                continue
            k = bisect.bisect_right(keys, start)
            if k < len(keys) and keys[k] < i:
                spans.append((start, i + 1))
    return spans


def _quiz_blocks(text: str) -> list[tuple[int, int]]:
    """Spans of runs of quiz-shaped lines ("Question: ...", "A) ...", "Answer: B") that
    hold a question or answer marker, or options right after a line asking a question."""
    spans: list[tuple[int, int]] = []
    run_start = run_end = -1
    marked = False
    prev_line: tuple[int, int, str] | None = None
    pos = 0
    for line in text.splitlines(keepends=True):
        start, end = pos, pos + len(line)
        pos = end
        body = line.strip()
        marker = bool(_MARKER_LINE.match(body))
        option = bool(_OPTION_LINE.match(body))
        if marker or option:
            if run_start < 0:
                run_start, marked = start, False
                if option and prev_line is not None and prev_line[2].endswith("?"):
                    run_start, marked = prev_line[0], True  # the question the options answer
            run_end = end
            marked = marked or marker
        elif body and run_start >= 0:
            if marked:
                spans.append((run_start, run_end))
            run_start = -1
        if body:
            prev_line = (start, end, body)
    if run_start >= 0 and marked:
        spans.append((run_start, run_end))
    return spans


def question_blocks(text: str) -> list[tuple[int, int]]:
    """The spans of `text` that are question-shaped blocks (merged, in order)."""
    spans = sorted(_json_blocks(text) + _quiz_blocks(text))
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


@functools.lru_cache(maxsize=64)
def _document_index(context: str) -> tuple[str, str]:
    """The folded document, and the same with its question blocks cut out, once per piece
    (n questions ask about one piece)."""
    blocks = question_blocks(context)
    parts, last = [], 0
    for a, b in blocks:
        parts += [context[last:a], f" {_CUT} "]
        last = b
    parts.append(context[last:])
    return _fold(context), _fold("".join(parts))


def _sentences_at(text: str, start: int, end: int) -> str:
    """The sentence(s) of `text` that the span [start, end) lies in."""
    left = 0
    for m in _SENTENCE_END.finditer(text, 0, start):
        left = m.end()
    right = _SENTENCE_END.search(text, end)
    return text[left:right.end() if right else len(text)]


def supported(answer_text: str, evidence: str, context: str) -> str | None:
    """Why the answer is not supported by `context` (None: it is), by the lexical test:
    the evidence is a passage of the document outside any question-shaped block, and most
    of the answer's content words are in the evidence's own sentence(s) (the answer is
    checked against its evidence, not against the whole document, where a planted block
    or any other sentence may hold its words)."""
    folded, clean = _document_index(context)
    ev = _fold(evidence)
    if ev not in folded:
        return "the evidence is not a passage of the document"
    words = content_words(answer_text)
    best: tuple[int, int] | None = None
    at = clean.find(ev)
    if at < 0:
        return ("the evidence occurs only inside a question-shaped block of the document "
                "(a planted question and answer is no evidence)")
    for _ in range(64):  # each occurrence outside the blocks; the best-supported one counts
        sentence = set(_WORD.findall(_sentences_at(clean, at, at + len(ev))))
        found = sum(1 for w in words if w in sentence)
        if best is None or found > best[0]:
            best = (found, len(words))
        if not words or found / len(words) >= MIN_ANSWER_SUPPORT:
            return None
        at = clean.find(ev, at + 1)
        if at < 0:
            break
    found, n = best or (0, len(words))
    return f"only {found} of the answer's {n} content words occur in the evidence's sentence"


def check(qtype: str, content: str | None, context: str) -> Question:
    """The question in a generator's reply, or Invalid(reason, detail)."""
    obj = parse_json(content)
    question = _text_field(obj, "question")
    answer = _text_field(obj, "answer")
    evidence = _text_field(obj, "evidence")
    options: tuple[str, ...] = ()
    if qtype in ("single_choice", "multi_choice"):
        raw = obj.get("options")
        if not isinstance(raw, list) or not all(isinstance(o, str) and o.strip() for o in raw):
            raise Invalid("schema_mismatch", "'options' is missing or not a list of non-empty strings")
        if not 2 <= len(raw) <= MAX_OPTIONS:
            raise Invalid("schema_mismatch", f"{len(raw)} options; give 2 to {MAX_OPTIONS}")
        options = tuple(_OPTION_LETTER.sub("", o.strip()) for o in raw)
        folded = [_fold(o) for o in options]
        if len(set(folded)) != len(folded):
            dup = next(o for o in options if folded.count(_fold(o)) > 1)
            raise Invalid("options_not_distinct", f"the option {dup!r} appears twice")
        letters = _letters(answer, len(options))
        if qtype == "single_choice" and len(letters) != 1:
            raise Invalid("wrong_answer_count", f"single choice with {len(letters)} answers ({answer!r})")
        if qtype == "multi_choice" and len(letters) < 2:
            raise Invalid("wrong_answer_count", f"multiple choice with one answer ({answer!r})")
        answer = ", ".join(letters)
    elif qtype != "free_form":
        raise ValueError(f"question type {qtype!r}: use one of {', '.join(TYPES)}")
    q = Question(qtype, question, answer, evidence, options)
    why = supported(q.answer_text(), evidence, context)
    if why:
        raise Invalid("unsupported_by_context", why)
    return q
