"""Pure analysis of recorded runs: no Prefect, no Docker, no settings.

Functions of the warehouse's records (warehouse.RunData, tasks.records), rows, arrays
and task sets:

- metrics.py      the paper's figures: accuracy, capability usage rates, tokens and the
                  sandbox/LLM ratio, turns, terminations
- usage_rules.py  which capability a tool call uses (computation, file management,
                  external resources): one table of rules
- scoring.py      a run's answers -> score rows, through datasets_prep's verifiers
- advantages.py   GRPO / RLOO group advantages
- rollouts.py     RL data: verl task rows, chat trajectories with loss masks, token rows
- report.py       the self-contained HTML page and the Markdown summary
- statistics.py   the estimators (intervals, pass@k, paired tests)
- comparisons.py  episode outcomes -> the tables a report shows

flows/ wraps these in Prefect flows; rl/ and the commands may call them directly.
"""
