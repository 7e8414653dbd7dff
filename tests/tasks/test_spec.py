"""RunSpec (tasks/spec.py): one run description made of parts, one builder, old flat specs
still load, every default in one home."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from tasks.spec import (
    FLAT_NAMES,
    Endpoint,
    RunSpec,
    Sampling,
    SandboxSpec,
    build_run_spec,
)

# A spec as the flat RunSpec (45 fields in one model) dumped it: what past Prefect flow
# runs stored as their `spec` parameter.
OLD_FLAT: dict[str, Any] = {
    "task_set": "tasks.jsonl", "mode": "sandbox", "samples": 3, "run_id": "r-1",
    "model": "qwen", "base_url": "http://gpu:8000/v1", "temperature": 0.2, "max_tokens": 512,
    "request_timeout_s": None, "model_retry_window_s": 30.0, "extra_body": {"top_k": 20},
    "logprobs": True, "return_token_ids": True, "max_steps": 12, "wall_clock_s": 600.0,
    "exec_timeout_s": 20.0, "context_tokens": 8192, "max_tool_calls_per_turn": None,
    "max_observation_bytes_per_turn": 4096, "prompt_dir": "/p", "backend": "bwrap",
    "image": "python:3.12-slim", "network": "none", "sandbox_reuse": "pool",
    "sandbox_runtime": None, "sandbox_host": {"netns_reuse": False}, "warehouse": "/wh",
    "concurrency": 6, "max_sandboxes": 3, "max_model_calls": 2, "retries": 1,
    "durability": "sync", "compact": False, "wait_for_lock": 5.0,
    "prices": {"qwen": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
    "max_cost_usd": 3.5, "max_run_tokens": 100000, "series": "nightly",
}  # fmt: skip


def test_an_old_flat_spec_loads_into_its_parts_with_every_value_in_place() -> None:
    spec = RunSpec.model_validate(OLD_FLAT)
    assert (spec.task_set, spec.mode, spec.samples, spec.run_id, spec.prompt_dir) == (
        "tasks.jsonl", "sandbox", 3, "r-1", "/p",
    )  # fmt: skip
    for name, value in OLD_FLAT.items():
        if name not in FLAT_NAMES:
            continue
        part, field = FLAT_NAMES[name]
        got = getattr(getattr(spec, part), field)
        assert got == (120.0 if name == "request_timeout_s" else value), name  # None there: 120 s
    assert spec.sandbox.reuse == "pool" and spec.sandbox.host == {"netns_reuse": False}
    assert spec.endpoint.retry_window_s == 30.0
    # and as JSON text (a Prefect parameter read back), and through the builder: the same run
    assert RunSpec.model_validate_json(json.dumps(OLD_FLAT)) == spec
    assert build_run_spec(OLD_FLAT) == spec
    # the configs the loop takes are what the flat spec gave
    cfg = spec.to_model_config(with_key=False)
    assert (cfg.model, cfg.temperature, cfg.max_tokens, cfg.request_timeout_s, cfg.retry_window_s) == (
        "qwen", 0.2, 512, 120.0, 30.0,
    )  # fmt: skip
    assert cfg.extra_body == {"top_k": 20} and cfg.logprobs and cfg.return_token_ids
    limits = spec.to_limits()
    assert (limits.max_steps, limits.wall_clock_s, limits.exec_timeout_s, limits.context_tokens) == (12, 600.0, 20.0, 8192)
    assert (limits.max_observation_bytes_per_turn, limits.max_tool_calls_per_turn) == (4096, 32)  # None: the loop's
    box = spec.to_sandbox_config()
    assert (box.backend, box.image, box.reuse, box.run_id) == ("bwrap", "python:3.12-slim", "pool", "r-1")


def test_the_parts_travel_as_json_and_come_back_equal() -> None:
    spec = build_run_spec(OLD_FLAT)
    text = json.dumps(spec.public_dict())  # JSON-safe: Prefect stores it, Dask moves it
    back = RunSpec.model_validate_json(text)
    assert back == spec
    assert set(json.loads(text)) == {
        "task_set", "mode", "samples", "run_id", "prompt_dir",
        "endpoint", "sampling", "limits", "sandbox", "recording", "fanout", "budget",
    }  # fmt: skip


@pytest.mark.parametrize(
    "given, named",
    [
        ({"temprature": 0.3}, "temprature"),  # a misspelt flat name
        ({"sampling": {"temprature": 0.3}}, "temprature"),  # ... inside its part
        ({"endpoint": {"request_timeout_s": 0}}, "request_timeout_s"),
        ({"network": "allowlist:"}, "network"),
        ({"sandbox_reuse": "warm"}, "reuse"),
    ],
)
def test_a_bad_value_or_an_unknown_name_is_refused_naming_it(given: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError) as err:
        build_run_spec(given).to_sandbox_config()
    assert named in str(err.value)


def test_the_builder_takes_values_then_flags_and_none_is_not_given() -> None:
    settled = {"model": "m", "temperature": 0.1, "backend": "bwrap", "sandbox_reuse": None, "image": None}
    spec = build_run_spec(settled, temperature=None, max_tokens=64, concurrency=None)
    assert (spec.endpoint.model, spec.sampling.temperature, spec.sampling.max_tokens) == ("m", 0.1, 64)
    assert (spec.sandbox.backend, spec.sandbox.reuse, spec.fanout.concurrency) == ("bwrap", "fresh", 4)
    assert build_run_spec(settled, temperature=0.9).sampling.temperature == 0.9  # a flag wins
    # a part given whole, a flat name over it
    whole = build_run_spec(sampling=Sampling(temperature=0.5, max_tokens=99), max_tokens=7)
    assert (whole.sampling.temperature, whole.sampling.max_tokens) == (0.5, 7)


def test_replace_checks_the_change_and_none_is_a_value_there() -> None:
    spec = build_run_spec(max_cost_usd=2.0, series="s", max_steps=5)
    cut = spec.replace(max_cost_usd=None, max_steps=9)
    assert (cut.budget.max_cost_usd, cut.limits.max_steps, cut.recording.series) == (None, 9, "s")
    assert spec.budget.max_cost_usd == 2.0  # the original is untouched
    with pytest.raises(ValidationError, match="max_steps"):
        spec.replace(max_steps=0)
    # pydantic's model_copy would set a flat name beside its part, read by nobody: refused
    with pytest.raises(TypeError, match=r"max_cost_usd not a field of the spec; use \.replace\(\)"):
        spec.model_copy(update={"max_cost_usd": 1.0})
    assert spec.model_copy(update={"run_id": "r"}).run_id == "r"


def test_every_default_of_a_run_has_one_home() -> None:
    """The parts' defaults are tasks/defaults.py's (and sandbox.base's backend); the
    settings, the loop's ModelConfig and a SandboxConfig take the same ones."""
    from sandbox.base import DEFAULT_BACKEND, SandboxConfig
    from sandflow.config import Settings
    from tasks.defaults import DEFAULT_MAX_TOKENS, DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_TEMPERATURE
    from tasks.model import ModelConfig

    field = {name: f.default for name, f in Settings.model_fields.items()}
    spec = RunSpec()
    model = ModelConfig()
    assert spec.sampling.temperature == model.temperature == field["temperature"] == DEFAULT_TEMPERATURE
    assert spec.sampling.max_tokens == model.max_tokens == field["max_tokens"] == DEFAULT_MAX_TOKENS
    assert spec.endpoint.request_timeout_s == model.request_timeout_s == field["request_timeout_s"] == DEFAULT_REQUEST_TIMEOUT_S
    assert spec.sandbox.backend == SandboxConfig().backend == field["backend"] == DEFAULT_BACKEND
    assert spec.to_model_config(with_key=False) == model  # no run parameter: the loop's own config


def test_the_rollout_requests_endpoint_and_sampling_are_the_runs_parts_with_rl_defaults() -> None:
    """The request reads as it always has (`extra`, keys it does not know ignored), its
    defaults differ on purpose (tasks/defaults.py says why), its run record keeps `extra`."""
    from rl.batch import Endpoint as RequestEndpoint
    from rl.batch import RolloutRequest
    from rl.batch import Sampling as RequestSampling
    from tasks.defaults import RL_REQUEST_TIMEOUT_S, RL_TEMPERATURE
    from tasks.spec import model_config_of

    assert issubclass(RequestEndpoint, Endpoint) and issubclass(RequestSampling, Sampling)
    req = RolloutRequest.model_validate({
        "tasks": [{"id": "t"}], "endpoint": {"base_url": "http://h/v1", "model": "p", "api_key": "k"},
        "sampling": {"extra": {"top_k": 5}, "top_p": 0.9},
    })  # fmt: skip
    with pytest.raises(ValidationError, match="sampling.seed_hint"):  # refused by name, not dropped
        RolloutRequest.model_validate({"tasks": [{"id": "t"}], "endpoint": {"base_url": "http://h/v1", "model": "p"},
                                       "sampling": {"seed_hint": 1}})  # fmt: skip
    assert (req.sampling.temperature, req.endpoint.request_timeout_s) == (RL_TEMPERATURE, RL_REQUEST_TIMEOUT_S)
    assert req.sampling.model_dump(by_alias=True) == {
        "temperature": 1.0, "top_p": 0.9, "max_tokens": 2048, "logprobs": True,
        "return_token_ids": True, "extra": {"top_k": 5},
    }  # fmt: skip
    cfg = model_config_of(req.endpoint, req.sampling, req.endpoint.api_key)
    assert (cfg.model, cfg.temperature, cfg.top_p, cfg.extra_body, cfg.request_timeout_s) == (
        "p", 1.0, 0.9, {"top_k": 5}, 600.0,
    )  # fmt: skip
    assert cfg.api_key is not None and cfg.api_key.get_secret_value() == "k"
    assert "api_key" not in req.endpoint.model_dump()
    with pytest.raises(ValidationError):
        RolloutRequest.model_validate({"tasks": [{"id": "t"}], "endpoint": {"base_url": "", "model": "p"}})


def test_the_settings_request_timeout_reaches_every_commands_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """SANDFLOW_REQUEST_TIMEOUT_S was read by `sandflow run` only; `bench`, `flows run`
    and the data build dropped it (120 s whatever it said). The one builder hands it on."""
    from sandflow.config import load_settings, run_spec

    monkeypatch.setenv("SANDFLOW_REQUEST_TIMEOUT_S", "300")
    monkeypatch.setenv("SANDFLOW_BACKEND", "bwrap")
    spec = run_spec(load_settings(), max_steps=3)
    assert spec.to_model_config(with_key=False).request_timeout_s == 300.0
    assert (spec.sandbox.backend, spec.limits.max_steps) == ("bwrap", 3)


def test_a_sandbox_part_alone_names_its_fields_as_the_sandbox_config_does() -> None:
    box = SandboxSpec(reuse="pool", runtime="runsc")
    spec = build_run_spec(sandbox=box, run_id="r")
    cfg = spec.to_sandbox_config()
    assert (cfg.reuse, cfg.runtime, cfg.run_id) == ("pool", "runsc", "r")
