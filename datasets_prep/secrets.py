"""Keep API keys out of everything the warehouse writes, and out of tasks.

In the lowest layer (datasets_prep/) because both task validation and the warehouse
use this one definition of "secret".

Settings already excludes its SecretStr fields from dumps; this is the second line of
defence for hand-built config dicts: keys whose *name* says secret are dropped, and the
*values* of the key environment variables (and of every variable whose name says
secret) are masked wherever they appear in config text, so a key pasted into a base URL
or a header is not stored either. `find_secret` names the variable whose value occurs
in a text: task validation (datasets_prep.task) uses it to refuse tasks carrying one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

_SECRET_NAME = re.compile(
    r"(api[_-]?key|secret|password|passwd|authorization|credential|private[_-]?key|bearer"
    r"|access[_-]?token|auth[_-]?token|^token$|[_-]token$|cookie)",
    re.IGNORECASE,
)
# Names that contain "token" but are counts/limits, not credentials.
_SAFE_NAMES = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "reasoning_tokens",
        "total_tokens",
        "max_new_tokens",
        "token_budget",
        "max_context_tokens",
        "context_tokens",
    }
)
SECRET_ENV_VARS = ("SANDFLOW_API_KEY", "OPENAI_API_KEY", "SANDFLOW_JUDGE_API_KEY")
_VALUE_PATTERNS = re.compile(r"(sk-[A-Za-z0-9_\-]{16,}|Bearer\s+[A-Za-z0-9._\-]{12,})")
MASK = "***"


@lru_cache(maxsize=4096)  # env and config names repeat: task validation asks per task
def is_secret_name(name: str) -> bool:
    n = name.lower()
    if n in _SAFE_NAMES or n.endswith("_tokens") or n.endswith("_token_ids"):
        return False
    return bool(_SECRET_NAME.search(n))


def secret_env_values(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Name -> value of each environment variable that holds a secret: the key variables
    sandflow reads, and every variable whose *name* says secret (HF_TOKEN,
    AWS_SECRET_ACCESS_KEY, ...). Short values (flags such as "1" or "true") are left out:
    they would match ordinary text."""
    env = os.environ if environ is None else environ
    found = {v: env[v] for v in SECRET_ENV_VARS if len(env.get(v, "")) >= 6}
    for name, value in env.items():
        if name not in found and len(value) >= 8 and is_secret_name(name):
            found[name] = value
    return found


def find_secret(text: str | bytes, secrets: Mapping[str, str] | None = None) -> str | None:
    """The name of the environment variable whose secret value occurs in `text`, or None.
    (The value itself is never returned, so a message can name the variable safely.)"""
    for name, value in (secret_env_values() if secrets is None else secrets).items():
        if isinstance(text, bytes):
            if value.encode("utf-8", "surrogateescape") in text:
                return name
        elif value in text:
            return name
    return None


def _secret_values() -> list[str]:
    return list(secret_env_values().values())


def mask_text(text: str, values: list[str] | None = None) -> str:
    """Replace known key values and key-shaped strings in `text`."""
    for v in _secret_values() if values is None else values:
        if v in text:
            text = text.replace(v, MASK)
    return _VALUE_PATTERNS.sub(MASK, text)


def scrub(obj: Any, _values: list[str] | None = None) -> Any:
    """A copy of `obj` with secret-named keys dropped and secret values masked."""
    values = _secret_values() if _values is None else _values
    if isinstance(obj, dict):
        return {
            k: scrub(v, values)
            for k, v in obj.items()
            if not (isinstance(k, str) and is_secret_name(k))
        }
    if isinstance(obj, list | tuple):
        return [scrub(v, values) for v in obj]
    if isinstance(obj, str):
        return mask_text(obj, values)
    if hasattr(obj, "get_secret_value"):  # a pydantic SecretStr that slipped through
        return MASK
    return obj
