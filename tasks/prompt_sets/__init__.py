"""Named prompt sets (tasks/prompts.py, PROMPT_SETS): one folder each."""
