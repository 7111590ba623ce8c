"""``make gpu-check``: everything that needs a CUDA device, in one command of under 10 minutes,
recorded as a dated row in ``bench/RESULTS.md``.

Steps, each a process of its own with a time limit; the first failure ends the run with a
non-zero status (nothing is skipped: without CUDA the check fails at once), unless
``--keep-going`` runs every step and fails at the end:

1. ``kernel-tests``: the kernel tests (``tests/kernels``), which run on the GPU when one is
   present (the C kernels' tests on the CPU beside it), several at once with pytest-xdist;
   ``engine-tests``: the loader, sampler, KV-sizing, swap and CUDA-graph tests on the GPU's
   engine, one at a time.
2. ``parity``: greedy output of the engine (Triton backend, on CUDA) against transformers on
   the default model, SmolLM2-135M-Instruct: in float32 token for token, with decode steps
   replayed from CUDA graphs and eagerly (``enforce_eager``); in bfloat16 the graphs' tokens
   must be the eager steps', and the prompts identical to transformers' are reported. Also
   reports the peak device memory of each.
3. ``kernels``: ``bench/kernels.py`` (decode attention as a share of the copy bandwidth
   measured in the same run; it appends its own table).
4. ``throughput``: a short ``bench/throughput.py`` on the shared-prefix workload against
   transformers' static batching on the same GPU.

``--dry-run`` (any machine) prints the steps and their commands and runs none.

    make gpu-check                 # or: python -m bench.gpu_check
    make gpu-check ARGS=--dry-run
    make gpu-check ARGS=--keep-going   # a first run on a new machine: every step's output

It runs under the machine's own Python (``GPU_PYTHON``, default ``python3``), which must have a
CUDA build of torch and the project's dependencies: the ``.venv`` that ``make install`` makes
holds the CPU build.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "RESULTS.md"
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Write a haiku about the sea.", "1, 2, 3, 5, 8, 13,"]
NEW_TOKENS = 32

# The kernel tests compile many Triton variants: with pytest-xdist (the GPU image has it) the
# compiles run on several CPU cores at once.
PARALLEL = ["-n", "8"] if importlib.util.find_spec("xdist") else []
STEPS: list[tuple[str, list[str], int]] = [  # name, command, time limit (s)
    ("kernel-tests", [sys.executable, "-m", "pytest", "-q", "--timeout=120", *PARALLEL,
                      "tests/kernels"], 200),
    # One at a time: these size KV pools from the device's free memory.
    ("engine-tests", [sys.executable, "-m", "pytest", "-q", "--timeout=120",
                      "tests/engine/test_sampler_device.py", "tests/engine/test_loader.py",
                      "tests/engine/test_memory.py", "tests/engine/test_swap.py",
                      "tests/engine/test_cuda_graphs.py"], 150),
    ("parity", [sys.executable, "-m", "bench.gpu_check", "--parity"], 150),
    ("kernels", [sys.executable, "bench/kernels.py"], 90),
    ("throughput", [sys.executable, "bench/throughput.py", "--device", "cuda",
                    "--workloads", "shared-prefix",
                    "--num-requests", "128", "--max-output", "64", "--dtype", "bfloat16",
                    "--no-results-md"], 120),
]


def parity() -> None:
    """Greedy tokens of the engine (with and without CUDA graphs) and of transformers on CUDA,
    float32 then bfloat16; prints one JSON line per engine run and exits 1 where float32
    differs from transformers or the graphs' tokens differ from the eager steps'."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.config import DEFAULT_MODEL
    from engine.models.loader import resolve_model_dir

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    failed = False
    for dtype in ("float32", "bfloat16"):
        runs = {}
        for eager in (False, True):
            torch.cuda.reset_peak_memory_stats()
            free, total = torch.cuda.mem_get_info()
            print(f"device memory before the engine: {(total - free) / 2**30:.2f} GiB of "
                  f"{total / 2**30:.1f} in use", flush=True)
            # A fixed pool, whatever else holds device memory.
            engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, device="cuda", dtype=dtype,
                                            attention_backend="triton", enforce_eager=eager,
                                            max_num_seqs=8, kv_cache_memory_bytes=2**30))
            prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
            ours = [o.token_ids for o in engine.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                        min_tokens=NEW_TOKENS))]
            graphs = engine.runner.graphs
            replays = graphs.num_runs if graphs is not None else 0
            runs[eager] = ours, torch.cuda.max_memory_allocated(), replays
            del engine
        ref_model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)).cuda().eval()
        ref = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = ref_model.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, pad_token_id=0)
            ref.append(out[0, len(prompt):].tolist())
        del ref_model
        for eager, (ours, peak, replays) in runs.items():
            same = [a == b for a, b in zip(ours, ref, strict=True)]
            # float32 is token for token transformers'; bf16's reductions run in other orders
            # than transformers' kernels, so it is reported there and held to graphs == eager.
            failed |= (dtype == "float32" and not all(same)) or (not eager and replays == 0)
            failed |= ours != runs[True][0]
            print(json.dumps({"dtype": dtype, "cuda_graphs": not eager,
                              "graph_replays": replays, "identical": sum(same),
                              "prompts": len(same), "peak_gib": round(peak / 2**30, 2)}),
                  flush=True)
    sys.exit(1 if failed else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list the steps, run none")
    parser.add_argument("--only", help="comma-separated steps to run (default: all)")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every step even after one fails (the status still fails)")
    parser.add_argument("--parity", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parity:
        parity()
    names = [name for name, _, _ in STEPS]
    wanted = args.only.split(",") if args.only else names
    if unknown := sorted(set(wanted) - set(names)):
        parser.error(f"no step {', '.join(unknown)}; the steps: {', '.join(names)}")
    steps = [step for step in STEPS if step[0] in wanted]
    if args.dry_run:
        for name, command, limit in steps:
            shown = ["python", *command[1:]]
            print(f"{name:<12} (at most {limit} s): {' '.join(shown)}")
        print(f"then a dated row in {RESULTS.relative_to(REPO_ROOT)}")
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu-check needs a CUDA device (torch sees none); --dry-run lists the steps")
    device = torch.cuda.get_device_name(0)
    rows: list[str] = []
    status = "passed"
    for name, command, limit in steps:
        print(f"== {name}: {' '.join(command)}", flush=True)
        started = time.monotonic()
        try:
            proc = subprocess.run(command, cwd=REPO_ROOT, timeout=limit, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            output, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            output, code = str(exc.stdout or ""), -1
        took = time.monotonic() - started
        print(output, flush=True)
        tail = " ".join(output.strip().splitlines()[-3:])[:300].replace("|", "/")
        rows.append(f"| {name} | {'ok' if code == 0 else f'FAILED ({code})'} | {took:.0f} s "
                    f"| {tail} |")
        if code != 0:
            status = f"failed at {name}" if status == "passed" else f"{status}, {name}"
            if not args.keep_going:
                break
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    with RESULTS.open("a") as f:
        f.write(f"\n## make gpu-check ({stamp}, {device}): {status}\n\n"
                "| step | result | time | last lines |\n|---|---|---|---|\n"
                + "\n".join(rows) + "\n")
    print(f"gpu-check {status}; recorded in {RESULTS}")
    sys.exit(0 if status == "passed" else 1)


if __name__ == "__main__":
    main()
