"""Views over RL data builds (`data_items`, written by warehouse.dataitems; docs/data.md).

    data_funnel      per build and stage: items in, out, dropped, and the drops by reason
                     (in = out + dropped: `consistent`)
    data_dropped     per build, stage and reason: how many, and an example
    task_provenance  per build and task: document, span, generator model, prompt version,
                     calibration run, pass rate, and how far the task got

Each reads the newest batch of every (build, stage): a re-run stage replaces its rows.
A batch's marker row (item_id '') makes a stage that saw nothing show with 0 in; it is
never counted.
"""

from __future__ import annotations

_LATEST = """
    SELECT * FROM _raw_data_items
    QUALIFY batch_id = max(batch_id) OVER (PARTITION BY run_id, stage)
"""

DATA_VIEWS: dict[str, str] = {
    "_data_items_latest": _LATEST,
    "data_dropped": """
        SELECT run_id AS build_id, stage, any_value(stage_order) AS stage_order, reason,
               count(*) AS items, any_value(item_id) AS example_item,
               any_value(detail) AS example_detail
        FROM _data_items_latest WHERE NOT kept
        GROUP BY run_id, stage, reason
        ORDER BY build_id, stage_order, items DESC, reason
    """,
    "data_funnel": """
        WITH r AS (
            SELECT build_id, stage, string_agg(reason || '=' || items, ', '
                       ORDER BY items DESC, reason) AS dropped_by_reason
            FROM data_dropped GROUP BY ALL
        ), s AS (
            SELECT run_id AS build_id, stage, any_value(stage_order) AS stage_order,
                   count(*) FILTER (WHERE item_id <> '') AS items_in,
                   count(*) FILTER (WHERE kept AND item_id <> '') AS items_out,
                   count(*) FILTER (WHERE NOT kept) AS dropped,
                   max(recorded_at) AS recorded_at
            FROM _data_items_latest GROUP BY run_id, stage
        )
        SELECT s.build_id, s.stage, s.items_in, s.items_out, s.dropped,
               coalesce(r.dropped_by_reason, '') AS dropped_by_reason,
               s.items_in = s.items_out + s.dropped AS consistent, s.recorded_at
        FROM s LEFT JOIN r USING (build_id, stage)
        ORDER BY s.build_id, s.stage_order
    """,
    "task_provenance": """
        WITH t AS (
            SELECT * FROM _data_items_latest
            WHERE task_id IS NOT NULL AND stage IN ('synth', 'clean', 'calibrate', 'export')
        )
        SELECT run_id AS build_id, task_id,
               arg_max(stage, stage_order) AS last_stage,
               arg_max(CASE WHEN kept THEN 'kept' ELSE reason END, stage_order) AS status,
               any_value(qa_type) AS qa_type,
               any_value(doc_id) AS doc_id, any_value(piece_id) AS piece_id,
               any_value(source) AS source,
               any_value(span_start) AS span_start, any_value(span_end) AS span_end,
               any_value(generator_model) AS generator_model,
               any_value(prompt_version) AS prompt_version,
               any_value(prompt_tokens) AS prompt_tokens,
               any_value(completion_tokens) AS completion_tokens,
               any_value(calibration_run) AS calibration_run,
               any_value(samples) AS samples, any_value(passes) AS passes,
               any_value(pass_rate) AS pass_rate
        FROM t GROUP BY run_id, task_id
        ORDER BY build_id, task_id
    """,
}

DATA_VIEW_HELP: dict[str, str] = {
    "data_funnel": "RL data builds: per stage, items in / out / dropped and the drops by reason",
    "data_dropped": "RL data builds: per stage and reason, how many items were dropped, an example",
    "task_provenance": "RL data builds: per task, its document and span, generator model, prompt "
    "version, calibration run and pass rate, and the last stage it reached",
}
