"""``DecoderLMModule``: the LightningModule that ``qmuon-train`` trains, with the optimizer as data.

Why the optimizer is a spec and not an object: under FSDP2 the module's parameters are replaced by
sharded DTensors in ``configure_model``. An optimizer built before that (what LightningCLI's
automatic ``optimizer:`` section does) would hold the unsharded tensors. So the YAML describes the
optimizer (:class:`OptimizerSpec`) and :meth:`DecoderLMModule.configure_optimizers`, which Lightning
calls after sharding, builds it from ``self.model``'s current parameters.

Optimizers (``OptimizerSpec.name``):

``qmuon``
    :func:`qmuon.build_optimizer` with the section's options (it is a :class:`~qmuon.QMuonConfig`):
    Muon with ``state_format`` momentum for hidden matrices (fused qkv / gate_up as parts), auxiliary
    AdamW for embeddings, head, norms.
``torch_muon``
    the fp32 baseline: ``torch.optim.Muon`` for the same hidden matrices (fused matrices as one
    matrix, as torch does it) plus ``torch.optim.AdamW`` for the rest, in one
    :class:`MuonWithAdamW` so Lightning's automatic optimization and LR schedulers see one optimizer.
``adamw``
    ``torch.optim.AdamW`` for every parameter (``adamw_lr``; no weight decay on 1-D parameters).

The schedule multiplies every group's learning rate by a factor: linear warmup over
``warmup_steps``, then cosine decay to ``min_lr_ratio`` at the last step (``schedule="cosine"``) or
a constant 1 (``"constant"``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer

import lightning as L

from qmuon.core.apply import weight_state_init
from qmuon.core.config import DEFAULT_CONFIG, QMuonConfig
from qmuon.core.variants import row_moment_nbytes
from qmuon.optim.routing import build_optimizer, route_parameters
from qmuon.quant import adamw as qadamw
from qmuon.quant import state as qstate
from .decoder_lm import DecoderLM, DecoderLMConfig, _rope_tables

__all__ = ["OptimizerSpec", "DecoderLMModule", "MuonWithAdamW", "memory_budget"]

OPTIMIZER_NAMES = ("qmuon", "torch_muon", "adamw")
#: Options only QMuon has: a torch baseline refuses a value other than the default.
_QMUON_ONLY = ("state_format", "adamw_state_format", "bf16_update", "gradient_release", "qk_clip")


@dataclass(frozen=True)
class OptimizerSpec(QMuonConfig):
    """``qmuon-train``'s optimizer section: :class:`~qmuon.QMuonConfig` itself (the same option
    names, defaults, checks and documentation; ``--print_config`` shows them) plus which optimizer
    to build and the learning-rate schedule.

    Args:
        name: ``"qmuon"``, or a torch baseline for comparisons: ``"torch_muon"`` (``torch.optim.Muon``
            + ``torch.optim.AdamW``, reading ``lr``, ``weight_decay``, ``momentum``, ``adamw_lr``,
            ``adamw_weight_decay``, ``newton_schulz.steps`` and ``update``'s Nesterov, lr adjustment,
            AdamW betas and eps) or ``"adamw"`` (``torch.optim.AdamW`` for every parameter, with the
            ``adamw_*`` options).
        schedule: ``"cosine"`` (warmup, then cosine to ``min_lr_ratio``) or ``"constant"`` (warmup, then 1).
        warmup_steps: linear warmup length in optimizer steps.
        min_lr_ratio: the cosine schedule's final factor.
    """

    name: Literal["qmuon", "torch_muon", "adamw"] = "qmuon"
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(f"optimizer.name must be one of {OPTIMIZER_NAMES}, got {self.name!r}")
        if self.name != "qmuon":
            changed = [k for k in _QMUON_ONLY if getattr(self, k) != getattr(DEFAULT_CONFIG, k)]
            if changed:
                raise ValueError(f"optimizer.{', optimizer.'.join(changed)}: QMuon options; optimizer.name="
                                 f"{self.name!r} is a torch baseline. Use name='qmuon' for them")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"optimizer.schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("optimizer.warmup_steps must be >= 0 and optimizer.min_lr_ratio in [0, 1]")

    @property
    def resolved_state_format(self) -> str:
        """Momentum format of the Muon matrices (``fp32`` for the torch baselines)."""
        return self.state_format if self.name == "qmuon" else "fp32"


class MuonWithAdamW(Optimizer):
    """``torch.optim.Muon`` for 2-D hidden matrices + ``torch.optim.AdamW`` for the rest, as one optimizer.

    Both inner optimizers share this optimizer's ``param_groups`` (Muon's first, each group tagged
    ``use_muon``) and one ``state`` dict (their parameters are disjoint), so LR schedulers,
    ``state_dict()`` / ``load_state_dict()`` and Lightning's optimizer handling see one ordinary
    optimizer. ``step(closure)`` evaluates the closure once, then steps both.
    """

    def __init__(self, muon_groups: list[dict[str, Any]], adamw_groups: list[dict[str, Any]], *,
                 lr: float, weight_decay: float, momentum: float, nesterov: bool, ns_steps: int,
                 adjust_lr_fn: str | None, adamw_lr: float, adamw_betas: tuple[float, float], adamw_eps: float,
                 adamw_weight_decay: float) -> None:
        if not muon_groups or not adamw_groups:
            raise ValueError("MuonWithAdamW needs at least one Muon group and one AdamW group")
        self.muon = torch.optim.Muon([dict(g, use_muon=True) for g in muon_groups], lr=lr, weight_decay=weight_decay,
                                     momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self.adamw = torch.optim.AdamW([dict(g, use_muon=False) for g in adamw_groups], lr=adamw_lr,
                                       betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        super().__init__([{"params": []}], {})
        self._link(self.muon.param_groups + self.adamw.param_groups, self.muon.state)

    def _link(self, groups: list[dict[str, Any]], state: Any) -> None:
        n = len(self.muon.param_groups)
        self.param_groups = groups
        self.muon.param_groups, self.adamw.param_groups = groups[:n], groups[n:]
        self.state = self.muon.state = self.adamw.state = state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # replaces self.state / self.param_groups: re-share them
        self._link(self.param_groups, self.state)


def _adamw_groups(decisions: list[Any], params: dict[str, nn.Parameter], wd: float) -> list[dict[str, Any]]:
    decay = [d.name for d in decisions if d.target in ("adamw", "muon") and len(d.shape) >= 2]
    no_decay = [d.name for d in decisions if d.target != "frozen" and d.name not in decay]
    groups = []
    for names, w in ((decay, wd), (no_decay, 0.0)):
        if names:
            groups.append({"params": [params[n] for n in names], "param_names": names, "weight_decay": w})
    return groups


def build_lm_optimizer(model: nn.Module, spec: OptimizerSpec, *, verbose: bool = False) -> Optimizer:
    """Build ``spec``'s optimizer over ``model``'s current parameters (call after sharding)."""
    if spec.name == "qmuon":
        return build_optimizer(model, spec, verbose=verbose)
    decisions = route_parameters(model)
    params = dict(model.named_parameters())
    upd = spec.update
    if spec.name == "adamw":
        return torch.optim.AdamW(_adamw_groups(decisions, params, spec.adamw_weight_decay), lr=spec.adamw_lr,
                                 betas=tuple(upd.adamw_betas), eps=upd.adamw_eps)
    muon = [d.name for d in decisions if d.target == "muon"]
    rest = [d for d in decisions if d.target in ("adamw", "adamw_no_decay")]
    return MuonWithAdamW(
        [{"params": [params[n] for n in muon], "param_names": muon}], _adamw_groups(rest, params, spec.adamw_weight_decay),
        lr=spec.lr, weight_decay=spec.weight_decay, momentum=spec.momentum, nesterov=upd.nesterov,
        ns_steps=spec.newton_schulz.steps, adjust_lr_fn=upd.adjust_lr_fn, adamw_lr=spec.adamw_lr,
        adamw_betas=tuple(upd.adamw_betas), adamw_eps=upd.adamw_eps, adamw_weight_decay=spec.adamw_weight_decay,
    )


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str = "cosine", min_lr_ratio: float = 0.1) -> float:
    """Multiplier of the base learning rates at optimizer step ``step`` (0-based).

    Warmup: ``(step + 1) / warmup_steps`` (never 0, so the first step moves). Cosine:
    ``min + (1 - min) * (1 + cos(pi * t)) / 2`` with ``t`` going from 0 after warmup to 1 at
    ``total_steps - 1``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - 1 - warmup_steps)
    t = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


class DecoderLMModule(L.LightningModule):
    """A :class:`~qmuon_lightning.models.DecoderLM` trained on next-token cross-entropy.

    Model size arguments are those of :class:`~qmuon_lightning.models.DecoderLMConfig` (checked
    here, so a bad size fails when the config is parsed, not after the data loaded). The network
    itself is built in :meth:`configure_model`, i.e. inside the strategy's init context: on the
    meta device for a parameter count, sharded with FSDP2 ``fully_shard`` (per block, then the
    root) when the strategy gives a data-parallel device mesh.

    Args:
        vocab_size, d_model, n_layers, n_heads, n_kv_heads, mlp_hidden, max_seq_len, rope_theta,
            init_std: the model (``max_seq_len`` is linked to ``data.seq_len`` by ``qmuon-train``).
        optimizer: what to build in :meth:`configure_optimizers` (:class:`OptimizerSpec`).
        reshard_after_forward: FSDP2: free gathered block weights after forward (saves memory,
            costs a second all-gather in backward).
        activation_checkpointing: run each block under ``torch.utils.checkpoint`` (non-reentrant):
            keep only the blocks' inputs and recompute one block's activations at a time in
            backward (one more forward of the blocks per step; same losses and gradients bit for bit).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        mlp_hidden: int | None = None,
        max_seq_len: int = 1024,
        rope_theta: float = 10000.0,
        init_std: float = 0.02,
        optimizer: OptimizerSpec | None = None,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.optimizer_spec = optimizer if optimizer is not None else OptimizerSpec()
        if isinstance(self.optimizer_spec, dict):  # e.g. from a checkpoint's hparams
            self.optimizer_spec = OptimizerSpec(**self.optimizer_spec)
        self.config = DecoderLMConfig(
            vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
            mlp_hidden=mlp_hidden, max_seq_len=max_seq_len, rope_theta=rope_theta, init_std=init_std,
            activation_checkpointing=activation_checkpointing,
        )
        self.reshard_after_forward = reshard_after_forward
        hp = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                  mlp_hidden=mlp_hidden, max_seq_len=max_seq_len, rope_theta=rope_theta, init_std=init_std,
                  optimizer=asdict(self.optimizer_spec), reshard_after_forward=reshard_after_forward,
                  activation_checkpointing=activation_checkpointing)
        self.save_hyperparameters(hp)
        self.model: DecoderLM | None = None

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = DecoderLM(self.config)
        mesh = self._data_parallel_mesh()
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
            fully_shard(self.model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        if any(t.is_meta for t in self.model.parameters()) and self._trainer is not None:
            self._materialize(self.trainer.strategy.root_device)

    def _data_parallel_mesh(self) -> Any:
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None:
            return None
        names = mesh.mesh_dim_names or ()
        dp = mesh["data_parallel"] if "data_parallel" in names else (mesh if mesh.ndim == 1 else None)
        return dp if dp is not None and dp.size() > 1 else None

    @torch.no_grad()
    def _materialize(self, device: torch.device) -> None:
        """Allocate a meta-built model on ``device`` and initialize it as :class:`DecoderLM` does.

        Lightning's generic materialization calls every submodule's own ``reset_parameters``
        (``nn.Linear``: Kaiming, ``nn.Embedding``: N(0, 1)) after the model's, overriding the
        model's GPT-style init, and leaves the rotary tables (buffers) uninitialized; so this
        module does it itself.
        """
        assert self.model is not None
        self.model.to_empty(device=device)
        self.model.reset_parameters()
        cos, sin = _rope_tables(self.config, device)
        self.model.rope_cos.copy_(cos)
        self.model.rope_sin.copy_(sin)

    def forward(self, idx: Tensor) -> Tensor:
        assert self.model is not None, "configure_model() has not run"
        return self.model(idx)

    def num_parameters(self) -> int:
        """Parameter count of the full (unsharded) model."""
        assert self.model is not None, "configure_model() has not run"
        return sum(p.numel() for p in self.model.parameters())

    # ------------------------------------------------------------------ steps
    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    # ------------------------------------------------------------------ optimizer
    def configure_optimizers(self) -> Any:
        assert self.model is not None, "configure_model() has not run"
        spec = self.optimizer_spec
        opt = build_lm_optimizer(self.model, spec)  # the routing table: the qmuon logger (qmuon-train shows it)
        total = self._total_steps()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(
            step, warmup_steps=spec.warmup_steps, total_steps=total, schedule=spec.schedule,
            min_lr_ratio=spec.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "name": "lr"}}

    def _total_steps(self) -> int:
        if self._trainer is None:
            return max(1, self.optimizer_spec.warmup_steps)
        if self.trainer.max_steps > 0:
            return int(self.trainer.max_steps)
        est = self.trainer.estimated_stepping_batches
        if not math.isfinite(est):
            raise ValueError("set trainer.max_steps (or a finite max_epochs) so the cosine schedule knows its length")
        return int(est)


def memory_budget(module: DecoderLMModule, *, batch_size: int, seq_len: int, precision: str = "bf16-mixed",
                  world_size: int = 1) -> dict[str, float]:
    """Bytes per device of weights, gradients and optimizer state, and an activation estimate.

    Exact for weights / gradients / state: every parameter of the meta-built model is counted with
    the optimizer's per-tensor state (QMuon: the format's tensors plus a 4-byte ``step`` per Muon
    matrix, :func:`qmuon.quant.state.momentum_nbytes`; AdamW: 8 bytes per element plus a
    4-byte ``step`` per tensor; torch Muon: 4 bytes per element). ``tests/test_recipes.py``
    checks the count against the state of a real optimizer after one step. With FSDP every term but activations is divided by ``world_size`` (shards of
    dim 0; the uneven remainder is ignored). ``precision``: ``"bf16-true"`` keeps bf16 weights and
    gradients (2 + 2 bytes; QMuon adds the ``bf16_update`` rule's correction state: 1 byte per
    element under ``"ecc8"``), anything else fp32 (4 + 4) with bf16 autocast.

    Activations: the peak of :func:`qmuon_lightning.memory.decoder_activations` (the tensors
    DecoderLM's ops keep for backward at ``precision``, with or without the module's
    ``activation_checkpointing``; held to ``MemTracker`` in ``tests/test_activation_checkpointing.py``).
    """
    if module.model is None:
        with torch.device("meta"):
            module.configure_model()
    assert module.model is not None
    spec, cfg = module.optimizer_spec, module.config
    n_params = sum(p.numel() for p in module.model.parameters())
    wbytes = 2 if precision.startswith("bf16-true") or precision == "bf16" else 4
    state = 0
    adamw_family = spec.adamw_state_format
    if spec.name == "adamw":
        state = sum(8 * p.numel() + 4 for p in module.model.parameters())  # exp_avg, exp_avg_sq, 0-d fp32 step
    else:
        fmt = spec.resolved_state_format
        st = spec.state
        opts = qstate.FormatOptions(
            block_size=st.block_size if st.block_size is not None else qstate.get_format(fmt).default_block_size,
            rank=st.rank, grid_block=st.grid_block)
        for d in route_parameters(module.model):
            n = int(torch.Size(d.shape).numel())
            if d.target == "muon":
                if spec.name == "torch_muon":
                    state += 4 * n
                else:
                    state += qstate.momentum_nbytes(fmt, d.shape[0], int(n // d.shape[0]), opts) + 4
                    if spec.update.variant == "normuon":  # the per-output-row fp32 second moment
                        state += row_moment_nbytes(tuple(d.shape), d.parts, d.parts_axis, d.orientation)
            elif d.target != "frozen":
                if spec.name == "torch_muon":
                    state += 8 * n + 4
                else:  # QMuon's AdamW moments in their family (fp32 for tensors under 4096 elements)
                    st = qadamw.init_adamw_state(adamw_family, d.shape, d.shape, torch.device("meta"))
                    state += sum(t.numel() * t.element_size() for t in st.values())
            if wbytes == 2 and spec.name == "qmuon" and d.target != "frozen":
                # bf16 weights: the write rule's correction state (ecc8: one int8 code per element)
                ws = weight_state_init(torch.empty(d.shape, dtype=torch.bfloat16, device="meta"), spec.bf16_update)
                state += sum(t.numel() * t.element_size() for t in ws.values())
    from .activations import decoder_activations

    act = decoder_activations(cfg, batch_size, seq_len, precision=precision).peak
    out = {
        "parameters": float(n_params),
        "weights": wbytes * n_params / world_size,
        # with gradient release one gradient is in flight at a time (the largest)
        "gradients": wbytes * (max(p.numel() for p in module.model.parameters()) if spec.gradient_release
                               else n_params) / world_size,
        "optimizer_state": state / world_size,
        "activations_estimate": float(act),
    }
    out["total"] = out["weights"] + out["gradients"] + out["optimizer_state"] + out["activations_estimate"]
    return out
