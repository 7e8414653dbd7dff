"""What every page of the viewer shares: templates, rendering, errors as pages, and the
request parameters every router checks the same way.

Why a module of its own: the routers (sandflow/viewer/routes/) are small and one per
page group; they get a `Pages` (one per app, on ``app.state``) through FastAPI's
dependency injection (`PagesDep`) instead of closing over `create_app`'s locals.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from sandflow.viewer import data, present
from sandflow.viewer.store import LiveWarehouse
from warehouse.layout import check_episode_id
from warehouse.query import WarehouseError
from warehouse.schema import check_run_id

HERE = Path(__file__).resolve().parent
LIVE_POLL_MS = 2000


class PageError(Exception):
    """A request the viewer answers with an error page (status, title, one sentence)."""

    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status, self.title, self.message = status, title, message


# ---- parameters ------------------------------------------------------------------------
def run_id_param(run_id: str) -> str:
    try:
        return check_run_id(run_id)
    except ValueError as exc:
        raise PageError(404, "No such run", str(exc)) from None


def episode_id_param(episode_id: str) -> str:
    try:
        return check_episode_id(episode_id)
    except ValueError as exc:
        raise PageError(404, "No such episode", str(exc)) from None


def int_param(v: str | None, default: int = 0, lo: int = 0, hi: int = 10**9) -> int:
    try:
        return max(lo, min(hi, int(v))) if v not in (None, "") else default
    except (TypeError, ValueError):
        return default


def episode_ref(ref: str | None) -> tuple[str, str] | None:
    """'RUN/EPISODE' -> (run, episode), validated; None if absent or malformed."""
    if not ref or "/" not in ref:
        return None
    run, _, ep = ref.partition("/")
    try:
        return check_run_id(run), check_episode_id(ep)
    except ValueError:
        return None


# ---- links (template globals) ----------------------------------------------------------
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


def qs(base: dict[str, Any] | None = None, **changes: Any) -> str:
    """A query string from `base` with `changes` applied (None drops a key)."""
    out = {k: v for k, v in (base or {}).items() if v not in (None, "")}
    for k, v in changes.items():
        if v in (None, "", False):
            out.pop(k, None)
        else:
            out[k] = v
    return ("?" + urlencode(out)) if out else ""


def template_env() -> Environment:
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
        usd=present.usd,
        when=present.when,
        short=present.short,
        score_class=present.score_class,
        pretty_json=present.pretty_json,
        fold=present.fold,
        cell=present.cell,
    )
    env.globals.update(episode_href=episode_href, qs=qs)
    return env


# ---- rendering -------------------------------------------------------------------------
class Pages:
    """The warehouse being viewed and the templates: renders pages and their contexts."""

    def __init__(self, lw: LiveWarehouse) -> None:
        self.lw = lw
        self.env = template_env()

    def render(self, name: str, request: Request, status: int = 200, **ctx: Any) -> HTMLResponse:
        lw = self.lw
        base = {
            "request_path": request.url.path,
            "warehouse": str(lw.root),
            "snapshot": lw.info,
            "snapshot_age": max(0.0, time.time() - lw.info.built_at) if lw.info.built_at else None,
            "poll_ms": LIVE_POLL_MS,
        }
        base.update(ctx)
        return HTMLResponse(self.env.get_template(name).render(**base), status_code=status)

    def error(self, request: Request, exc: PageError) -> HTMLResponse:
        return self.render(
            "error.html.j2", request, exc.status, title=exc.title, message=exc.message
        )

    def page(self, name: str, request: Request, build: Any) -> HTMLResponse:
        """Render `name` with the context `build()` returns; errors become a clear page."""
        try:
            self.lw.touch()
            return self.render(name, request, **build())
        except PageError as exc:
            return self.error(request, exc)
        except WarehouseError as exc:
            return self.render(
                "error.html.j2", request, 500, title="Warehouse error", message=str(exc)
            )

    # ---- contexts shared by several pages ----------------------------------------------
    def run_context(self, request: Request, run_id: str) -> dict[str, Any]:
        lw = self.lw
        run_id = run_id_param(run_id)
        info = data.run_info(lw, run_id)
        if info is None:
            raise PageError(404, "No such run", f"run {run_id!r} has no records in {lw.root}")
        q = dict(request.query_params)
        flt = data.EpisodeFilter.from_query(q)
        p = int_param(q.get("page"), 0)
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

    def episode_context(self, run_id: str, episode_id: str, start: int) -> dict[str, Any]:
        lw = self.lw
        run_id, episode_id = run_id_param(run_id), episode_id_param(episode_id)
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
                (b for b in lw.info.bad_files if f"/run_id={run_id}/{episode_id}." in b.path),
                None,
            ),
        }


def get_pages(request: Request) -> Pages:
    pages: Pages = request.app.state.pages
    return pages


PagesDep = Annotated[Pages, Depends(get_pages)]
