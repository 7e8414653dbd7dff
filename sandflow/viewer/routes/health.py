"""Health and housekeeping: /healthz (the snapshot's state, for scripts), /favicon.ico."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from sandflow.viewer.pages import PagesDep

router = APIRouter()


@router.get("/favicon.ico", include_in_schema=False)
def favicon() -> Response:
    return Response(status_code=204)


@router.get("/healthz")
def healthz(pages: PagesDep) -> JSONResponse:
    pages.lw.touch()
    i = pages.lw.info
    return JSONResponse(
        {
            "ok": True,
            "warehouse": str(pages.lw.root),
            "snapshot_version": i.version,
            "snapshot_build_s": round(i.build_s, 3),
            "bad_files": len(i.bad_files),
        }  # fmt: skip
    )
