"""`make bench-gpu` and `make gpu-check` on a machine without a GPU: the same code paths, on the CPU (the figures
they exist for come from a GPU node: docs/benchmarks.md)."""

import pytest
import torch

from hpctrain.tools import bench_gpu, gpu_check

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_bench_gpu_runs_hpctrain_variants_and_the_transformers_loop(tmp_path, capsys):
    # fp32: bf16 matmuls on a CPU without AVX512-BF16 are ~15x slower (tests/test_plan.py PEAK_BF16).
    doc = bench_gpu.main(["--model", "nano", "--precision", "fp32", "--seq-len", "64", "--micro-batch", "4",
                          "--grad-accum", "2", "--steps", "3", "--warmup", "1", "--variants", "eager,logits-loss",
                          "--out", str(tmp_path), "--json", str(tmp_path / "bench.json")])
    out = capsys.readouterr().out
    assert [r["side"] for r in doc["rows"]] == ["eager", "logits-loss", "transformers"], out
    for r in doc["rows"]:
        assert (r["micro_batch"], r["grad_accum"], len(r["step_times_s"])) == (4, 2, 3)
        assert r["tokens_per_s"] > 0 and r["final_loss"] > 0
    assert doc["global_batch"] == 8 and (tmp_path / "bench.json").exists()
    assert any("flash" in k for k in doc["attention_kernels"]), doc["attention_kernels"]  # CPU's flash kernel
    assert "vs transformers" in out and "1.00×" in out  # the baseline's own row
    bench_gpu.main(["--model", "nano", "--precision", "fp32", "--seq-len", "64", "--micro-batch", "4",
                    "--grad-accum", "1", "--steps", "2", "--warmup", "0", "--variants", "eager", "--no-transformers",
                    "--out", str(tmp_path)])
    assert (tmp_path / "run-eager" / "previous").is_dir()  # the earlier run moved aside, not deleted


@pytest.mark.parametrize("args,message", [
    (["--variants", "eager,fastest"], "--variants: unknown fastest"),
    (["--steps", "4", "--warmup", "4", "--micro-batch", "1"], "--warmup 4 must be >= 0 and below --steps 4"),
])
def test_bench_gpu_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(args)
    assert message in capsys.readouterr().err


@needs_cpu_only
def test_bench_gpu_needs_a_micro_batch_without_cuda(capsys):
    with pytest.raises(SystemExit):
        bench_gpu.parse_args([])
    assert "--micro-batch is needed without a CUDA device" in capsys.readouterr().err


@needs_cpu_only
def test_gpu_check_without_a_gpu_skips_each_test_with_its_reason(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    table = (tmp_path / "table.txt").read_text().splitlines()
    assert table[0].startswith("gpu-check: no CUDA device; torch ")
    rows = [line.split() for line in table[2:] if line.startswith("test_")]
    assert len(rows) >= 15 and all(r[1] == "skipped" for r in rows), table
    assert all(line.endswith("needs a CUDA GPU (run make gpu-check there)") for line in table[2:2 + len(rows)])
    assert f"0 passed, 0 failed, {len(rows)} skipped" in table and table[-1] == "throughput run: skipped (no CUDA device)"


def test_out_of_memory_retries_smaller_micro_batches_of_the_same_global_batch(capsys):
    tried = []

    def attempt(mb):
        tried.append(mb)
        if mb > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return mb

    assert bench_gpu._shrinking_on_oom("x", 28, 7, attempt) == 2 and tried == [7, 2]  # 3 does not divide 28
    tried.clear()
    with pytest.raises(torch.OutOfMemoryError):
        bench_gpu._shrinking_on_oom("x", 8, 8, lambda mb: attempt(mb + 5))
    assert "x: micro-batch 8 ran out of memory; trying 4" in capsys.readouterr().out
