"""The viewer's pages, one router per page group (create_app includes them all):

    runs.py      /, /runs/{run}, /runs/{run}/live            runs and a run's episodes
    episodes.py  /runs/{run}/episodes/{ep}[/live], /episode/{ep}   one episode's turns
    compare.py   /compare (two episodes), /compare-runs (two runs, task by task)
    tree.py      /tree?ep=RUN/EPISODE                          a parent and its branches side by side
    training.py  /training, /training/{run}                  training runs: the curve and the steps
    sql.py       /sql                                         the read-only SQL box
    health.py    /healthz, /favicon.ico

Each handler gets the app's `Pages` (sandflow/viewer/pages.py) as a dependency. Adding a
page: a handler in the router of its group (or a new router listed in ROUTERS).
"""

from __future__ import annotations

from sandflow.viewer.routes import compare, episodes, health, runs, sql, training, tree

ROUTERS = (runs.router, episodes.router, compare.router, tree.router, training.router, sql.router,
           health.router)
