"""Telemetry of ``TrainSummary`` (``qmuon_lightning.callbacks.telemetry``): the FLOPs formula against a
hand count and torch's own FLOP counter, the peak table, the gradient norm against a direct
computation (also across FSDP2 shards), and the per-step metrics in a Lightning logger."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from torch import nn

import lightning as L

from qmuon_lightning.callbacks.summary import TrainSummary
from qmuon_lightning.callbacks.telemetry import (model_flops_per_token, peak_bf16_flops, total_grad_norm,
                                                 transformer_flops_per_token)
from qmuon_lightning.models.lm_module import DecoderLMModule, OptimizerSpec

from _dist import run_workers

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*LeafSpec", "ignore:.*does not have many workers", "ignore:.*GPU available but not used",
    "ignore:.*smaller than the logging interval")


def _tiny(**kw) -> DecoderLMModule:
    torch.manual_seed(0)
    m = DecoderLMModule(vocab_size=256, d_model=64, n_layers=2, n_heads=4, mlp_hidden=128, max_seq_len=32, **kw)
    m.configure_model()
    return m


def test_flops_per_token_matches_a_hand_count_and_torch_flop_counter():
    m = _tiny()
    T = 32
    # By hand, from the layer shapes (d 64, 2 layers, 4 heads, SwiGLU hidden 128, vocabulary 256):
    # per layer qkv 64x192 + proj 64x64 + gate_up 64x256 + down 128x64 + two norms of 64;
    # then the final norm (64) and the untied head 64x256. The input embedding is excluded.
    per_layer = 64 * 192 + 64 * 64 + 64 * 256 + 128 * 64 + 2 * 64
    n = 2 * per_layer + 64 + 64 * 256
    assert n == 98_624
    attention = 12 * 2 * 64 * T  # 12 L d_attn T
    assert transformer_flops_per_token(n, 2, 64, T) == 6 * n + attention == 640_896
    assert model_flops_per_token(m, T) == 640_896

    # torch's FLOP counter over one forward + backward (SDPA's math path, so attention is bmm):
    # every matmul and attention FLOP; the formula's only extra is 6 x the 320 norm gains.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    B = 2
    x = torch.randint(0, 256, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        m._loss((x, x)).backward()
    norm_params = 2 * 2 * 64 + 64
    assert counter.get_total_flops() / (B * T) == model_flops_per_token(m, T) - 6 * norm_params

    # A tied embedding counts once (as the head), an unknown shape gives None.
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.config = type("C", (), {"num_hidden_layers": 1, "hidden_size": 4})()

    assert model_flops_per_token(Tied(), 8) == 6 * 40 + 12 * 1 * 4 * 8
    assert model_flops_per_token(nn.Linear(3, 3), 8) is None


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA GB10", 125.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_table_by_device_name(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    got_name, peak = peak_bf16_flops(torch.device("cuda", 0))
    assert got_name == name
    assert peak == (tflops * 1e12 if tflops else None)
    assert peak_bf16_flops(torch.device("cpu")) == ("cpu", None)


class _GradNormRecorder(L.Callback):
    """The gradient norm computed directly (sqrt of the sum of squares), for comparison."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        sq = sum(float(p.grad.double().pow(2).sum()) for p in pl_module.parameters() if p.grad is not None)
        self.norms.append(math.sqrt(sq))


def _fit(tmp_path, summary: TrainSummary, steps: int = 3) -> tuple[L.Trainer, _GradNormRecorder]:
    from lightning.pytorch.loggers import CSVLogger

    recorder = _GradNormRecorder()
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1,
                        callbacks=[recorder, summary], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0)
    return trainer, recorder


def test_summary_on_a_lightning_demo_model_logs_grad_norm_and_memory(tmp_path):
    """Lightning's own BoringModel: unknown shape (FLOPs and MFU n/a), grad norm == the direct one."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    summary = TrainSummary(filename="summary")
    trainer, recorder = _fit(tmp_path, summary)
    trainer.fit(BoringModel())
    s = summary.summary
    assert s["grad_norm_steps"] == 3
    assert [s["grad_norm_final"], s["grad_norm_max"]] == pytest.approx([recorder.norms[-1], max(recorder.norms)], rel=1e-6)
    assert s["flops_per_token"] is None and s["mfu"] is None
    assert s["peak_memory_kind"] == "rss" and s["peak_memory_rss_bytes"] > 10 * 2**20  # torch alone is larger
    table = TrainSummary.table(s)
    assert "MFU                n/a" in table and "grad norm" in table and "RSS" in table
    rows = list(csv.DictReader(open(next(tmp_path.glob("csv/version_*/metrics.csv")))))
    logged = [float(r["grad_norm"]) for r in rows if r.get("grad_norm")]
    assert logged == pytest.approx(recorder.norms, rel=1e-6)
    assert all(float(r["memory/peak_rss_gib"]) > 0 for r in rows if r.get("memory/peak_rss_gib"))


def test_summary_mfu_with_a_given_peak(tmp_path):
    """On CPU with summary.peak_tflops given: MFU = model FLOP/s per device / peak, from the logged parts."""
    module = DecoderLMModule(d_model=32, n_layers=1, n_heads=2, max_seq_len=16,
                             optimizer=OptimizerSpec(name="qmuon", warmup_steps=1))

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, 256, (12, 16), generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=4)

    summary = TrainSummary(filename=None, peak_tflops=0.5)
    trainer, recorder = _fit(tmp_path, summary)
    trainer.fit(module, datamodule=Data())
    s = summary.summary
    expected_fpt = model_flops_per_token(module, 16)
    assert s["flops_per_token"] == expected_fpt and s["flops_seq_len"] == 16
    assert s["model_tflops_per_device"] == pytest.approx(expected_fpt * s["tokens_per_s"] / 1e12)
    assert s["mfu"] == pytest.approx(s["model_tflops_per_device"] / 0.5)
    assert s["grad_norm_final"] == pytest.approx(recorder.norms[-1], rel=1e-6)
    assert 0 < s["optimizer_step_share"] < 1
    # int8 momentum: 1 B per element plus scales and a step per matrix, about a quarter of fp32's 4 B.
    assert s["muon_state_bytes_per_param"] == s["state_bytes_muon"] / s["muon_parameters"]
    assert 1.0 < s["muon_state_bytes_per_param"] < 1.25
    assert "MFU                " + f"{100 * s['mfu']:.3g}% of 0.5 TFLOP/s" in TrainSummary.table(s)
    rows = list(csv.DictReader(open(next(tmp_path.glob("csv/version_*/metrics.csv")))))
    mfu = [float(r["perf/mfu_percent"]) for r in rows if r.get("perf/mfu_percent")]
    tflops = [float(r["perf/model_tflops"]) for r in rows if r.get("perf/model_tflops")]
    assert len(mfu) == 3 and mfu == pytest.approx([100 * t / 0.5 for t in tflops], rel=1e-5)
    with pytest.raises(ValueError, match="peak_tflops"):
        TrainSummary(peak_tflops=0)


def _sharded_grad_norm(rank: int, world_size: int) -> tuple[float, float]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))
    model.load_state_dict(ref.state_dict())
    fully_shard(model)  # every parameter a DTensor sharded on dim 0 over the 2 ranks
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # the same batch on both ranks
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert all(hasattr(p.grad, "to_local") for p in model.parameters())
    return total_grad_norm(model.parameters()), total_grad_norm(ref.parameters())


@pytest.mark.slow
def test_total_grad_norm_across_fsdp2_shards():

    results = run_workers(_sharded_grad_norm, world_size=2)
    for sharded, full in results:
        # fp32 sums in a different order: relative 1e-6 covers the rounding.
        assert sharded == pytest.approx(full, rel=1e-6)
