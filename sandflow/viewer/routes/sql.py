"""The SQL box: read-only SQL over the warehouse's views, with examples and row links."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from sandflow.viewer.pages import PagesDep, int_param
from warehouse.query import WarehouseError

router = APIRouter()
SQL_ROW_LIMITS = (50, 200, 1000, 5000)

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


def row_links(columns: list[str]) -> bool:
    """Whether SQL result rows can link to their episodes (they name an episode_id)."""
    return "episode_id" in columns


@router.get("/sql", response_class=HTMLResponse)
def sql_page(request: Request, pages: PagesDep) -> HTMLResponse:
    def build() -> dict[str, Any]:
        q = request.query_params
        text = (q.get("q") or "").strip()
        limit = int_param(q.get("limit"), SQL_ROW_LIMITS[1])
        if limit not in SQL_ROW_LIMITS:
            limit = SQL_ROW_LIMITS[1]
        ctx: dict[str, Any] = {
            "q": text, "limit": limit, "limits": SQL_ROW_LIMITS, "result": None,
            "error": None, "examples": SQL_EXAMPLES, "views": pages.lw.views(),
        }  # fmt: skip
        if text:
            try:
                res = pages.lw.user_sql(text, limit=limit)
            except WarehouseError as exc:
                ctx["error"] = str(exc)
            else:
                ctx["result"] = res
                ctx["links"] = row_links(res.columns)
        return ctx

    return pages.page("sql.html.j2", request, build)
