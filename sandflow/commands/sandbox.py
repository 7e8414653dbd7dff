"""`sandflow image ...` and `sandflow sandbox ...`: the commands of the sandbox/ library."""

from __future__ import annotations

import json
import time
from typing import Any

import typer

from sandflow.commands.network_option import network_option
from sandflow.console import console as stdout_console
from sandflow.console import fits, short
from sandflow.errors import EXIT_FAILED, EXIT_USAGE, fail

image_app = typer.Typer(
    help="Build and inspect the one shared sandbox image.", no_args_is_help=True
)
sandbox_app = typer.Typer(
    help=(
        "The virtual computer: try it, list live sandboxes, remove leaked ones.\n\n"
        "Every sandbox carries labels sandflow.run_id / episode_id / created_at / ttl_s; "
        "`gc` decides from those alone, never from the image name."
    ),
    no_args_is_help=True,
)

BACKEND_HELP = "docker (default) or bwrap (bubblewrap, no daemon, same root filesystem)."


@image_app.command("build")
def image_build(
    force: bool = typer.Option(False, "--force", help="Rebuild even if the tag exists."),
    dockerfile: bool = typer.Option(
        False, "--dockerfile", help="Build from a Dockerfile (needs a registry) instead of offline."
    ),
    tag: list[str] = typer.Option([], "--tag", help="Extra tags to put on the image."),
    rootfs_only: bool = typer.Option(
        False, "--rootfs-only", help="Only the bubblewrap root filesystem (no Docker needed)."
    ),
    no_rootfs: bool = typer.Option(
        False, "--no-rootfs", help="Skip the bubblewrap root filesystem (docker backend only)."
    ),
) -> None:
    """Build the sandbox image offline from Debian packages (debootstrap + docker import).

    The tag carries a hash of the content list: an unchanged list reuses the image. The
    same root filesystem is kept for the bubblewrap backend (sandflow image info shows where).
    """
    from sandbox.image import (
        DEFAULT_SPEC,
        ImageBuildError,
        build_image,
        build_rootfs,
        image_size_bytes,
    )

    console = stdout_console()
    if rootfs_only:
        try:
            path = build_rootfs(
                DEFAULT_SPEC, force=force, log=lambda m: console.print(f"[dim]{m}[/dim]")
            )
        except ImageBuildError as e:
            raise fail(f"rootfs build failed: {e}", EXIT_FAILED) from None
        console.print(f"[green]rootfs ready:[/green] {path}")
        return
    try:
        built = build_image(
            DEFAULT_SPEC,
            force=force,
            dockerfile=dockerfile,
            extra_tags=tuple(tag),
            with_rootfs=not no_rootfs,
            log=lambda m: console.print(f"[dim]{m}[/dim]"),
        )
    except ImageBuildError as e:
        raise fail(f"image build failed: {e}", EXIT_FAILED) from None
    console.print(f"[green]{built}[/green] ({image_size_bytes(built) / 1e9:.2f} GB)")


@image_app.command("info")
def image_info() -> None:
    """Show the image tag, whether it is built, its size, and the bubblewrap rootfs path."""
    from rich.table import Table

    from sandbox.image import DEFAULT_SPEC, rootfs_path

    table = Table(title="sandbox image")
    table.add_column("what")
    table.add_column("value")
    table.add_row("tag", DEFAULT_SPEC.tag)
    try:
        from sandbox.engine import docker_client

        attrs = docker_client().api.inspect_image(DEFAULT_SPEC.tag)
        table.add_row("docker image", f"built, {attrs.get('Size', 0) / 1e9:.2f} GB")
    except Exception as e:  # noqa: BLE001 - reported, not raised
        table.add_row("docker image", f"[yellow]not available[/yellow] ({str(e)[:80]})")
    root = rootfs_path(DEFAULT_SPEC)
    ready = (root / ".sandflow-complete").exists()
    table.add_row("rootfs (bwrap)", f"{root} ({'ready' if ready else 'missing'})")
    table.add_row("packages", ", ".join(sorted(DEFAULT_SPEC.packages)))
    stdout_console().print(table)


def _client_or_none(docker_host: str | None, console: Any) -> Any:
    from sandbox.base import SandboxError
    from sandbox.engine import docker_client

    try:
        return docker_client(docker_host)
    except SandboxError as e:
        console.print(f"[yellow]docker: {e}[/yellow]")
        return None


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


@sandbox_app.command("ls")
def sandbox_ls(
    run_id: str | None = typer.Option(
        None, "--run-id", help="Only runs whose id starts with this."
    ),
    docker_host: str | None = typer.Option(
        None, "--docker-host", envvar="DOCKER_HOST", help="Engine address (default: local socket)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object per line instead of a table."
    ),
) -> None:
    """List sandflow sandboxes (docker containers and bubblewrap sandboxes) by label."""
    from rich.table import Table

    from sandbox import gc as G
    from sandbox import labels as L

    console = stdout_console()
    found = G.list_all(_client_or_none(docker_host, console), run_id)
    if as_json:
        for s in found:
            typer.echo(
                json.dumps(
                    {"backend": s.backend, "id": s.id, "status": s.status, "labels": s.labels}
                )
            )
        return
    table = Table(title=f"{len(found)} sandflow sandbox(es)")
    for col in ("backend", "id", "run", "episode", "status", "age", "ttl", "owner", "garbage?"):
        table.add_column(col)
    for s in found:
        reason = s.garbage_reason()
        table.add_row(
            s.backend,
            short(console, s.id, 12),
            s.run_id,
            s.episode_id,
            s.status,
            _age(s.age_s),
            s.labels.get(L.TTL_S, "?") + "s",
            f"{s.labels.get(L.HOST, '?')}:{s.labels.get(L.PID, '?')} ({s.owner})",
            f"[red]{reason}[/red]" if reason else "no",
        )
    console.print(table)


@sandbox_app.command("gc")
def sandbox_gc(
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Show what would be removed; remove nothing."
    ),
    everything: bool = typer.Option(
        False, "--all", help="Remove every sandflow sandbox, live or not (still only by label)."
    ),
    run_id: str | None = typer.Option(
        None, "--run-id", help="Only runs whose id starts with this."
    ),
    docker_host: str | None = typer.Option(
        None, "--docker-host", envvar="DOCKER_HOST", help="Engine address (default: local socket)."
    ),
) -> None:
    """Remove leaked sandboxes: TTL passed, or the run that opened them is gone.

    Only containers labelled sandflow.run_id are considered, never anything else of the
    same image. Owner liveness is checked for sandboxes opened on this host (pid and its
    start time); sandboxes of other hosts are removed by TTL only. Without --run-id, also
    the docker fork side channel folders (TMPDIR/sandflow-bulk-<pid>-*) of dead processes.
    """
    from rich.table import Table

    from sandbox import gc as G

    console = stdout_console()
    removed = G.collect(
        _client_or_none(docker_host, console),
        dry_run=dry_run,
        everything=everything,
        run_prefix=run_id,
    )
    verb = "would remove" if dry_run else "removed"
    table = Table(title=f"{verb} {len(removed)} sandbox(es)")
    for col in ("backend", "id", "run", "episode", "why"):
        table.add_column(col)
    for info, why in removed:
        table.add_row(info.backend, short(console, info.id, 12), info.run_id, info.episode_id, why)
    console.print(table)
    if run_id is None:  # the side channels' folders belong to a process, not to a run
        folders = G.collect_bulk(dry_run=dry_run)
        console.print(f"{verb} {len(folders)} fork side channel folder(s) of dead processes")
        for path in folders:
            console.print(f"  {path}", markup=False, highlight=False, soft_wrap=True)


@sandbox_app.command("exec")
def sandbox_exec(
    commands: list[str] = typer.Argument(
        ..., help="Shell commands, run one after another in one session."
    ),
    backend: str | None = typer.Option(
        None, "--backend", "-b", help=BACKEND_HELP + " Unset: SANDFLOW_BACKEND, then sandflow.toml's backend."
    ),
    network: str | None = network_option(envvar="SANDFLOW_NETWORK"),
    timeout: float = typer.Option(60.0, "--timeout", help="Per-command timeout in seconds."),
    memory_mb: int = typer.Option(2048, "--memory-mb", help="Memory limit."),
    docker_host: str | None = typer.Option(
        None, "--docker-host", envvar="DOCKER_HOST", help="Engine address (default: local socket)."
    ),
) -> None:
    """Open a fresh sandbox, run COMMANDS in one shell session, print each result, close it.

    Example: sandflow sandbox exec 'cd /tmp && export X=42' 'echo $X from $(pwd)' 'python3 -c "import sympy; print(sympy.__version__)"'
    """
    from rich.panel import Panel
    from rich.text import Text

    from sandbox import SandboxConfig, SandboxError, SandboxLimits, open_sandbox
    from sandflow.config import command_settings

    console = stdout_console()
    settings = command_settings(backend=backend)
    try:
        config = SandboxConfig(
            backend=settings.backend,
            run_id="cli",
            episode_id="exec",
            docker_host=docker_host,
            limits=SandboxLimits(network=network or "none", memory_mb=memory_mb),
        )
    except ValueError as e:
        raise fail(f"bad option: {e}", EXIT_USAGE) from None
    t0 = time.perf_counter()
    try:
        with open_sandbox(config) as sb:
            console.print(
                f"[dim]{config.backend} sandbox ready in {time.perf_counter() - t0:.2f}s[/dim]"
            )
            for cmd in commands:
                r = sb.exec(cmd, timeout=timeout)
                flags = [
                    name
                    for name in ("timed_out", "oom_killed", "truncated", "shell_restarted")
                    if getattr(r, name)
                ]
                body = Text(r.stdout)
                body.append(r.stderr, style="red")
                body.rstrip()
                title = Text(f"$ {cmd}")
                subtitle = f"exit {r.exit_code} · {r.duration_s * 1000:.1f} ms" + (
                    f" · {', '.join(flags)}" if flags else ""
                )
                console.print(
                    Panel(
                        body if body.plain else Text("(no output)", style="dim"),
                        title=title,
                        subtitle=subtitle,
                        expand=fits(console),
                    )
                )
    except SandboxError as e:
        raise fail(f"sandbox error: {e}", EXIT_FAILED) from None


def register(app: typer.Typer) -> None:
    app.add_typer(image_app, name="image")
    app.add_typer(sandbox_app, name="sandbox")
