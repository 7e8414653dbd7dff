"""The paper's sandbox-usage analysis: which capability does each turn use?

Three capabilities (LLM-in-Sandbox, section "sandbox usage"), plus "none":

- computation         running code: interpreters, compilers, scripts, calculators
- file_management     creating, reading, editing, listing, moving, searching files
- external_resource  installing packages, fetching data, any network tool or URL
- none                everything else (submit, cd/pwd/echo, unknown programs)

ALL the rules live in `RULES` below, one row each, in the order they are tried.
A shell command is split into simple commands (on `&&`, `||`, `;`, `|`, `&`,
newlines; heredoc bodies removed first); wrappers such as `sudo`, `timeout 10`,
`env X=1`, `nohup`, `time` are skipped; the first rule whose pattern matches the
remaining words labels that simple command. On top of that, two whole-command
checks: a URL anywhere (also inside a heredoc script) means external resources,
and an output redirection to a file (`> f`, `>> f`, `tee f`) means file management.

A turn's labels are the union over all its tool calls, so a turn can use several
capabilities (the paper's rates need not sum to 100%); `primary_label` picks one
for charts, by the priority external > computation > file > none.
`str_replace_editor` (view/create/str_replace/insert/undo_edit) is always file
management; `submit` and unknown tools are none.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from tasks.replies import read_arguments

Capability = Literal["computation", "file_management", "external_resource", "none"]
CAPABILITIES: tuple[Capability, ...] = (
    "computation",
    "file_management",
    "external_resource",
)
PRIORITY: tuple[Capability, ...] = (
    "external_resource",
    "computation",
    "file_management",
    "none",
)


@dataclass(frozen=True)
class Rule:
    """One row of the table: a regex over a simple command's words, joined by spaces."""

    capability: Capability
    pattern: str
    why: str

    def matches(self, simple_command: str) -> bool:
        return re.search(self.pattern, simple_command) is not None


_PY = r"(?:python[\d.]*|pypy3?|ipython3?)"

# Tried in order; first match wins for a simple command. Keep `why` short: it is
# printed by `sandflow flows usage --rules` and in docs/pipeline.md.
RULES: tuple[Rule, ...] = (
    # --- external resources: package managers, downloads, network tools --------------
    Rule("external_resource", rf"^{_PY} (?:-\S+ )*-m pip (?:install|download)\b", "python -m pip install"),
    Rule("external_resource", r"^(?:pip[\d.]*|uv pip|pipx) (?:install|download)\b", "pip install / download"),
    Rule("external_resource", r"^(?:apt|apt-get|aptitude|conda|mamba|micromamba|yum|dnf|apk|brew) (?:\S+ )*(?:install|update|upgrade|add|create)\b", "system/conda package manager"),
    Rule("external_resource", r"^(?:npm|pnpm|yarn|gem|cargo|go|R -e install|cpan|cpanm) (?:install|add|get|fetch)\b", "language package manager"),
    Rule("external_resource", r"^(?:curl|wget|aria2c|axel|http|https|httpie|ftp|sftp|scp|ssh|rsync|nc|ncat|netcat|telnet|ping|dig|nslookup|host|traceroute|whois)\b", "network tool"),
    Rule("external_resource", r"^git (?:clone|fetch|pull|push|ls-remote|submodule)\b", "git over the network"),
    Rule("external_resource", r"^(?:huggingface-cli|hf) download\b|^kaggle\b", "dataset/model download"),
    # --- computation: running code --------------------------------------------------
    Rule("computation", rf"^{_PY}\b", "python interpreter (script, -c, -m, heredoc)"),
    Rule("computation", r"^(?:node|nodejs|deno|bun|Rscript|R|julia|perl|ruby|php|lua|octave|sage|maxima|gp|java|scala|kotlin|ghci|runghc|swift)\b", "other interpreters"),
    Rule("computation", r"^(?:gcc|g\+\+|cc|c\+\+|clang|clang\+\+|gfortran|rustc|javac|go (?:run|build)|cargo (?:run|build)|make|cmake|ninja)\b", "compile / build"),
    Rule("computation", r"^(?:pytest|py\.test|jupyter|nbconvert|papermill|tox|nox)\b", "run tests / notebooks"),
    Rule("computation", r"^(?:bc|dc|expr|awk|gawk|mawk|factor|units|qalc)\b", "calculators and awk programs"),
    Rule("computation", r"^(?:bash|sh|zsh|dash|source|\.) \S+\.(?:sh|bash)\b", "run a shell script"),
    Rule("computation", r"^\.{1,2}/\S+|^/(?:testbed|tmp|home)/\S+", "run a local program (./a.out, ./run.sh)"),
    # --- file management: create, read, edit, list, move, search files ----------------
    Rule("file_management", r"^(?:ls|ll|la|dir|tree|find|locate|fd|stat|file|du|df|realpath|readlink)\b", "list / inspect files"),
    Rule("file_management", r"^(?:cat|tac|head|tail|less|more|nl|wc|xxd|hexdump|od|strings|pdftotext|jq|yq|column|csvlook)\b", "read files"),
    Rule("file_management", r"^(?:cp|mv|rm|rmdir|mkdir|touch|ln|chmod|chown|install|truncate|dd|shred)\b", "create / move / delete files"),
    Rule("file_management", r"^(?:sed|perl -pi|ed|ex|vi|vim|nano|emacs|patch|tee)\b", "edit files (sed -i, patch, editors)"),
    Rule("file_management", r"^(?:grep|egrep|fgrep|rg|ag|ack|diff|cmp|comm|sort|uniq|cut|paste|join|split|tr|iconv|md5sum|sha1sum|sha256sum)\b", "search / compare / reshape text files"),
    Rule("file_management", r"^(?:tar|zip|unzip|gzip|gunzip|zcat|bzip2|bunzip2|xz|unxz|7z|zstd)\b", "archives"),
    Rule("file_management", r"^git (?:init|add|commit|status|diff|log|show|checkout|restore|mv|rm)\b", "local git bookkeeping"),
    # --- explicitly none: navigation, printing, environment inspection ---------------
    Rule("none", r"^(?:cd|pwd|echo|printf|export|unset|set|true|false|:|sleep|clear|history|exit|alias|type|which|whereis|command|hash)\b", "shell navigation / printing"),
    Rule("none", r"^(?:whoami|id|date|uname|hostname|env|printenv|nproc|free|uptime|top|ps|lscpu|locale)\b", "inspect the system"),
    Rule("none", r"^(?:pip[\d.]*|uv pip) (?:list|show|freeze|--version|check)\b", "inspect installed packages"),
)

# Wrappers skipped before matching: `sudo X`, `timeout 30 X`, `env A=1 X`, `nohup X`, ...
_WRAPPERS = {"sudo", "nohup", "time", "nice", "stdbuf", "exec", "command", "builtin", "xargs", "env"}
_WRAPPERS_WITH_ARG = {"timeout", "nice", "ionice"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_URL = re.compile(r"\b(?:https?|ftp)://[^\s'\"]+", re.IGNORECASE)
_NET_CODE = re.compile(
    r"\b(?:urllib\.request|urlopen|urlretrieve|requests\.(?:get|post)|httpx\.(?:get|post)|"
    r"socket\.create_connection|pip\.main|subprocess\.\w+\(\s*\[?['\"]pip)"
)
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1[^\n]*\n(.*?)(?:\n\s*\2\s*(?:\n|$)|\Z)", re.S)
_SEPARATOR_CHARS = set(";&|()\n")
_HARMLESS_TARGETS = {"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty"}
_SCRIPT_IN_SHELL = re.compile(r"^(?:bash|sh|zsh|dash)\s+-c\s+(.+)$", re.S)


def _strip_heredocs(command: str) -> tuple[str, list[str]]:
    """Remove heredoc bodies (kept apart: they are code or file content, not commands)."""
    bodies: list[str] = []

    def repl(m: re.Match[str]) -> str:
        bodies.append(m.group(3))
        return "<< HEREDOC\n"

    return _HEREDOC.sub(repl, command), bodies


def _tokens(command: str) -> list[str]:
    lex = shlex.shlex(command, posix=True, punctuation_chars=";&|()<>\n")
    lex.whitespace = " \t\r"
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return list(lex)
    except ValueError:  # unbalanced quotes: fall back to a crude split, never fail
        return re.findall(r"[;&|()<>\n]+|[^\s;&|()<>]+", command)


def split_simple_commands(command: str) -> tuple[list[list[str]], bool]:
    """Simple commands (word lists) of a shell command line, and whether it writes a file."""
    text, _ = _strip_heredocs(command)
    toks = _tokens(text)
    simple: list[list[str]] = []
    writes_file = False
    current: list[str] = []
    i = 0
    while i < len(toks):
        tok = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ""
        if set(tok) <= _SEPARATOR_CHARS:  # ;  &&  ||  |  &  newline  ( )  and runs of them
            if current:
                simple.append(current)
            current = []
            i += 1
            continue
        if tok.isdigit() and nxt[:1] in ("<", ">"):  # the fd in `2>` / `1>>`
            i += 1
            continue
        if tok[:1] == ">" or tok in ("&>", "&>>"):
            target = nxt
            if target and target not in _HARMLESS_TARGETS and not target.isdigit() and target != "-":
                writes_file = True
            i += 2
            continue
        if tok[:1] == "<":  # input redirection or heredoc marker: skip its operand
            i += 2
            continue
        current.append(tok)
        i += 1
    if current:
        simple.append(current)
    return simple, writes_file


def _unwrap(words: Sequence[str]) -> list[str]:
    w = list(words)
    while w:
        head = w[0].rsplit("/", 1)[-1] if w[0].startswith("/usr/") or w[0].startswith("/bin/") else w[0]
        if _ASSIGNMENT.match(head):
            w = w[1:]
        elif head in _WRAPPERS_WITH_ARG:
            w = w[1:]
            while w and (w[0].startswith("-") or re.fullmatch(r"[\d.]+[smhd]?", w[0])):
                w = w[1:]
        elif head in _WRAPPERS:
            w = w[1:]
            while w and w[0].startswith("-"):
                w = w[1:]
        else:
            w[0] = head
            break
    return w


def label_simple_command(words: Sequence[str]) -> tuple[Capability, Rule | None]:
    """The capability of one simple command, with the rule that decided it."""
    w = _unwrap(words)
    if not w:
        return "none", None
    line = " ".join(w)
    nested = _SCRIPT_IN_SHELL.match(line)
    if nested and len(w) >= 3 and w[1] == "-c":
        labels = label_bash(w[2])
        for cap in PRIORITY:
            if cap in labels:
                return cap, None
    for rule in RULES:
        if rule.matches(line):
            return rule.capability, rule
    return "none", None


def label_bash(command: str) -> set[Capability]:
    """All capabilities one `execute_bash` command uses."""
    labels: set[Capability] = set()
    if not command or not command.strip():
        return labels
    _, bodies = _strip_heredocs(command)
    simple, writes_file = split_simple_commands(command)
    for words in simple:
        cap, _rule = label_simple_command(words)
        if cap != "none":
            labels.add(cap)
        w = _unwrap(words)
        # `cat > f << EOF` / `echo x > f`: writing a file (caught via writes_file below)
        if w and w[0] == "tee" and len(w) > 1:
            labels.add("file_management")
    if writes_file:
        labels.add("file_management")
    if _URL.search(command) or any(_NET_CODE.search(b) for b in bodies) or _NET_CODE.search(command):
        labels.add("external_resource")
    return labels


def _arguments(raw: str | dict | None) -> dict:
    if isinstance(raw, dict):
        return raw
    return read_arguments(raw)[0]  # malformed: {} (tasks.replies' rule, bounded nesting)


def label_tool_call(name: str, arguments: str | dict | None) -> set[Capability]:
    """Capabilities of one tool call (name and raw JSON arguments as the model sent them)."""
    if name == "execute_bash" or name == "bash":
        cmd = _arguments(arguments).get("command") or _arguments(arguments).get("cmd")
        return label_bash(cmd) if isinstance(cmd, str) else set()
    if name in ("str_replace_editor", "file_editor", "editor"):
        return {"file_management"}
    return set()  # submit, unknown tools, invalid calls


def label_turn(tool_calls: Iterable[tuple[str, str | dict | None]]) -> set[Capability]:
    """Union over a turn's tool calls, given as (name, arguments) pairs."""
    out: set[Capability] = set()
    for name, args in tool_calls:
        out |= label_tool_call(name, args)
    return out


def primary_label(labels: Iterable[str]) -> Capability:
    s = set(labels)
    for cap in PRIORITY:
        if cap in s:
            return cap
    return "none"


def rules_table() -> list[dict[str, str]]:
    """The table as rows, for docs and `sandflow flows usage --rules`."""
    return [{"capability": r.capability, "pattern": r.pattern, "why": r.why} for r in RULES]
