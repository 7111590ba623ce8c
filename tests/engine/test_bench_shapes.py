"""bench/shapes.py: real-size shapes' parameter counts, and a small shape of each family
written in shards that kvbatch and transformers both load, to the same greedy tokens."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from bench.shapes import SHAPES, weight_shapes, write_random_model


def test_the_shapes_have_the_published_parameter_counts() -> None:
    counts = {name: sum(math.prod(s) for s in weight_shapes(config).values())
              for name, config in SHAPES.items()}
    # Llama 3.2 1B and 3B's model cards (tied embeddings); Qwen3-1.7B's "1.7B" (1.72B in all),
    # Qwen3-0.6B's "0.6B" (0.44B past the embeddings).
    assert counts == {"llama-3.2-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920,
                      "qwen3-1.7b": 1_720_574_976, "llama-3.2-3b": 3_212_749_824}


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_small_shape_loads_in_both_to_the_same_tokens(tmp_path: Path, model_type: str) -> None:
    from transformers import AutoModelForCausalLM

    from engine import EngineConfig, LLMEngine, SamplingParams

    config = dict(model_type=model_type, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, vocab_size=300, tie_word_embeddings=model_type == "qwen3",
                  max_position_embeddings=256)
    total = write_random_model(tmp_path / "m", config, shard_bytes=40_000)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(weight_shapes(config))
    assert total == 2 * sum(math.prod(s) for s in weight_shapes(config).values())
    assert write_random_model(tmp_path / "m", config) == total  # kept, not rewritten
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert written["architectures"] == [{"llama": "LlamaForCausalLM",
                                         "qwen3": "Qwen3ForCausalLM"}[model_type]]

    prompt = [5, 17, 99, 3, 250]
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "m"), dtype="float32",
                                    num_kv_blocks=8))
    ours = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True))[0].token_ids
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    ids = torch.tensor([prompt])
    ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert ours == ref[0, len(prompt):].tolist()


def test_realsize_on_a_tiny_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """bench/realsize.py end to end without llama.cpp (given one whose converter refuses the
    model): load, lone request, kvbatch at 2 requests and against transformers, each line with
    its figures."""
    from bench import realsize, shapes

    llama_cpp = tmp_path / "llama.cpp"  # a converter too old for the architecture
    llama_cpp.mkdir()
    (llama_cpp / "convert_hf_to_gguf.py").write_text(
        "import sys\nprint('INFO:hf-to-gguf:Loading model', file=sys.stderr)\n"
        "print('ERROR:hf-to-gguf:Model Qwen3ForCausalLM is not supported', file=sys.stderr)\n"
        "sys.exit(1)\n")

    monkeypatch.setitem(shapes.SHAPES, "tiny", dict(
        model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
        tie_word_embeddings=True, max_position_embeddings=1024))
    monkeypatch.setattr(realsize, "LONE_TOKENS", 8)
    # the compute floor's rate: torch's GEMM in the dtype kvbatch computes in (float32 here,
    # as on a CPU without bf16 arithmetic; transformers then runs float32 too)
    monkeypatch.setattr(realsize, "native_dtype", lambda: "float32")
    probed: list[torch.dtype] = []
    monkeypatch.setattr(realsize, "matmul_peak_flops",
                        lambda dtype: (probed.append(dtype), 123e9)[1])
    assert realsize.main(["--shapes", "tiny", "--concurrency", "2", "--transformers-requests",
                          "2", "--models", str(tmp_path / "models"), "--out",
                          str(tmp_path / "out"), "--kv-cache-gib", "0.05",
                          "--llama-cpp", str(llama_cpp), "--no-results-md"]) == 0
    out = capsys.readouterr().out
    assert "# memory: read " in out
    lines = {line.split(":")[0]: line for line in out.splitlines() if line.startswith("- ")}
    assert set(lines) == {"- load", "- lone request", "- llama.cpp", "- 2 requests"}, out
    assert lines["- llama.cpp"] == (
        f"- llama.cpp: not run ({llama_cpp}'s convert_hf_to_gguf.py failed: "
        "ERROR:hf-to-gguf:Model Qwen3ForCausalLM is not supported)")
    weights = 2 * sum(math.prod(s) for s in weight_shapes(shapes.SHAPES["tiny"]).values())
    assert f"({weights / 2**30:.2f} GiB of bf16 weights):" in out
    assert "x the weights" in lines["- load"] and "GB of weights a step" in lines["- lone request"]
    (kv_line, hf_line) = [line for line in out.splitlines() if line.startswith("- 2 requests")]
    assert "llama.cpp 0.0 (best" in kv_line  # no server given: kvbatch's half only
    # The ratios are of the unrounded figures: within 0.01 of the printed ones'.
    ours, theirs, ratio = (float(x) for x in re.findall(
        r"(\d+\.\d+) useful tok/s, transformers (\d+\.\d+) = (\d+\.\d+)x", hf_line)[0])
    assert ours > 0 and theirs > 0 and ratio == pytest.approx(ours / theirs, abs=0.01)
    (ceiling_line,) = [line for line in out.splitlines() if "the most any engine" in line]
    most, most_ratio = (float(x) for x in re.findall(
        r"(\d+\.\d+) useful tok/s = (\d+\.\d+)x transformers", ceiling_line)[0])
    assert most > 0 and most_ratio == pytest.approx(most / theirs, abs=0.01)
    (share,) = re.findall(r"kvbatch at (\d+)% of it$", ceiling_line)
    assert int(share) == pytest.approx(100 * ours / most, abs=1), ceiling_line
    assert re.search(r"the work, \d+\.\d\d TFLOP \(the shared prompt once\), at torch's "
                     r"best float32 GEMM here \(123 GFLOP/s\) = \d+\.\d s;", ceiling_line)
    assert probed == [torch.float32]


def test_the_ceiling_is_the_slower_of_memory_and_compute() -> None:
    """Requests of 5 and 9 tokens at 10 ms a lone step: 8 decode steps after the longest's
    first token, 0.08 s, for the workload's 14 useful tokens. Their work on a shape of 1,000
    weights a token, one layer of one query lane, a vocabulary of one: the shared prefix [7, 1]
    once, then 1 + 2 prompt tokens and 4 + 8 decode tokens (17 tokens of 2,000 FLOPs); the
    attention's 4 FLOPs a (query, key) pair over the runs (0, 2), (2, 1), (2, 2), (3, 4) and
    (4, 8): 3 + 3 + 7 + 22 + 68 pairs; an lm_head of 2 FLOPs for each of the 14 tokens."""
    from bench.realsize import ceiling, shared_prefix
    from bench.throughput import ModelShape
    from bench.workloads import Workload

    w = Workload("two", [[7, 1, 2], [7, 1, 3, 4]], [5, 9])
    shape = ModelShape(num_layers=1, hidden=1, q_size=1, vocab=1, params_per_token=1000,
                       kv_bytes_per_token=0)
    flops = 2000 * 17 + 4 * (3 + 3 + 7 + 22 + 68) + 2 * 14
    fast = ceiling(w, 10.0, shape, flop_s=1e6)  # 34,440 FLOPs take 0.034 s: memory bounds
    assert (fast.memory_s, fast.flops, fast.compute_s) == pytest.approx((0.08, flops, flops / 1e6))
    assert fast.useful_tok_s == pytest.approx(175.0)
    slow = ceiling(w, 10.0, shape, flop_s=1e5)  # 0.34 s: compute bounds
    assert slow.compute_s == pytest.approx(flops / 1e5)
    assert slow.useful_tok_s == pytest.approx(14 / (flops / 1e5))
    # Identical prompts share all but their last token, which each request computes for its
    # first output token: runs (0, 1), (1, 1) twice and (2, 1) twice.
    same = ceiling(Workload("same", [[5, 6], [5, 6]], [2, 2]), 1.0, shape, flop_s=1e6)
    assert same.flops == 2000 * 5 + 4 * (1 + 2 + 2 + 3 + 3) + 2 * 4
    assert [shared_prefix(p) for p in ([[1, 2], [1, 2, 3]], [[1, 2, 3], [1, 2]], [[1], [2]],
                                       [[1, 2], [1, 2]], [[5, 6]])] == [2, 2, 0, 2, 2]


def _decode_rows_on_a_tiny_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 *options: str) -> list[tuple[int, torch.dtype]]:
    """Runs bench/decode_rows.py on a tiny shape, 3 decode steps of 1 and of 3 rows, and checks
    that it put the row limits back. The rows and dtype of each step taken in one C call."""
    from bench import decode_rows, shapes
    from kernels import native

    monkeypatch.setitem(shapes.SHAPES, "tiny", dict(
        model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
        tie_word_embeddings=True, max_position_embeddings=1024))
    one_call_rows: list[tuple[int, torch.dtype]] = []
    run = native.DecodeLayers.__call__
    monkeypatch.setattr(native.DecodeLayers, "__call__", lambda self, x, *a: (
        one_call_rows.append((x.shape[0], x.dtype)), run(self, x, *a))[1])
    limits = dict(decode_rows.DEFAULTS)
    rows_by_dtype = [native.linear_max_rows(d) for d in (torch.float32, torch.bfloat16)]
    assert decode_rows.main(["--shape", "tiny", "--rows", "1", "3", "--tokens", "3",
                             "--repeats", "1", "--models", str(tmp_path / "models"),
                             *options]) == 0
    assert {name: getattr(native, name) for name in limits} == limits
    assert [native.linear_max_rows(d) for d in (torch.float32, torch.bfloat16)] == rows_by_dtype
    return one_call_rows


def test_decode_rows_on_a_tiny_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """bench/decode_rows.py: each row count timed with the one C call and layer by layer (the
    one call taken only in the first), the ratio of the two, and the row limits put back."""
    one_call_rows = _decode_rows_on_a_tiny_shape(tmp_path, monkeypatch)
    # decode steps of the "one call" engine only, in bf16 by default
    assert sorted(set(one_call_rows)) == [(1, torch.bfloat16), (3, torch.bfloat16)]
    assert len(one_call_rows) == 2 * 3  # 3 decode steps each, none from the torch engine
    rows = [line.split("|")[1:5] for line in capsys.readouterr().out.splitlines()
            if re.match(r"\| \d", line)]
    assert [int(r[0]) for r in rows] == [1, 3]
    for _, ours_ms, theirs_ms, ratio in rows:  # ms printed to 0.05, the ratio to 0.005
        ours, theirs = float(ours_ms), float(theirs_ms)
        slack = theirs / ours * (0.05 / ours + 0.05 / theirs) + 0.005
        assert abs(float(ratio.strip().rstrip("x")) - theirs / ours) <= slack


def test_decode_rows_one_call_rows_sets_the_one_calls_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--one-call-rows 2 (--dtype float32): the one-call engine takes the 1-row steps in one C
    call and the 3-row ones layer by layer, it says so, and the limits are put back."""
    one_call_rows = _decode_rows_on_a_tiny_shape(tmp_path, monkeypatch, "--one-call-rows", "2",
                                                 "--dtype", "float32")
    assert one_call_rows == [(1, torch.float32)] * 3
    assert "tiny, float32: C rows 2\n" in capsys.readouterr().out


@pytest.mark.parametrize(("against", "packed_calls"), [
    ("unpacked", [True] * 6 + [False] * 6),  # both engines run the one call, one packed
    ("layers", [True] * 6)])  # the baseline runs its steps layer by layer
def test_decode_rows_against_unpacked_or_layers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        against: str, packed_calls: list[bool]) -> None:
    """--against: the one call on packed weights (packing forced, so on any CPU) against the
    one call on the checkpoint's layout, or against layer by layer on packed weights."""
    from kernels import native

    monkeypatch.setattr(native, "packs_bf16", lambda: True)
    packed: list[bool] = []
    run = native.DecodeLayers.__call__
    monkeypatch.setattr(native.DecodeLayers, "__call__", lambda self, *a: (
        packed.append(self.packed), run(self, *a))[1])
    _decode_rows_on_a_tiny_shape(tmp_path, monkeypatch, "--against", against)
    assert packed == packed_calls
    out = capsys.readouterr().out
    assert {"unpacked": "| one C call, unpacked |", "layers": "| layer by layer, packed |"}[
        against] in out
    assert "tiny, bfloat16: C rows 192\n" in out  # the one call's limit on packed weights


TINY_AB_SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                     num_key_value_heads=2)


def _kernels_at_head() -> bool:
    """Whether the tree's kernels/ is HEAD's, so that kernel_ab against HEAD gives the same bits."""
    return subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "kernels/"],
                          cwd=Path(__file__).resolve().parents[2]).returncode == 0


@pytest.mark.parametrize("kind", ["bf16", "bf16-packed", "int8"])
def test_kernel_ab_against_head_on_a_tiny_shape(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """bench/kernel_ab.py: HEAD's kernel built from git beside the tree's, a row per row count,
    and the same bits where the tree's kernels are HEAD's."""
    from bench import kernel_ab, shapes

    monkeypatch.setitem(shapes.SHAPES, "tiny", {**TINY_AB_SHAPE, "head_dim": 16})
    assert kernel_ab.main(["--base", "HEAD", "--kind", kind, "--shape", "tiny", "--layers", "1",
                           "--rows", "1", "9", "--repeats", "1"]) == 0
    rows = [line.split("|")[1:6] for line in capsys.readouterr().out.splitlines()
            if re.match(r"\| \d", line)]
    assert [int(r[0]) for r in rows] == [1, 9]
    assert [r[1].split()[1] for r in rows] == ["GB/s", "GFLOP/s"]
    assert all(float(r[3].strip().rstrip("x")) > 0 for r in rows)
    if _kernels_at_head():
        assert [r[4].strip() for r in rows] == ["same", "same"]


def test_kernel_ab_compares_decode_attention(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/kernel_ab.py --kind attention: HEAD's cpu_decode.c against the tree's on the
    shape's heads, GB/s of K and V a row count, the same bits where kernels/ is unchanged."""
    from bench import kernel_ab, shapes

    monkeypatch.setitem(shapes.SHAPES, "tiny", {**TINY_AB_SHAPE, "head_dim": 32})
    assert kernel_ab.main(["--base", "HEAD", "--kind", "attention", "--shape", "tiny",
                           "--layers", "2", "--rows", "1", "3", "--context", "21",
                           "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 layers, 21 tokens a row in blocks of 8" in out
    rows = [line.split("|")[1:6] for line in out.splitlines() if re.match(r"\| \d", line)]
    assert [int(r[0]) for r in rows] == [1, 3]
    assert all(r[1].split()[1] == r[2].split()[1] == "GB/s" for r in rows)
    for _, base, tree, ratio, _ in rows:  # GB/s to 3 significant digits, the ratio to 0.005
        b, t = float(base.split()[0]), float(tree.split()[0])
        slack = t / b * 0.012 + 0.005
        assert abs(float(ratio.strip().rstrip("x")) - t / b) <= slack
    if _kernels_at_head():
        assert [r[4].strip() for r in rows] == ["same", "same"]
