"""`sandflow view`: serve the viewer on 127.0.0.1 (by default) until Ctrl+C."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import typer

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765

VIEW_HELP = """Browse the warehouse in your browser: runs -> episodes -> turns.

Read-only. Every turn shows the model's text and reasoning, each tool call with its
arguments and output (long output folded), timings, tokens and usage labels; each episode
its answer, verdict, verifier reason and termination. Filter episodes by domain, mode,
termination, score and usage; open two episodes side by side (the same task in two runs,
or both modes of one run); compare two runs task by task; run SQL whose rows link to
their episodes. A run that is recording updates live.

[bold]Examples[/bold]

  sandflow view                                  # http://127.0.0.1:8765
  sandflow view --warehouse /data/wh --port 9000
  sandflow view --host 0.0.0.0 --allow-host gpu-box.lan   # reachable from other machines

The report's tables (report.html) link into it: `sandflow flows report -r RUN --viewer-url URL`.
"""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def register(app: typer.Typer) -> None:
    @app.command("view", help=VIEW_HELP, rich_help_panel="Results")
    def view(
        warehouse: Path | None = typer.Option(
            None, "--warehouse", "-w",
            help="Warehouse root. Default: SANDFLOW_WAREHOUSE, sandflow.toml, ./warehouse_data.",
        ),
        host: str = typer.Option(
            DEFAULT_HOST, "--host", help="Address to listen on. Anything but loopback exposes every trajectory, unauthenticated.",
        ),
        port: int = typer.Option(DEFAULT_PORT, "--port", "-p", min=0, max=65535, help="Port (0: any free one)."),
        allow_host: list[str] = typer.Option(
            [], "--allow-host",
            help="Host names the browser may use besides loopback ones (repeatable; '*' for any). "
            "Needed with --host: requests naming another host are refused.",
        ),
        sql_timeout: float = typer.Option(15.0, "--sql-timeout", min=0.1, help="Seconds a SQL box query may run."),
        refresh: float = typer.Option(
            2.0, "--refresh", min=0.2, help="Seconds between checks for new data (live runs)."
        ),
    ) -> None:  # fmt: skip
        import socket

        from sandflow.config import load_settings
        from sandflow.console import console, err_console
        from warehouse.query import WarehouseError

        err = err_console()
        root = Path(load_settings(warehouse=warehouse).warehouse)
        from sandflow.viewer.store import LiveWarehouse

        lw = LiveWarehouse(root, refresh_s=refresh, sql_timeout_s=sql_timeout)
        with err.status(f"reading {root} ..."):
            try:
                lw.open()
            except (WarehouseError, ValueError, OSError) as exc:
                err.print(f"[red]error:[/red] {exc}")
                raise typer.Exit(1) from None
        allowed = ["127.0.0.1", "localhost", "::1", "[::1]", *allow_host]
        if not _is_loopback(host):
            if not allow_host:
                allowed.append(host)
                if host in ("0.0.0.0", "::"):
                    err.print(
                        "[yellow]note:[/yellow] requests must name this machine as the browser "
                        "sees it: pass --allow-host NAME (the host name or address in the URL), "
                        "or --allow-host '*'."
                    )
            err.print(
                f"[yellow]warning:[/yellow] listening on {host}: anyone who can reach it can read "
                "every trajectory in this warehouse (the viewer has no login)."
            )
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            err.print(f"[red]error:[/red] cannot listen on {host}:{port}: {exc.strerror or exc}"
                      + (" (another `sandflow view`? try --port 0)" if exc.errno == 98 else ""))  # fmt: skip
            lw.close()
            raise typer.Exit(1) from None
        bound = sock.getsockname()[1]
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        info = lw.info
        console().print(
            f"sandflow view: [bold cyan]http://{shown}:{bound}/[/]  "
            f"(warehouse {root}, read in {info.build_s:.1f} s; Ctrl+C stops)"
        )
        for b in info.bad_files[:5]:
            err.print(f"[yellow]bad file left out:[/yellow] {b}")
        serve(lw, sock, allowed_hosts=["*"] if "*" in allowed else allowed)


def serve(lw: object, sock: object, *, allowed_hosts: list[str]) -> None:
    """Run the app on an already bound socket until interrupted; closes the snapshot."""
    import uvicorn

    from sandflow.viewer.app import create_app
    from sandflow.viewer.store import LiveWarehouse

    assert isinstance(lw, LiveWarehouse)
    app = create_app(lw, allowed_hosts=allowed_hosts)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])  # type: ignore[list-item]
    finally:
        lw.close()
