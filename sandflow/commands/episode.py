"""`sandflow run` (one task, live view) and `sandflow serve` (the embedded model). `run`
parses, builds the same RunSpec as `sandflow flows run`, calls the engine
(engine.single.run_single: the one preflight, the records, trajectory.json) and prints.

Heavy imports (openai, docker) happen inside the commands so `sandflow --help` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from sandbox.backends import backend_names
from sandbox.base import DEFAULT_BACKEND
from sandflow.commands.network_option import network_option
from sandflow.commands.prompts_option import prompt_dir_of, prompts_option
from sandflow.errors import EXIT_FAILED, EXIT_INFRA, EXIT_INTERRUPTED, EXIT_USAGE, fail
from tasks.defaults import (
    DEFAULT_MAX_STEPS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_TEMPERATURE,
    DEFAULT_WALL_CLOCK_S,
)
from tasks.local_chat import DEFAULT_TOOL_FORMAT, TOOL_FORMATS
from tasks.replies import read_arguments


class ModeChoice(StrEnum):
    sandbox = "sandbox"
    llm = "llm"


# The registered sandbox backends (sandbox/backends.py), as typer's choices.
# The embedded engine's tool formats (tasks/local_chat.py), as typer's choices.
ToolFormatChoice = StrEnum("ToolFormatChoice", {f: f for f in TOOL_FORMATS})  # type: ignore[misc]


BackendChoice = StrEnum("BackendChoice", {name: name for name in backend_names()})  # type: ignore[misc]


def _fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """One clear sentence on stderr, no traceback (sandflow/errors.py)."""
    return fail(message, code, label="Error")


def _read_inputs(input_dir: Path | None) -> dict[str, str | bytes]:
    """The files of `--input-dir`, read under datasets_prep.paths' rules: nothing from
    outside the folder (symlinks leaving it are refused by name), UTF-8 names without
    control characters, regular files only, bounded sizes. Any problem stops the command
    here, before the model, the sandbox or a record is touched."""
    if input_dir is None:
        return {}
    from datasets_prep.paths import InputFolderError, read_input_folder

    try:
        folder = read_input_folder(input_dir)
    except InputFolderError as exc:
        raise _fail(str(exc)) from None
    for name, why in folder.skipped:
        typer.secho(f"note: {input_dir}: skipped {name!r}: {why}", err=True, fg=typer.colors.YELLOW)
    return folder.files


class LiveView:
    """Prints thoughts, actions and observations as the episode produces them."""

    def __init__(self, quiet: bool = False) -> None:
        from sandflow.console import console

        self.console = console()
        self.quiet = quiet
        self._status: Any = None

    def _spin(self, text: str | None) -> None:
        """A spinner while the model thinks or a command runs (only on a terminal)."""
        if self._status is not None:
            self._status.stop()
            self._status = None
        if text and self.console.is_terminal:
            self._status = self.console.status(text)
            self._status.start()

    def __call__(self, kind: str, payload: Any) -> None:
        if self.quiet:
            return
        from rich.markup import escape
        from rich.panel import Panel

        from sandflow.console import fits, rule

        c = self.console
        wide = fits(c)
        if kind == "request":
            self._spin(f"turn {payload + 1}: waiting for the model...")
            return
        if kind == "tool":
            self._spin(f"running {payload.name}...")
            return
        self._spin(None)
        if kind == "reply":
            turn = payload
            rule(c, f"[bold blue]turn {turn.turn_index + 1}[/] [dim]{turn.model_latency_s:.2f}s[/]")
            if turn.reasoning_content:
                c.print(Panel(escape(_short(turn.reasoning_content, 1500)), title="reasoning", border_style="magenta", expand=wide))
            if turn.assistant_content:
                c.print(Panel(escape(_short(turn.assistant_content, 1500)), title="thought", border_style="cyan", expand=wide))
            for call in turn.tool_calls:
                c.print(Panel(escape(_short(_pretty_args(call.arguments), 800)), title=f"action: {call.name}", border_style="yellow", expand=wide))
            if not turn.tool_calls:
                c.print("[dim]no tool call: sent the continue prompt[/]")
        elif kind == "observation":
            obs = payload
            style = "red" if obs.error or (obs.exit_code not in (None, 0)) else "green"
            c.print(Panel(escape(_short(obs.content, 1200)), title=f"observation ({obs.duration_s:.2f}s)", border_style=style, expand=wide))


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 20] + f"\n... [{len(text) - n + 20} more chars]"


def _pretty_args(raw: str) -> str:
    args, problem = read_arguments(raw)
    if problem is not None:
        return raw
    if isinstance(args, dict) and set(args) == {"command"}:
        return str(args["command"])
    return json.dumps(args, indent=2, ensure_ascii=False)


def run(
    query: str | None = typer.Option(None, "--query", "-q", help="The task, in plain words (required unless --replay)."),
    input_dir: Path | None = typer.Option(
        None, "--input-dir", "-i", exists=True, file_okay=False, dir_okay=True, readable=True,
        help="Files to give the model; placed in the sandbox's input dir (/testbed/documents). "
        "Nothing from outside the folder is read: a symlink leaving it stops the run (a symlink "
        "to a file inside is copied as that file).",
    ),
    output_dir: Path = typer.Option(
        Path("sandflow_runs"), "--output-dir", "-o",
        help="Where the run folder goes: <output-dir>/<timestamp>/ with files/, trajectory.json, records.jsonl.",
    ),
    model: str | None = typer.Option(None, "--model", "-m", help="Model name as the server serves it (env SANDFLOW_MODEL)."),
    base_url: str | None = typer.Option(
        None, "--base-url", "-u",
        help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (env SANDFLOW_BASE_URL). "
        "Unset: the embedded SmolLM2-135M starts for this run. The API key comes only from "
        "SANDFLOW_API_KEY / OPENAI_API_KEY.",
    ),
    mode: ModeChoice = typer.Option(ModeChoice.sandbox, "--mode", help="sandbox: tools in a sandbox; llm: one plain call (the baseline)."),
    domain: str = typer.Option("general", "--domain", help="Prompt set: general, math, physics, chem, biomed, long_context, instruct_follow."),
    max_steps: int = typer.Option(DEFAULT_MAX_STEPS, "--max-steps", min=1, help="Turns before the episode ends with max_steps."),
    temperature: float | None = typer.Option(None, "--temperature", min=0.0, help=f"Sampling temperature (default {DEFAULT_TEMPERATURE:g})."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1, help=f"Completion tokens per call (default {DEFAULT_MAX_TOKENS})."),
    context_tokens: int | None = typer.Option(None, "--context-tokens", min=256, help="Token budget of one request (prompt + completion)."),
    wall_clock: float = typer.Option(DEFAULT_WALL_CLOCK_S, "--wall-clock", min=1.0, help="Seconds for the whole episode."),
    exec_timeout: float | None = typer.Option(None, "--exec-timeout", min=1.0, help="Seconds per shell command (default: the sandbox's 120)."),
    request_timeout: float | None = typer.Option(None, "--request-timeout", min=1.0, help=f"Seconds per model request (default {DEFAULT_REQUEST_TIMEOUT_S:g})."),
    backend: BackendChoice | None = typer.Option(None, "--backend", help=f"Sandbox backend (default {DEFAULT_BACKEND})."),
    network: str | None = network_option(),
    image: str | None = typer.Option(None, "--image", help="Sandbox image tag (default: the sandflow image)."),
    logprobs: bool = typer.Option(False, "--logprobs", help="Request logprobs (and token ids from vLLM)."),
    extra_body: str | None = typer.Option(
        None, "--extra-body",
        help='JSON object passed through to the server, e.g. \'{"top_k": 20, "chat_template_kwargs": {"enable_thinking": false}}\'.',
    ),
    warehouse: Path | None = typer.Option(
        None, "--warehouse", file_okay=False,
        help="Also record the episode in this warehouse folder (queryable with `sandflow sql`).",
    ),
    prompts: str | None = prompts_option(),
    quiet: bool = typer.Option(False, "--quiet", help="No live view; only the summary line."),
    replay: str | None = typer.Option(
        None, "--replay", rich_help_panel="Replay",
        help="RUN/EPISODE of the warehouse (--warehouse, else the configured one): rebuild its "
        "sandbox by re-running its recorded tool calls of turns < --until-turn in a fresh sandbox, "
        "check each result against the recording, then let --model go on from its recorded "
        "messages. Recorded there as a new episode with its parent and branch turn (docs/rl.md, \"Replay and lineage\").",
    ),
    until_turn: int | None = typer.Option(
        None, "--until-turn", min=0, rich_help_panel="Replay",
        help="With --replay: the turn the new model starts at (its turns before are replayed).",
    ),
    replay_ignore: list[str] = typer.Option(
        [], "--replay-ignore", rich_help_panel="Replay",
        help="With --replay: a regex of output text that may differ (repeatable), masked on both "
        "sides beside the built-in rule (durations, times, pids, temp names).",
    ),
    allow_divergence: bool = typer.Option(
        False, "--allow-divergence", rich_help_panel="Replay",
        help="With --replay: go on after a divergence (kept in the episode's config) instead of stopping.",
    ),
) -> None:
    """Solve one task with a model in a sandbox, showing every turn live.

    The model gets a fresh sandbox and three tools (execute_bash, str_replace_editor,
    submit). Files from --input-dir are placed in /testbed/documents; the answer is read
    from /testbed/output/answer.txt. Everything is saved to <output-dir>/<timestamp>/:
    files/ (the sandbox's output folder), trajectory.json and records.jsonl.

    Exit code: 0 the episode ran (see the summary line), 1 a --replay diverged from its
    recording, 2 bad input, endpoint or model name, 3 the model endpoint or the sandbox
    failed mid-episode.

    Examples:

      sandflow run -q "How many primes are below 10**6?" -u http://127.0.0.1:8000/v1 -m Qwen/Qwen3-4B

      sandflow run -q "Which play mentions Verona most?" -i ./plays --domain long_context

      sandflow run -q "What is 2**100?" --mode llm

      sandflow run --replay RUN/EPISODE --until-turn 3 -m other-model --warehouse wh
    """
    _check_flags(query, input_dir, mode, domain, replay, until_turn, replay_ignore, allow_divergence)
    settings, spec = _run_spec(
        mode=mode, model=model, base_url=base_url, temperature=temperature, max_tokens=max_tokens,
        request_timeout=request_timeout, backend=backend, network=network, image=image,
        logprobs=logprobs, extra=_extra_body(extra_body), max_steps=max_steps,
        context_tokens=context_tokens, wall_clock=wall_clock, exec_timeout=exec_timeout,
        prompt_dir=prompt_dir_of(prompts), domain=domain, warehouse=warehouse, replay=replay,
    )
    from engine.single import new_stamp

    stamp = new_stamp()
    run_dir = output_dir / stamp
    task, plan = _task_or_replay(spec, stamp, query, domain, input_dir, replay, until_turn,
                                 replay_ignore, allow_divergence)  # fmt: skip
    done = _run_one(task, spec, run_dir, stamp, bool(settings.model), mode, quiet, plan)
    rec = done.result.record
    if done.replay is not None:
        typer.echo(
            f"replayed {done.replay.calls} tool call(s) of turns < {until_turn} of {replay}: "
            f"{done.replay.total} divergence(s); parent {rec.parent_run_id}/{rec.parent_episode_id}, "
            f"branch turn {rec.branch_turn}; warehouse {spec.recording.warehouse}"
        )
    if rec.error and rec.termination != "submitted":
        typer.secho(f"{rec.termination}: {rec.error}", err=True, fg=typer.colors.YELLOW)
    typer.echo(done.summary())
    if rec.is_infra_failure:
        raise typer.Exit(EXIT_INFRA)


def _check_flags(
    query: str | None, input_dir: Path | None, mode: ModeChoice, domain: str, replay: str | None,
    until_turn: int | None, replay_ignore: list[str], allow_divergence: bool,
) -> None:
    """The flags that go together, and a known --domain (one sentence, exit 2)."""
    from tasks.prompts import domains

    if replay is not None:
        if query is not None or input_dir is not None or mode != ModeChoice.sandbox:
            raise _fail("--replay takes the task from the recorded run: drop --query, --input-dir and --mode")
        if until_turn is None:
            raise _fail("--replay needs --until-turn K: the turn the model starts at")
    elif until_turn is not None or replay_ignore or allow_divergence:
        raise _fail("--until-turn, --replay-ignore and --allow-divergence go with --replay RUN/EPISODE")
    elif query is None:
        raise _fail("--query is required: say what the model should do (or --replay RUN/EPISODE)")
    elif not query.strip():
        raise _fail("--query is empty: say what the model should do")
    if domain not in ["general", *domains()]:
        raise _fail(f"unknown --domain {domain!r}: use one of general, {', '.join(domains())}")


def _extra_body(extra_body: str | None) -> dict[str, Any]:
    """--extra-body as a JSON object (one sentence when it is not)."""
    if not extra_body:
        return {}
    try:
        extra = json.loads(extra_body)
    except json.JSONDecodeError as exc:
        raise _fail(f"--extra-body is not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(extra, dict):
        raise _fail("--extra-body must be a JSON object, e.g. '{\"top_k\": 20}'")
    return extra


def _run_spec(
    *, mode: ModeChoice, model: str | None, base_url: str | None, temperature: float | None,
    max_tokens: int | None, request_timeout: float | None, backend: BackendChoice | None,
    network: str | None, image: str | None, logprobs: bool, extra: dict[str, Any],
    max_steps: int, context_tokens: int | None, wall_clock: float, exec_timeout: float | None,
    prompt_dir: str | None, domain: str, warehouse: Path | None, replay: str | None,
) -> tuple[Any, Any]:
    """The settings and the episode's RunSpec, every value checked now (exit 2 naming it)."""
    from pydantic import ValidationError

    from sandflow.config import load_settings, run_spec
    from tasks.prompts import load_prompts

    try:
        load_prompts(domain, prompt_dir)
        settings = load_settings(
            model=model, base_url=base_url, temperature=temperature, max_tokens=max_tokens,
            request_timeout_s=request_timeout,
            backend=backend.value if backend else None,
            network=network, image=image,
        )
        # the settings' endpoint, sampling and sandbox; one episode's sandbox is fresh (no
        # pool to return it to), and it is recorded only where asked (or replayed from)
        spec = run_spec(
            settings, task_set="adhoc", mode=mode.value, logprobs=logprobs,
            return_token_ids=logprobs, extra_body=extra, max_steps=max_steps,
            context_tokens=context_tokens, wall_clock_s=wall_clock, exec_timeout_s=exec_timeout,
            prompt_dir=prompt_dir,
        ).replace(
            warehouse=str(warehouse or (settings.warehouse if replay else "")) or None,
            sandbox_reuse="fresh",
        )
        spec.to_model_config(), spec.to_limits(), spec.to_sandbox_config()  # every value checked now
    except ValidationError as exc:
        err = exc.errors()[0]
        raise _fail(f"invalid setting {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    except ValueError as exc:
        raise _fail(str(exc)) from None
    return settings, spec


def _task_or_replay(
    spec: Any, stamp: str, query: str | None, domain: str, input_dir: Path | None,
    replay: str | None, until_turn: int | None, replay_ignore: list[str], allow_divergence: bool,
) -> tuple[Any, Any]:
    """The episode's task: --query's (with --input-dir's files), or the replay plan's."""
    from datasets_prep.task import TaskValidationError
    from engine.single import adhoc_task

    try:
        if replay is not None:
            from engine.replay import plan_replay

            assert spec.recording.warehouse is not None and until_turn is not None
            plan = plan_replay(spec.recording.warehouse, replay, until_turn, ignore=tuple(replay_ignore),
                               allow_divergence=allow_divergence)  # fmt: skip
            return plan.task, plan
        assert query is not None  # checked by _check_flags
        return adhoc_task(query, domain, _read_inputs(input_dir), stamp), None
    except (TaskValidationError, ValueError) as exc:  # ReplayError is a ValueError
        raise _fail(str(exc)) from None


def _run_one(
    task: Any, spec: Any, run_dir: Path, stamp: str, model_given: bool, mode: ModeChoice,
    quiet: bool, plan: Any,
) -> Any:
    """The episode, shown live; its failures as one sentence with the exit code they mean."""
    from engine import RunConfigError
    from engine.single import run_single
    from tasks.local_model import LocalModelError
    from tasks.replay import ReplayDiverged, ReplayError

    view = LiveView(quiet)

    def ready(cfg: Any) -> None:
        if not quiet:
            view.console.print(f"[bold]sandflow run[/] model [cyan]{cfg.model}[/] at {cfg.base_url}, mode {mode.value}, folder {run_dir}")

    try:
        return run_single(task, spec, run_dir, run_id=f"run-{stamp}", model_given=model_given,
                          on_event=view, on_ready=ready, replay=plan)  # fmt: skip
    except ReplayDiverged as exc:
        view._spin(None)
        raise _fail(f"{exc}\nNothing was recorded; --replay-ignore REGEX masks output that may "
                    "differ, --allow-divergence goes on anyway.", EXIT_FAILED) from None
    except ReplayError as exc:
        raise _fail(str(exc), EXIT_INFRA) from None
    except RunConfigError as exc:
        raise _fail(str(exc)) from None
    except LocalModelError as exc:
        raise _fail(f"{exc} (or pass --base-url to use a running server)") from None
    except KeyboardInterrupt:
        view._spin(None)
        raise _fail("interrupted; partial records are in " + str(run_dir), EXIT_INTERRUPTED) from None


def serve(
    port: int = typer.Option(0, "--port", min=0, max=65535, help="Port on 127.0.0.1 (0: a free one)."),
    n_ctx: int = typer.Option(8192, "--n-ctx", min=512, help="Context window in tokens."),
    alias: str = typer.Option("smollm2-135m-instruct", "--alias", help="Model name the server answers to."),
    slots: int = typer.Option(1, "--slots", min=1, max=16, help="Requests served at once (llama.cpp contexts, each with its prefix cache; the threads are split between them)."),
    tool_format: ToolFormatChoice = typer.Option(DEFAULT_TOOL_FORMAT, "--tool-format", help="How tools, calls and results are rendered: llama-cpp-python's chatml-function-calling, or qwen2.5 (TRL's Qwen2.5 template: what `sandflow train` trains in)."),
) -> None:
    """Run the embedded model (SmolLM2-135M, llama.cpp, tool calling) in the foreground.

    Point any OpenAI client at the printed URL; Ctrl+C stops it.
    """
    import time

    from tasks.local_model import LocalModelError, LocalModelServer

    threads = max(1, min(4, os.cpu_count() or 1) // slots)
    server = LocalModelServer(port=port or None, alias=alias, n_ctx=n_ctx, slots=slots, n_threads=threads,
                              tool_format=str(tool_format))
    try:
        server.start()
    except LocalModelError as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"serving {alias} at {server.base_url} (log: {server.log_path}); Ctrl+C stops")
    sys.stdout.flush()
    try:
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(0.5)
        raise _fail(f"the server exited: {server.log_tail()}", EXIT_FAILED)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def register(app: typer.Typer) -> None:
    """Add this room's commands to the main app."""
    app.command("run", rich_help_panel="Episodes")(run)
    app.command("serve", rich_help_panel="Episodes")(serve)
