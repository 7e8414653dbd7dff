"""Every `sandflow` command, one module per command group (see sandflow/cli.py)."""
