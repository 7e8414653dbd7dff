"""The defaults of an episode's limits: ONE home, read by every entry point.

A module of constants only, so the CLI can show them in its help without importing the
agent loop.
"""

# THE defaults of an episode's limits, for every entry point (`sandflow run`, `flows run`,
# `bench`, RunSpec, the rollout server, SandboxEnv): 30 turns, 15 minutes of the model's
# calls and commands. Why these: they were already the defaults of `flows run`, `bench`
# and RunSpec (where recorded runs come from; `sandflow run` had 30 / 1800 s, the loop's
# own Limits 100 / 1800 s), and 15 minutes holds a model-endpoint outage of a few minutes
# (tasks.model rides out DEFAULT_RETRY_WINDOW_S of failing calls) without letting a stuck
# episode hold a sandbox for long. docs/episodes.md, "Limits".
DEFAULT_MAX_STEPS = 30
DEFAULT_WALL_CLOCK_S = 900.0
# With the embedded 135M model (no endpoint given) `bench` keeps its demo short: it rarely
# submits and each sandbox turn takes 5-15 s of CPU on a 2-core machine.
EMBEDDED_MODEL_MAX_STEPS = 4
# ... and one episode at a time (one CPU model server: interleaved episodes would thrash
# its prefix cache), each call capped at 256 completion tokens (it rambles to the cap).
EMBEDDED_MODEL_CONCURRENCY = 1
EMBEDDED_MODEL_MAX_TOKENS = 256

# THE defaults of how a run samples and waits for its model (tasks.spec.Sampling and
# Endpoint, tasks.model.ModelConfig, the settings, the data build's generator).
DEFAULT_TEMPERATURE = 0.7
DEFAULT_MAX_TOKENS = 2048  # completion tokens per call
# request_timeout_s when none is given. The embedded server stops a generation when its
# client leaves and bounds each call's tokens (tasks/local_model_app.py): a timed-out call
# frees it at once, so its retry no longer queues behind abandoned work and needs no longer wait.
DEFAULT_REQUEST_TIMEOUT_S = 120.0
# Rollouts for RL (the rollout server's requests, the rl-data deployment) sample the
# policy's own distribution: temperature 1.0, as LLM-in-Sandbox-RL does; their group
# advantages assume it.
RL_TEMPERATURE = 1.0
# A rollout request's call to the trainer's server waits longer than a run's: that server
# generates the whole batch's samples at once (and pauses for weight syncs), so one call
# may queue for minutes behind the others without anything being wrong.
RL_REQUEST_TIMEOUT_S = 600.0
# The data build's question generator (datagen), completion tokens per call unless told:
# one question's JSON (a stem, its choices, the answer) needs far fewer than a run's
# DEFAULT_MAX_TOKENS; lower on purpose, so a rambling generator costs less. `sandflow data
# build --max-tokens` (and the data-build deployment's max_tokens) bounds its calibration
# run's calls too; `sandflow data calibrate` alone takes the settings' max_tokens.
SYNTH_MAX_TOKENS = 1024
