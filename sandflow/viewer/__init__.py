"""`sandflow view`: a local, read-only web app over the warehouse.

Runs -> episodes -> turns in the browser: every turn's text, reasoning, tool calls and
observations, with the episode's answer, verdict and termination; filters, two episodes
side by side, two runs compared task by task, a SQL box whose rows link to their
episodes, and live updates while a run records. User guide: docs/viewer.md.

    store.py     the snapshot of the warehouse the pages read (refreshed when it changes)
    readonly.py  what keeps the SQL box from reading or writing anything else
    data.py      each page's SQL (paginated: no page loads all turns)
    present.py   rows -> what a page shows (parsed tool calls, folded outputs)
    app.py       the FastAPI routes, templates/ and static/
    cli.py       the `sandflow view` command
"""
