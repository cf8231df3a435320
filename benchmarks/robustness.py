"""Attack the project as a hostile user would, at scale, and print what held.

    python benchmarks/robustness.py [--actions 100000] [--clients 6] [--requests 200] [--corruptions 20] [--kills 5]
    python benchmarks/robustness.py --quick   # the same attacks, smaller (tests/benchmarks/test_robustness_quick.py)

1. Fuzzed actions: random, malformed and oversized actions (unclosed and nested tags, lone surrogates, control
   characters, long runs of repeated tags, non-strings) through ``env.step`` of the demo NQ env with its BM25
   index. Exceptions must be 0; parsing must be linear (the per-character cost of a 64 KB action of repeated
   tags is printed against an 8 KB one), and an action over ``MAX_ACTION_CHARS`` refused.
2. Retrieval server under mixed load: good clients (several queries per request) and bad ones (lone surrogates,
   not JSON, topk over the limit, declared and chunked bodies over the limit) at once. Every good request must be
   answered with exactly its own in-process results; every bad one refused with a 4xx; a chunked 64 MB upload must
   not grow the server's memory by more than a few MB.
3. Corrupted checkpoints: random byte flips, truncations and emptied manifests in a trained run's checkpoints; a
   resume must never load a corrupted file (it moves the checkpoint aside, or stops and says why).
4. Bad command lines: each must exit non-zero with one line of error and no traceback.
5. kill -9: a training run is killed at random moments and resumed each time; the final weights, optimizer
   state and metrics must equal those of an uninterrupted run (nothing lost, nothing repeated).

Exit status 1 when any attack found a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common  # noqa: F401  (puts the repository on sys.path)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a mistyped model name fails at once instead of retrying the hub

import stppo_envs  # noqa: F401  (registers the env ids)

# -- 1. actions ---------------------------------------------------------------------------------------------------
TAGS = ["<search>", "</search>", "<answer>", "</answer>", "<think>", "</think>", "<search", "answer>", "<", ">"]


def random_action(rng: random.Random):
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice([None, b"<search>x</search>", 42, ["<answer>a</answer>"], 3.5])
    if kind == 1:  # a long run of tags: the quadratic-parsing attack
        return rng.choice(TAGS[:4]) * rng.randrange(1, 20000)
    pieces = []
    for _ in range(rng.randrange(1, 12)):
        roll = rng.random()
        if roll < 0.4:
            pieces.append(rng.choice(TAGS))
        elif roll < 0.6:
            pieces.append("".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(0, 30))))
        elif roll < 0.7:
            pieces.append(rng.choice(["\ud800", "\udfff", "\x00", "\x1b[2J", "\u202e", "\ufeff"]))
        else:
            pieces.append(rng.choice(["paris", "capital", "who wrote", "the", " ", "\n"]))
    return "".join(pieces)


def attack_actions(n: int, seed: int = 0) -> tuple[bool, list[str]]:
    import gymnasium as gym

    env = gym.make("stppo/NQ-v0", max_turns=4).unwrapped
    rng = random.Random(seed)
    exceptions, times, invalid = 0, [], 0
    env.reset(seed=0)
    env.step("<search> capital </search>")  # warm up: the demo index is built and the JVM started on first use
    env.reset(seed=0)
    for i in range(n):
        action = random_action(rng)
        started = time.perf_counter()
        try:
            _, _, terminated, truncated, info = env.step(action)
            invalid += info.get("action_type") == "invalid"
            if terminated or truncated:
                env.reset(seed=i)
        except Exception as exc:  # noqa: BLE001  (counting them is the point)
            exceptions += 1
            if exceptions <= 3:
                print(f"  action {action!r:.80} raised {type(exc).__name__}: {exc}")
            env.reset(seed=i)
        times.append(time.perf_counter() - started)

    from stppo_envs.actions import MAX_ACTION_CHARS

    def parse_seconds(size: int) -> float:
        """CPU seconds of this process parsing an action of repeated opening tags (never closed: all parsing, no
        search)."""
        env.reset(seed=0)
        started = time.process_time()
        env.step("<search>" * (size // 8))
        return time.process_time() - started

    # The fastest of 7 interleaved runs of each size, in this process's CPU time: other processes on the machine
    # only ever add time, so the minimum is the run they disturbed least (a median of wall times read 5x on a loaded
    # 2-core machine where a quiet one reads 1.0x).
    small, large = [], []
    for _ in range(7):
        small.append(parse_seconds(MAX_ACTION_CHARS // 8))
        large.append(parse_seconds(MAX_ACTION_CHARS))
    linear = (min(large) / MAX_ACTION_CHARS) / max(min(small) / (MAX_ACTION_CHARS // 8), 1e-12)
    env.reset(seed=0)
    _, _, _, _, info = env.step("<search>" * (MAX_ACTION_CHARS // 4))  # over the limit: refused, not parsed
    over_limit_refused = info.get("action_type") == "invalid"
    times.sort()
    lines = [f"fuzzed actions   {n} steps: exceptions {exceptions}, invalid {invalid / n:.0%}, step p50 "
             f"{statistics.median(times) * 1e3:.2f} ms, p99 {times[int(0.99 * (n - 1))] * 1e3:.2f} ms, max "
             f"{times[-1] * 1e3:.1f} ms; parsing cost per character, {MAX_ACTION_CHARS // 1024} KB / "
             f"{MAX_ACTION_CHARS // 8192} KB action of repeated tags {linear:.2f}x (1 = linear); an action over "
             f"MAX_ACTION_CHARS refused {'yes' if over_limit_refused else 'NO'}"]
    return exceptions == 0 and linear < 3 and over_limit_refused, lines


# -- 2. server ----------------------------------------------------------------------------------------------------
def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096 / 2**20


def attack_server(clients: int, requests_per_client: int) -> tuple[bool, list[str]]:
    import requests
    import uvicorn

    from stppo_envs.retrieval import make_retriever
    from stppo_envs.retrieval.server import ServerLimits, create_app

    retriever = make_retriever("demo", cache_size=0)
    limits = ServerLimits(max_body_bytes=1 << 20)
    server = uvicorn.Server(uvicorn.Config(create_app(retriever, limits), host="127.0.0.1", port=0,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/retrieve"
    words = ["capital", "river", "king", "disease", "treatment", "city", "born", "war", "island", "novel"]
    pool = [f"{a} {b}" for i, a in enumerate(words) for b in words[i + 1:]]
    # answered in-process before the load starts: the Lucene searcher is not for concurrent callers (the server
    # serialises its own calls)
    expected_answers = {query: [hit.contents for hit in retriever.search(query, 3)] for query in pool}

    def expected(query: str) -> list[str]:
        return expected_answers[query]

    def good(client: int) -> tuple[int, int]:
        rng, ok = random.Random(client), 0
        for _ in range(requests_per_client):
            queries = [rng.choice(pool) for _ in range(rng.randrange(1, 4))]
            response = requests.post(url, json={"queries": queries, "topk": 3, "return_scores": False}, timeout=60)
            if response.status_code == 200:
                answers = [[item["contents"] for item in hits] for hits in response.json()["result"]]
                ok += answers == [expected(q) for q in queries]
        return ok, requests_per_client

    def bad(client: int) -> tuple[int, int]:
        rng, refused = random.Random(1000 + client), 0
        for _ in range(requests_per_client):
            kind = rng.randrange(4)
            if kind == 0:
                response = requests.post(url, json={"queries": ["capital \ud800 city"], "topk": 3}, timeout=60)
            elif kind == 1:
                response = requests.post(url, data=b"{not json", timeout=60)
            elif kind == 2:
                response = requests.post(url, json={"queries": ["capital"], "topk": 10**9}, timeout=60)
            else:
                response = requests.post(url, data=b"x" * ((1 << 20) + 1), timeout=60)
            refused += 400 <= response.status_code < 500
        return refused, requests_per_client

    good_clients = max(1, clients * 2 // 3)
    with ThreadPoolExecutor(clients) as executor:
        futures = [executor.submit(good, c) for c in range(good_clients)] + \
                  [executor.submit(bad, c) for c in range(clients - good_clients)]
        results = [f.result() for f in futures]
    good_ok = sum(r[0] for r in results[:good_clients]) / max(1, sum(r[1] for r in results[:good_clients]))
    bad_refused = sum(r[0] for r in results[good_clients:]) / max(1, sum(r[1] for r in results[good_clients:]))

    before = rss_mb()

    def chunks():
        for _ in range(64 * 16):
            yield b"x" * 65536  # 64 MB in all, no Content-Length

    status = "connection closed"
    with contextlib.suppress(requests.ConnectionError):
        status = requests.post(url, data=chunks(), headers={"content-type": "application/json"},
                               timeout=120).status_code
    growth = rss_mb() - before
    server.should_exit = True
    thread.join(timeout=10)
    lines = [f"retrieval server {good_clients} good + {clients - good_clients} bad clients x {requests_per_client} "
             f"requests: good answered with their own results {good_ok:.1%}, bad refused with a 4xx "
             f"{bad_refused:.1%}; chunked 64 MB upload: {status}, memory +{growth:.1f} MB"]
    return good_ok == 1.0 and bad_refused == 1.0 and growth < 32, lines


# -- 3. checkpoints -----------------------------------------------------------------------------------------------
def attack_checkpoints(trials: int) -> tuple[bool, list[str]]:
    from stppo_agent.models.tiny import build_tiny_llama
    from stppo_agent.runs.checkpoint import CorruptCheckpointError, list_checkpoints
    from stppo_agent.training.config import TrainConfig
    from stppo_agent.training.config_sections import (
        CheckpointConfig,
        LoggingConfig,
        MonitorConfig,
        OptimizerConfig,
        RolloutConfig,
    )
    from stppo_agent.training.trainer import Trainer

    scratch = Path(tempfile.mkdtemp())
    model = build_tiny_llama(scratch / "model")
    config = dict(algo="ppo", env="stppo/Toy-v0", model=str(model), iterations=3,
                  rollout=RolloutConfig(prompts_per_iteration=2, samples_per_prompt=2, max_turns=2,
                                        max_new_tokens_per_turn=1, max_prompt_tokens=8, max_total_tokens=32),
                  optimizer=OptimizerConfig(mini_batch_size=4, micro_batch_size=2),
                  logging=LoggingConfig(progress=False, tensorboard=False),
                  checkpoint=CheckpointConfig(every=1, keep=3), monitor=MonitorConfig(on_collapse="none"))
    base = scratch / "run"
    Trainer(TrainConfig(output_dir=str(base), **config), report=lambda _: None).train()
    rng = random.Random(0)
    silent, refused, resumed_earlier = 0, 0, 0
    for trial in range(trials):
        run = scratch / f"trial-{trial}"
        shutil.copytree(base, run)
        step = rng.choice(list_checkpoints(run))
        folder = run / "checkpoints" / f"step-{step}"
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        target = rng.choice(files)
        how = rng.choice(["flip", "truncate", "empty-manifest"])
        if how == "empty-manifest":
            target = folder / "manifest.json"
            target.write_text(rng.choice(["{}", "[]", ""]))
        elif how == "truncate":
            target.write_bytes(target.read_bytes()[: max(0, target.stat().st_size // 2)])
        else:
            data = bytearray(target.read_bytes())
            if data:
                data[rng.randrange(len(data))] ^= 0xFF
            target.write_bytes(bytes(data))
        messages = []
        try:
            trainer = Trainer(TrainConfig(output_dir=str(run), **dict(config, iterations=4)), resume=True,
                              report=messages.append)
            loaded = trainer.state.iteration
            if loaded == step:  # the corrupted checkpoint itself was loaded
                silent += 1
            else:
                resumed_earlier += 1
        except CorruptCheckpointError:
            refused += 1
        shutil.rmtree(run)
    shutil.rmtree(scratch)
    lines = [f"checkpoints      {trials} corruptions (byte flips, truncations, emptied manifests): loaded silently "
             f"{silent}, resumed from an earlier good checkpoint {resumed_earlier}, stopped with a reason {refused}"]
    return silent == 0, lines


# -- 4. command lines ---------------------------------------------------------------------------------------------
BAD_COMMANDS = [
    ["eval", "--agent", "nobody", "--benchmarks", "nq", "--limit", "1", "--output-dir", "{tmp}/a"],
    ["eval", "--agent", "oracle", "--benchmarks", "nqq", "--limit", "1", "--output-dir", "{tmp}/b"],
    ["eval", "--agent", "oracle", "--benchmarks", "nq", "--retriever", "bm25:/no/such/index", "--limit", "1",
     "--output-dir", "{tmp}/c"],
    ["eval", "--agent", "oracle", "--benchmarks", "nq", "--dataset", "hotpotqa=x.jsonl", "--output-dir", "{tmp}/d"],
    ["eval", "--agent", "oracle", "--benchmarks", "nq", "--dataset", "nq=/no/such.jsonl", "--retriever", "demo",
     "--output-dir", "{tmp}/e"],
    ["eval", "--agent", "hf:{tmp}/no-model", "--benchmarks", "nq", "--limit", "1", "--output-dir", "{tmp}/f"],
    ["train", "--model", "{tmp}/no-model", "--output-dir", "{tmp}/g", "--iterations", "1"],
    ["train", "--model", "m", "--output-dir", "{tmp}/h", "--set", "lr=1"],
    ["train", "--model", "m", "--output-dir", "{tmp}/i", "--set", "optimizer.actor_lr=fast"],
    ["train", "--model", "m", "--output-dir", "{tmp}/j", "--algo", "nope"],
    ["train", "--model", "m", "--output-dir", "{tmp}/k", "--algo", "grpo"],
    ["train", "--model", "m", "--output-dir", "{tmp}/l", "--set", "algorithm.clip_low=2"],
    ["train", "--model", "m", "--output-dir", "{tmp}/m", "--set", "monitor.on_collapse=panic"],
    ["train", "--model", "m", "--output-dir", "{tmp}/n", "--set", "algorithm.rollout_correction=is"],
    ["train", "--model", "m", "--output-dir", "{tmp}/o", "--config", "{tmp}/no.yaml"],
    ["train", "--model", "m", "--output-dir", "{tmp}/p", "--env", "stppo/Nope-v0", "--iterations", "1"],
    ["replay", "{tmp}/no-run", "--algo", "ppo", "--output-dir", "{tmp}/q"],
    ["compare", "{tmp}/no-results", "{tmp}/no-results2"],
    ["plot", "{tmp}/no-run", "--out", "{tmp}/r"],
    ["index", "bm25", "--corpus", "{tmp}/no-corpus.jsonl", "--out", "{tmp}/s"],
    ["index", "dense", "--corpus", "{tmp}/no-corpus.jsonl", "--out", "{tmp}/t"],
    ["serve", "--retriever", "bm25:/no/such/index"],
]


def attack_cli() -> tuple[bool, list[str]]:
    from stppo_agent.cli import main

    tmp = tempfile.mkdtemp()
    clean, failures = 0, []
    for command in BAD_COMMANDS:
        argv = [part.replace("{tmp}", tmp) for part in command]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code
            except Exception as exc:  # noqa: BLE001
                code, _ = "raised", err.write(f"Traceback: {type(exc).__name__}: {exc}")
        text = err.getvalue().strip()
        lines = [line for line in text.splitlines() if line.strip()]
        one_line = lines and "Traceback" not in text and ("error" in lines[-1])
        if code not in (0, None, "raised") and one_line:
            clean += 1
        else:
            failures.append(f"  {' '.join(command)} -> exit {code}: {text[-200:]!r}")
    shutil.rmtree(tmp, ignore_errors=True)
    return clean == len(BAD_COMMANDS), [f"command lines    {len(BAD_COMMANDS)} bad invocations: a clear error and a "
                                        f"non-zero exit {clean}", *failures]


# -- 5. kill -9 -----------------------------------------------------------------------------------------------------
def attack_kill9(kills: int, iterations: int = 10) -> tuple[bool, list[str]]:
    import json
    import signal
    import subprocess

    import torch
    from safetensors.torch import load_file

    from stppo_agent.models.tiny import build_tiny_llama, toy_train_command
    from stppo_agent.runs.checkpoint import load_trainer_state

    scratch = Path(tempfile.mkdtemp())
    model = build_tiny_llama(scratch / "model")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    interrupted, reference = scratch / "interrupted", scratch / "reference"
    rng, done_kills, runs = random.Random(0), 0, 0
    while True:
        runs += 1
        process = subprocess.Popen(toy_train_command(model, interrupted, iterations, resume=runs > 1), env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if done_kills < kills:
            # once a random checkpoint exists (before the first one, --resume rightly refuses the folder), at a
            # random moment of the next iteration
            target = interrupted / "checkpoints" / f"step-{rng.randrange(1, iterations - 1)}"
            while process.poll() is None and not target.exists():
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.3))
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                done_kills += 1
        if process.wait(timeout=900) == 0 or runs > kills + 3:
            break
    subprocess.run(toy_train_command(model, reference, iterations, resume=False), env=env, check=True,
                   capture_output=True)
    final = f"checkpoints/step-{iterations}"
    steps = [json.loads(line)["step"] for line in (interrupted / "metrics.jsonl").read_text().splitlines()]
    mine, theirs = load_file(interrupted / final / "actor" / "model.safetensors"), \
        load_file(reference / final / "actor" / "model.safetensors")
    same_weights = all(torch.equal(mine[name], theirs[name]) for name in theirs)
    (tensors, _), (reference_tensors, _) = load_trainer_state(interrupted / final), \
        load_trainer_state(reference / final)
    state, reference_state = tensors["actor_optimizer"]["state"], reference_tensors["actor_optimizer"]["state"]
    same_optimizer = all(torch.equal(state[n][k], reference_state[n][k]) for n in reference_state
                         for k in ("step", "exp_avg", "exp_avg_sq"))
    metrics_intact = steps == list(range(1, iterations + 1))
    shutil.rmtree(scratch)
    lines = [f"kill -9          {done_kills} kills at random moments over {runs} runs of {iterations} iterations: "
             f"final weights equal to an uninterrupted run {'yes' if same_weights else 'NO'}, optimizer state "
             f"{'yes' if same_optimizer else 'NO'}, metrics records 1..{iterations} once each "
             f"{'yes' if metrics_intact else 'NO: ' + str(steps)}"]
    return same_weights and same_optimizer and metrics_intact, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actions", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--corruptions", type=int, default=20)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes, about a minute")
    args = parser.parse_args(argv)
    if args.quick:  # in temporary folders, like the full run: nothing of it stays to be reused
        args.actions, args.requests, args.corruptions, args.kills = 2000, 20, 6, 1
        print("quick: checks the plumbing, not a result (small sizes; the figures below are not the at-scale ones)",
              flush=True)
    held = True
    for name, attack in (("actions", lambda: attack_actions(args.actions)),
                         ("server", lambda: attack_server(args.clients, args.requests)),
                         ("checkpoints", lambda: attack_checkpoints(args.corruptions)),
                         ("cli", attack_cli),
                         ("kill -9", lambda: attack_kill9(args.kills))):
        ok, lines = attack()
        held &= ok
        print("\n".join(lines) + ("" if ok else f"   <-- {name} FAILED"), flush=True)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
