"""The viewer's web app: runs -> episodes -> turns, comparisons, a SQL box, live updates.

Pages are rendered on the server with Jinja2 (autoescaping on for every template: what the
model wrote is text, never markup) and served with a Content-Security-Policy that allows
only this server's own script and styles, so even a slip in escaping could not run a
script. The one script (static/viewer.js) polls server-rendered fragments for live runs
and never builds HTML from data. Requests for other host names are refused (a web page
elsewhere cannot reach the viewer through DNS rebinding). Nothing here writes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.middleware.trustedhost import TrustedHostMiddleware

from sandflow.viewer import data, present
from sandflow.viewer.store import LiveWarehouse
from warehouse.layout import check_episode_id
from warehouse.query import WarehouseError
from warehouse.schema import check_run_id

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
SQL_ROW_LIMITS = (50, 200, 1000, 5000)
LIVE_POLL_MS = 2000

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

SQL_EXAMPLES = [
    ("Accuracy by domain and mode", "SELECT * FROM accuracy"),
    (
        "Episodes that timed out a command",
        "SELECT DISTINCT t.run_id, t.episode_id, e.task_id, t.turn_index, t.command\n"
        "FROM timeouts t JOIN episodes e USING (run_id, episode_id)",
    ),
    (
        "Longest episodes",
        "SELECT run_id, episode_id, task_id, domain, mode, turns, total_tokens\n"
        "FROM episode_tokens ORDER BY total_tokens DESC LIMIT 20",
    ),
    (
        "Failed commands",
        "SELECT run_id, episode_id, turn_index, tool, command, exit_code\n"
        "FROM tool_calls WHERE exit_code <> 0 LIMIT 100",
    ),
    (
        "Turns mentioning pip install",
        "SELECT run_id, episode_id, turn_index, left(assistant_content, 120) AS said\n"
        "FROM tool_calls JOIN turns USING (run_id, episode_id, turn_index)\n"
        "WHERE command LIKE '%pip install%' LIMIT 50",
    ),
]


def _env() -> Environment:
    env = Environment(
        loader=FileSystemLoader(str(HERE / "templates")),
        autoescape=True,  # every template, whatever its name
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        num=present.num,
        seconds=present.seconds,
        when=present.when,
        short=present.short,
        score_class=present.score_class,
        pretty_json=present.pretty_json,
        fold=present.fold,
        cell=present.cell,
    )
    return env


class PageError(Exception):
    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status, self.title, self.message = status, title, message


def _run_id(run_id: str) -> str:
    try:
        return check_run_id(run_id)
    except ValueError as exc:
        raise PageError(404, "No such run", str(exc)) from None


def _episode_id(episode_id: str) -> str:
    try:
        return check_episode_id(episode_id)
    except ValueError as exc:
        raise PageError(404, "No such episode", str(exc)) from None


def _int(v: str | None, default: int = 0, lo: int = 0, hi: int = 10**9) -> int:
    try:
        return max(lo, min(hi, int(v))) if v not in (None, "") else default
    except (TypeError, ValueError):
        return default


def _episode_ref(ref: str | None) -> tuple[str, str] | None:
    """'RUN/EPISODE' -> (run, episode), validated; None if absent or malformed."""
    if not ref or "/" not in ref:
        return None
    run, _, ep = ref.partition("/")
    try:
        return check_run_id(run), check_episode_id(ep)
    except ValueError:
        return None


def create_app(lw: LiveWarehouse, *, allowed_hosts: list[str] | None = None) -> FastAPI:
    """The viewer over `lw` (opened by the caller). `allowed_hosts`: Host header values
    accepted (default: the loopback names); ["*"] accepts any."""
    app = FastAPI(title="sandflow view", docs_url=None, redoc_url=None, openapi_url=None)
    env = _env()
    env.globals.update(episode_href=episode_href, qs=_qs)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    app.add_middleware(
        TrustedHostMiddleware,
        allowed_hosts=allowed_hosts or ["127.0.0.1", "localhost", "::1", "[::1]"],
    )

    @app.middleware("http")
    async def _headers(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        for k, v in SECURITY_HEADERS.items():
            response.headers.setdefault(k, v)
        return response

    def render(name: str, request: Request, status: int = 200, **ctx: Any) -> HTMLResponse:
        base = {
            "request_path": request.url.path,
            "warehouse": str(lw.root),
            "snapshot": lw.info,
            "snapshot_age": max(0.0, time.time() - lw.info.built_at) if lw.info.built_at else None,
            "poll_ms": LIVE_POLL_MS,
        }
        base.update(ctx)
        return HTMLResponse(env.get_template(name).render(**base), status_code=status)

    def page(name: str, request: Request, build: Any) -> HTMLResponse:
        """Render `name` with the context `build()` returns; errors become a clear page."""
        try:
            lw.touch()
            return render(name, request, **build())
        except PageError as exc:
            return render(
                "error.html.j2", request, exc.status, title=exc.title, message=exc.message
            )
        except WarehouseError as exc:
            return render("error.html.j2", request, 500, title="Warehouse error", message=str(exc))

    @app.get("/", response_class=HTMLResponse)
    def runs_page(request: Request) -> HTMLResponse:
        def build() -> dict[str, Any]:
            p = _int(request.query_params.get("page"), 0)
            rows, total = data.runs(
                lw, limit=data.EPISODES_PER_PAGE, offset=p * data.EPISODES_PER_PAGE
            )
            return {"runs": rows, "total": total, "page": p, "per_page": data.EPISODES_PER_PAGE}

        return page("runs.html.j2", request, build)

    def _run_context(request: Request, run_id: str) -> dict[str, Any]:
        run_id = _run_id(run_id)
        info = data.run_info(lw, run_id)
        if info is None:
            raise PageError(404, "No such run", f"run {run_id!r} has no records in {lw.root}")
        q = dict(request.query_params)
        flt = data.EpisodeFilter.from_query(q)
        p = _int(q.get("page"), 0)
        rows, total = data.episodes(lw, run_id, flt, p)
        return {
            "run": info,
            "run_id": run_id,
            "flt": flt,
            "filters": flt.as_query(),
            "episodes": rows,
            "total": total,
            "page": p,
            "per_page": data.EPISODES_PER_PAGE,
            "live": data.live_episodes(lw, run_id) if info["live"] else [],
        }

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    def run_page(request: Request, run_id: str) -> HTMLResponse:
        def build() -> dict[str, Any]:
            ctx = _run_context(request, run_id)
            ctx["accuracy"] = data.run_accuracy(lw, ctx["run_id"])
            ctx["options"] = data.filter_options(lw, ctx["run_id"])
            ctx["score_filters"] = list(data.SCORE_FILTERS)
            ctx["capabilities"] = list(data.CAPABILITY_FILTERS)
            ctx["sorts"] = list(data.SORTS)
            return ctx

        return page("run.html.j2", request, build)

    @app.get("/runs/{run_id}/live", response_class=HTMLResponse)
    def run_live(request: Request, run_id: str) -> HTMLResponse:
        return page("_run_live.html.j2", request, lambda: _run_context(request, run_id))

    def _episode_context(run_id: str, episode_id: str, start: int) -> dict[str, Any]:
        run_id, episode_id = _run_id(run_id), _episode_id(episode_id)
        ep = data.episode(lw, run_id, episode_id)
        partial = None
        if ep is None:
            partial = data.partial_episode(lw, run_id, episode_id)
            if partial is None:
                raise PageError(
                    404, "No such episode", f"episode {episode_id!r} is not in run {run_id!r}"
                )
        else:
            live_copy = data.partial_episode(lw, run_id, episode_id)
            if live_copy is not None and live_copy.get("journal_state") == "live":
                partial = live_copy  # being re-recorded right now (a resume)
        n = data.TURNS_PER_PAGE
        from_journal = ep is None
        rows = data.turns(
            lw, run_id, episode_id, start, n,
            write_id=ep["write_id"] if ep else None, partial=from_journal,
        )  # fmt: skip
        last = start + n - 1
        labels = data.usage_labels(lw, run_id, episode_id, start, last) if ep else {}
        total_turns = int((ep or partial or {}).get("num_turns") or 0)
        return {
            "run_id": run_id,
            "episode_id": episode_id,
            "ep": ep,
            "partial": partial,
            "from_journal": from_journal,
            "live": bool(partial and partial.get("journal_state") == "live"),
            "turns": [present.turn_view(r, labels) for r in rows],
            "start": start,
            "per_page": n,
            "total_turns": total_turns,
            "scores": data.scores(lw, run_id, episode_id) if ep else [],
            "prompt": present.prompt_messages(ep.get("prompt_messages")) if ep else [],
            # its turns file, when the snapshot left it out as bad (named, not "no turns")
            "bad_turns_file": next(
                (b for b in lw.info.bad_files if f"/run_id={run_id}/{episode_id}." in b), None
            ),
        }

    @app.get("/runs/{run_id}/episodes/{episode_id}", response_class=HTMLResponse)
    def episode_page(request: Request, run_id: str, episode_id: str) -> HTMLResponse:
        def build() -> dict[str, Any]:
            ctx = _episode_context(run_id, episode_id, _int(request.query_params.get("start"), 0))
            task = (ctx["ep"] or ctx["partial"] or {}).get("task_id")
            ctx["others"] = (
                data.same_task(lw, task, ctx["run_id"], ctx["episode_id"]) if task else []
            )
            return ctx

        return page("episode.html.j2", request, build)

    @app.get("/runs/{run_id}/episodes/{episode_id}/live", response_class=HTMLResponse)
    def episode_live(request: Request, run_id: str, episode_id: str) -> HTMLResponse:
        return page(
            "_episode_live.html.j2",
            request,
            lambda: _episode_context(
                run_id, episode_id, _int(request.query_params.get("start"), 0)
            ),
        )

    @app.get("/episode/{episode_id}")
    def find_episode(request: Request, episode_id: str) -> Response:
        def build() -> dict[str, Any]:
            eid = _episode_id(episode_id)
            run = data.find_episode(lw, eid)
            if run is None:
                raise PageError(404, "No such episode", f"no run has an episode {eid!r}")
            return {"run": run, "eid": eid}

        try:
            lw.touch()
            found = build()
        except PageError as exc:
            return render(
                "error.html.j2", request, exc.status, title=exc.title, message=exc.message
            )
        turn = request.query_params.get("turn")
        url = f"/runs/{found['run']}/episodes/{found['eid']}"
        if turn is not None and turn.isdigit():
            t = int(turn)
            start = (t // data.TURNS_PER_PAGE) * data.TURNS_PER_PAGE
            url += (f"?start={start}" if start else "") + f"#turn-{t}"
        return RedirectResponse(url, status_code=303)

    @app.get("/compare", response_class=HTMLResponse)
    def compare(request: Request) -> HTMLResponse:
        def build() -> dict[str, Any]:
            q = request.query_params
            a, b = _episode_ref(q.get("a")), _episode_ref(q.get("b"))
            if a is None or b is None:
                raise PageError(
                    400,
                    "Two episodes needed",
                    "open a comparison from an episode page, or give ?a=RUN/EPISODE&b=RUN/EPISODE",
                )
            start = _int(q.get("start"), 0)
            sides = [_episode_context(r, e, start) for r, e in (a, b)]
            n = max(len(s["turns"]) for s in sides)
            rows = []
            for i in range(n):
                rows.append([s["turns"][i] if i < len(s["turns"]) else None for s in sides])
            total = max(s["total_turns"] for s in sides)
            return {"sides": sides, "rows": rows, "start": start, "per_page": data.TURNS_PER_PAGE,
                    "total_turns": total, "a": q.get("a"), "b": q.get("b")}  # fmt: skip

        return page("compare.html.j2", request, build)

    @app.get("/compare-runs", response_class=HTMLResponse)
    def compare_runs(request: Request) -> HTMLResponse:
        def build() -> dict[str, Any]:
            q = request.query_params
            all_runs, _ = data.runs(lw, limit=500)
            ctx: dict[str, Any] = {"all_runs": all_runs, "pairs": None, "stats": {}}
            a, b = q.get("a") or "", q.get("b") or ""
            a_mode, b_mode = q.get("a_mode") or None, q.get("b_mode") or None
            only = q.get("only") if q.get("only") in ("differ", "a_better", "b_better") else None
            p = _int(q.get("page"), 0)
            ctx.update(a=a, b=b, a_mode=a_mode or "", b_mode=b_mode or "", only=only or "", page=p,
                       per_page=data.EPISODES_PER_PAGE)  # fmt: skip
            if a and b:
                _run_id(a)
                _run_id(b)
                pairs, stats = data.compare_runs(
                    lw, a, b, a_mode=a_mode, b_mode=b_mode, only=only, page=p
                )
                ctx.update(pairs=pairs, stats=stats)
            return ctx

        return page("compare_runs.html.j2", request, build)

    @app.get("/sql", response_class=HTMLResponse)
    def sql_page(request: Request) -> HTMLResponse:
        def build() -> dict[str, Any]:
            q = request.query_params
            text = (q.get("q") or "").strip()
            limit = _int(q.get("limit"), SQL_ROW_LIMITS[1])
            if limit not in SQL_ROW_LIMITS:
                limit = SQL_ROW_LIMITS[1]
            ctx: dict[str, Any] = {
                "q": text, "limit": limit, "limits": SQL_ROW_LIMITS, "result": None,
                "error": None, "examples": SQL_EXAMPLES, "views": lw.views(),
            }  # fmt: skip
            if text:
                try:
                    res = lw.user_sql(text, limit=limit)
                except WarehouseError as exc:
                    ctx["error"] = str(exc)
                else:
                    ctx["result"] = res
                    ctx["links"] = _row_links(res.columns)
            return ctx

        return page("sql.html.j2", request, build)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        lw.touch()
        i = lw.info
        return JSONResponse(
            {
                "ok": True,
                "warehouse": str(lw.root),
                "snapshot_version": i.version,
                "snapshot_build_s": round(i.build_s, 3),
                "bad_files": len(i.bad_files),
            }  # fmt: skip
        )

    return app


def _row_links(columns: list[str]) -> bool:
    """Whether SQL result rows can link to their episodes (they name an episode_id)."""
    return "episode_id" in columns


def episode_href(row: dict[str, Any]) -> str | None:
    """The viewer URL of a SQL result row's episode (and turn), if it names one."""
    eid = row.get("episode_id")
    if not isinstance(eid, str):
        return None
    try:
        check_episode_id(eid)
    except ValueError:
        return None
    run = row.get("run_id")
    turn = row.get("turn_index")
    if isinstance(run, str):
        try:
            check_run_id(run)
        except ValueError:
            run = None
    if isinstance(run, str):
        url = f"/runs/{run}/episodes/{eid}"
        if isinstance(turn, int) and turn >= 0:
            start = (turn // data.TURNS_PER_PAGE) * data.TURNS_PER_PAGE
            url += (f"?start={start}" if start else "") + f"#turn-{turn}"
        return url
    return f"/episode/{eid}" + (f"?turn={turn}" if isinstance(turn, int) and turn >= 0 else "")


def _qs(base: dict[str, Any] | None = None, **changes: Any) -> str:
    """A query string from `base` with `changes` applied (None drops a key)."""
    out = {k: v for k, v in (base or {}).items() if v not in (None, "")}
    for k, v in changes.items():
        if v in (None, "", False):
            out.pop(k, None)
        else:
            out[k] = v
    return ("?" + urlencode(out)) if out else ""
