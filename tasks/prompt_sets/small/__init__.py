"""The `small` prompt set: short prompts with submit(answer), for small policies."""
