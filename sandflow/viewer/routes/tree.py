"""A tree's branches side by side (issue #25): a parent episode and the episodes forked or
replayed from it, one column each, from the earliest branch turn on. A child's turns
before its own branch turn are the parent's (shared) and shown as such, not repeated."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from sandflow.viewer import data
from sandflow.viewer.pages import PageError, PagesDep, episode_ref, int_param

router = APIRouter()


@router.get("/tree", response_class=HTMLResponse)
def tree(request: Request, pages: PagesDep) -> HTMLResponse:
    def build() -> dict[str, Any]:
        q = request.query_params
        ref = episode_ref(q.get("ep"))
        if ref is None:
            raise PageError(400, "An episode needed", "give ?ep=RUN/EPISODE (a parent or one of its branches)")
        lw = pages.lw
        node = data.tree_node(lw, *ref)
        if node is None:
            raise PageError(404, "No such episode", f"episode {ref[1]!r} is not in run {ref[0]!r}")
        if not node["children"] and node["parent_episode_id"] is not None:
            parent = data.tree_node(lw, node["parent_run_id"], node["parent_episode_id"])
            node = parent or node  # a branch: show its parent and its siblings
        kids = data.branches(lw, node["run_id"], node["episode_id"])
        if not kids:
            raise PageError(404, "No branches", f"episode {node['episode_id']!r} was never forked or replayed")
        more = len(kids) > data.MAX_BRANCHES
        kids = kids[: data.MAX_BRANCHES]
        first = min(int(k["branch_turn"] or 0) for k in kids)
        start = max(int_param(q.get("start"), first), 0)
        sides = []
        for n in (node, *kids):
            ctx = pages.episode_context(n["run_id"], n["episode_id"], start)
            ctx["node"] = n
            ctx["by_index"] = {t.index: t for t in ctx["turns"]}
            sides.append(ctx)
        total = max(s["total_turns"] for s in sides)
        indexes = range(start, min(start + data.TURNS_PER_PAGE, total))
        rows = [
            [(i, s["by_index"].get(i), i < int(s["node"]["branch_turn"] or 0)) for s in sides]
            for i in indexes
        ]
        return {"sides": sides, "rows": rows, "start": start, "first": first, "more": more,
                "per_page": data.TURNS_PER_PAGE, "total_turns": total,
                "ep": f"{node['run_id']}/{node['episode_id']}"}  # fmt: skip

    return pages.page("tree.html.j2", request, build)
