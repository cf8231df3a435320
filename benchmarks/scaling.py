"""Scaling on this machine: data-parallel update throughput (1 vs 2 processes, gloo, CPU; DDP and FSDP2) and the
retrieval server's queries/second under 1, 4 and 16 concurrent clients against in-process batch search.

    python benchmarks/scaling.py

Each process gets one CPU thread in both settings, so the ratio measures parallel efficiency (the ideal is 2.0).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import REPO, cached_index, shared_data

from stppo_agent.distributed.shared_retrieval import free_port  # noqa: E402
from stppo_agent.models.tiny import build_tiny_llama  # noqa: E402


def train_throughput(processes: int, model: Path, strategy: str = "ddp") -> list[float]:
    """Global policy tokens/s of the update (every rank's share) in each of iterations 2..4 (the first warms up)."""
    out = Path(tempfile.mkdtemp())
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = launcher + ["-m", "stppo_agent.cli", "train", "--algo", "st_ppo", "--env", "stppo/NQ-v0", "--model",
                          str(model), "--output-dir", str(out), "--iterations", "4"]
    for item in ("rollout.prompts_per_iteration=16", "rollout.samples_per_prompt=1", "optimizer.mini_batch_size=16",
                 "optimizer.micro_batch_size=4",
                 "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=48", "rollout.max_prompt_tokens=512",
                 "rollout.max_total_tokens=1024",
                 "logging.progress=false", "logging.tensorboard=false", "checkpoint.every=100",
                 f"distributed.strategy={strategy}"):
        command += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    subprocess.run(command, check=True, capture_output=True, env=env, cwd=REPO)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["update_tokens_per_s"] * processes for r in records[1:]]


def spread(values: list[float], digits: int = 1) -> str:
    """Median and range: 812.3 (790.1-840.2)."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"



def server_qps(index: Path, queries: list[str]) -> None:
    import uvicorn

    from stppo_envs.retrieval import make_retriever
    from stppo_envs.retrieval.server import create_app

    backend = make_retriever(f"bm25:{index}", cache_size=0)
    for _ in range(3):  # JIT warm-up
        backend.batch_search(queries, 3)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    started = time.perf_counter()
    for start in range(0, len(queries), 64):
        backend.batch_search(queries[start:start + 64], 3)
    in_process = len(queries) / (time.perf_counter() - started)
    print(f"in-process batch_search (batches of 64): {in_process:8.1f} q/s")
    for clients in (1, 4, 16):
        remote = make_retriever(f"http://127.0.0.1:{port}", cache_size=0)
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:  # each client sends one query per request, like a rollout worker
            list(pool.map(lambda q: remote.search(q, 3), queries))
        qps = len(queries) / (time.perf_counter() - started)
        print(f"server, {clients:2d} concurrent clients:       {qps:8.1f} q/s   ({qps / in_process:.2f}x in-process)")
    server.should_exit = True


def main() -> None:
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer

    # a random 4-layer model over SmolLM2's vocabulary, on the demo NQ env (prompts of a few hundred tokens)
    tokenizer = load_tokenizer(str(smollm2_path()))
    model = build_tiny_llama(Path(tempfile.mkdtemp()) / "model", tokenizer, hidden=256, layers=4)
    one, two = train_throughput(1, model), train_throughput(2, model)
    # medians and ranges over iterations 2..4; the ratio's range pairs the slowest with the fastest iterations
    print(f"update, 1 process : {spread(one)} policy tok/s")
    print(f"update, 2 processes: {spread(two)} policy tok/s   ({statistics.median(two) / statistics.median(one):.2f}x,"
          f" {min(two) / max(one):.2f}-{max(two) / min(one):.2f}x; ideal 2.0)")
    sharded = train_throughput(2, model, "fsdp2")
    print(f"update, 2 processes, FSDP2: {spread(sharded)} policy tok/s   "
          f"({statistics.median(sharded) / statistics.median(two):.2f}x DDP on 2 processes)")
    data = shared_data()
    queries = [json.loads(line)["question"] for _, line in zip(range(640), open(data / "qa/nq_open_dev.jsonl"))]
    server_qps(cached_index("bm25", data / "corpus/wiki_dpr_sample_1000.jsonl", "wiki1000"), queries)


if __name__ == "__main__":
    main()
