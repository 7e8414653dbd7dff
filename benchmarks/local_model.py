"""Benchmark: the embedded model server against llama.cpp itself, on the same model and threads.

Floors (llama.cpp itself): llama-cpp-python's low-level API in this process, on the same
.gguf, threads and batch size as the server — prefill = `Llama.eval` of a fresh prompt,
decode = the sample/eval loop of one token at a time (greedy), both timed around the
llama.cpp calls only (a llama-bench-like loop).
The server, as a client sees it (HTTP, JSON, template, tokenization included):
- prefill: a fresh prompt of the same length (a unique first line, so nothing is cached),
  max_tokens=1: prompt tokens / latency;
- decode: the same prompt again (cached), `max_tokens=N` with end-of-text banned:
  N / latency.
Floor and server runs alternate, in turns first (machine load hits both alike); medians of
`--repeats`.
Then a multi-turn episode (system + task, then per turn the reply and a tool
observation appended: an append-only history): `prefix_reuse_ratio` = the share of the
later turns' prompt tokens the server served from its cache (usage.cached_tokens), the
token ids checked exact (analysis.token_ids.assemble); and `--concurrent` such episodes
at once on a server with as many slots, against the same episodes one after another.

Targets: decode_vs_llamacpp and prefill_vs_llamacpp <= 1.2 (server time / floor time),
prefix_reuse_ratio >= 0.8.

    .venv/bin/python benchmarks/local_model.py [--threads 2] [--prompt-tokens 512]
        [--decode-tokens 64] [--repeats 3] [--turns 5] [--concurrent 2]

Ends with ONE JSON line (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the floor runs as the server does (tasks.local_model.LocalModelServer.env): OpenMP threads
# that spin while waiting make a shared machine many times slower
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402

from analysis.token_ids import assemble  # noqa: E402
from tasks.local_model import LocalModelServer, find_gguf  # noqa: E402
from tasks.model import ModelClient, ModelConfig  # noqa: E402
from tasks.records import TurnRecord  # noqa: E402
from tasks.tools import TOOL_SCHEMAS  # noqa: E402

TARGET_RATIO = 1.2
TARGET_REUSE = 0.8
FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews the budget "
          "for the new library, and the river keeps flowing past the old mill. ")


def prompt_text(n_tokens: int, tokenize: Any, tag: str) -> str:
    """A user message of about `n_tokens` tokens, its first line unique (`tag`)."""
    text = f"Note {tag}.\n"
    while len(tokenize(text)) < n_tokens:
        text += FILLER
    return text


# --------------------------------------------------------------------------- floor
class Floor:
    """llama.cpp through llama-cpp-python's low-level API (no server, no chat layer)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, n_batch=512, verbose=False)

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=False, special=False))

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def decode(self, n: int) -> float:
        """n greedy tokens after the last prefill (end-of-text never chosen)."""
        lc = self.llama_cpp
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        bias = (lc.llama_logit_bias * 2)()
        for i, tok in enumerate({self.llm.token_eos(), 0} if self.llm.token_eos() != 0 else {0, 2}):
            bias[i].token, bias[i].bias = tok, -100.0
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_logit_bias(self.llm.n_vocab(), 2, bias))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        ctx = self.llm._ctx.ctx  # noqa: SLF001
        t0 = time.perf_counter()
        for _ in range(n):
            tok = lc.llama_sampler_sample(chain, ctx, -1)
            self.llm.eval([tok])
        dt = time.perf_counter() - t0
        lc.llama_sampler_free(chain)
        return dt


# --------------------------------------------------------------------------- server
def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    r = httpx.post(url, json=body, timeout=600)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return r.json(), dt


def server_once(url: str, body: dict[str, Any], n: int) -> tuple[float, float]:
    """(seconds per prompt token, seconds per generated token) as the client sees them."""
    reply, dt = post(url, dict(body, max_tokens=1))
    prefill = dt / max(1, reply["timings"]["prompt_evaluated"])
    reply, dt = post(url, dict(body, max_tokens=n))
    return prefill, dt / reply["usage"]["completion_tokens"]


def episode(base_url: str, alias: str, turns: int, seed: int) -> dict[str, Any]:
    """One multi-turn conversation, append-only; its per-turn usage and token check."""
    client = ModelClient(ModelConfig(model=alias, base_url=base_url, temperature=0.7, max_tokens=48,
                                     request_timeout_s=600, logprobs=True, return_token_ids=True,
                                     extra_body={"seed": seed}))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent in a Linux sandbox. Use the tools."},
        {"role": "user", "content": f"Task {seed}: count the lines of /testbed/input/data.txt and write "
                                    "the number to /testbed/output/answer.txt, then submit."},
    ]
    records: list[TurnRecord] = []
    t0 = time.perf_counter()
    for turn in range(turns):
        reply = client.complete(messages, TOOL_SCHEMAS)
        records.append(TurnRecord(
            run_id="bench", episode_id=f"bench-{seed}", turn_index=turn, started_at=datetime.now(UTC), assistant_content=reply.content,
            usage=reply.usage, prompt_token_ids=reply.prompt_token_ids,
            completion_token_ids=reply.completion_token_ids, completion_logprobs=reply.completion_logprobs))
        messages.append(reply.as_message())
        observation = f"exit code 0\n{'line of output ' * 12}\n(turn {turn})"
        if reply.tool_calls:
            for c in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id, "content": observation})
        else:
            messages.append({"role": "user", "content": "Use a tool. " + observation})
    later = records[1:]
    prompt = sum(r.usage.prompt_tokens or 0 for r in later)
    cached = sum(r.usage.cached_tokens or 0 for r in later)
    return {"seconds": time.perf_counter() - t0, "later_prompt_tokens": prompt, "later_cached_tokens": cached,
            "token_ids_status": assemble(records).status,
            "completion_tokens": sum(r.usage.completion_tokens or 0 for r in records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrent", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    a = ap.parse_args()

    gguf = find_gguf()
    floor = Floor(gguf, a.threads, a.n_ctx)
    fp, fd, sp, sd = [], [], [], []
    with LocalModelServer(n_threads=a.threads, n_ctx=a.n_ctx, max_tokens_cap=4096) as server:
        url = f"{server.base_url}/chat/completions"
        post(url, {"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})
        ban = {"0": -100, "2": -100}
        for i in range(a.repeats):
            text = prompt_text(a.prompt_tokens, floor.tokenize, uuid.uuid4().hex)
            body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "logit_bias": ban}
            ids = floor.tokenize(text)

            # the order alternates: a load that drifts within a repeat favours neither
            for side in ("server", "floor") if i % 2 == 0 else ("floor", "server"):
                if side == "server":
                    p, d = server_once(url, body, a.decode_tokens)
                    sp.append(p)
                    sd.append(d)
                else:
                    fp.append(floor.prefill(ids) / len(ids))
                    fd.append(floor.decode(a.decode_tokens) / a.decode_tokens)
            print(f"repeat {i + 1}: prefill {1 / sp[-1]:.0f} vs {1 / fp[-1]:.0f} tok/s (server vs llama.cpp), "
                  f"decode {1 / sd[-1]:.1f} vs {1 / fd[-1]:.1f} tok/s", flush=True)
        one = episode(server.base_url, server.alias, a.turns, seed=1)
    del floor
    prefill_ratio = statistics.median(sp) / statistics.median(fp)
    decode_ratio = statistics.median(sd) / statistics.median(fd)
    reuse = one["later_cached_tokens"] / max(1, one["later_prompt_tokens"])

    k = max(1, a.concurrent)
    with LocalModelServer(n_threads=max(1, a.threads // k), n_ctx=a.n_ctx, slots=k,
                          max_tokens_cap=4096) as server:
        t0 = time.perf_counter()
        seq = [episode(server.base_url, server.alias, a.turns, seed=10 + i) for i in range(k)]
        seq_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(k) as pool:
            par = list(pool.map(lambda i: episode(server.base_url, server.alias, a.turns, seed=10 + i), range(k)))
        par_s = time.perf_counter() - t0
    par_reuse = sum(e["later_cached_tokens"] for e in par) / max(1, sum(e["later_prompt_tokens"] for e in par))
    statuses = sorted({e["token_ids_status"] for e in [one, *seq, *par]})
    out = {
        "benchmark": "local_model",
        "model": gguf.name,
        "threads": a.threads,
        "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.decode_tokens,
        "server_prefill_tok_s": round(1 / statistics.median(sp), 1),
        "llamacpp_prefill_tok_s": round(1 / statistics.median(fp), 1),
        "prefill_vs_llamacpp": round(prefill_ratio, 3),
        "server_decode_tok_s": round(1 / statistics.median(sd), 2),
        "llamacpp_decode_tok_s": round(1 / statistics.median(fd), 2),
        "decode_vs_llamacpp": round(decode_ratio, 3),
        "turns": a.turns,
        "prefix_reuse_ratio": round(reuse, 3),
        "token_ids_status": statuses,
        "concurrent": k,
        "concurrent_threads_per_slot": max(1, a.threads // k),
        "sequential_episodes_s": round(seq_s, 2),
        "concurrent_episodes_s": round(par_s, 2),
        "concurrent_speedup": round(seq_s / par_s, 3) if par_s else None,
        "concurrent_prefix_reuse_ratio": round(par_reuse, 3),
        "target_ratio": TARGET_RATIO,
        "target_reuse": TARGET_REUSE,
        "pass": prefill_ratio <= TARGET_RATIO and decode_ratio <= TARGET_RATIO and reuse >= TARGET_REUSE,
    }
    print(f"prefill_vs_llamacpp {out['prefill_vs_llamacpp']} ({out['server_prefill_tok_s']} vs "
          f"{out['llamacpp_prefill_tok_s']} tok/s); decode_vs_llamacpp {out['decode_vs_llamacpp']} "
          f"({out['server_decode_tok_s']} vs {out['llamacpp_decode_tok_s']} tok/s); prefix_reuse_ratio "
          f"{out['prefix_reuse_ratio']} over {a.turns} turns; {k} episodes at once on {k} slots: "
          f"{out['concurrent_episodes_s']} s vs {out['sequential_episodes_s']} s one after another "
          f"(reuse {out['concurrent_prefix_reuse_ratio']}); token ids: {', '.join(statuses)}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
