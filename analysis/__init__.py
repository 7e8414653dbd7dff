"""Pure analysis: functions of records, rows and arrays, no Prefect, no settings.

`statistics` holds the estimators (intervals, pass@k, paired tests); `comparisons`
turns episode outcomes into the tables a report shows; `nightly_report` renders the
"Changes since the previous run" section and the trend plots.
"""
