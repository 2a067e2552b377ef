"""``qmuon-estimate`` (entry point :func:`qmuon_lightning.cli.estimate_main`): will this model's training step fit? (also ``qmuon-train fit ... --estimate_memory``)

Builds the model on the meta device (nothing is allocated), routes it as
:func:`~qmuon_lightning.build_optimizer` does, and prints weights / gradients / optimizer state /
step temporaries per optimizer configuration (:data:`qmuon_lightning.memory.STANDARD_SETUPS`, plus
the recipe's own optimizer), and, with ``--budget``, the largest model of that shape (more layers,
or a wider model with ``--grow width``) whose step fits::

    qmuon-estimate --config recipes/gb10/base.yaml --config recipes/gb10/gpt350m_int8.yaml --budget 128GiB
    qmuon-estimate --config recipes/gb10/gpt350m_int8.yaml --model.n_layers=48       # dotted overrides
    qmuon-estimate --hf_config path/to/config.json --budget 128GiB                     # a local HF config
    qmuon-train fit --config recipes/gb10/base.yaml --config recipes/gb10/gpt350m_int8.yaml --estimate_memory

The table follows ``accelerate estimate-memory``: a titled box, one row per configuration, sizes
in powers of 1024. Activations are not included (they depend on the batch; for DecoderLM recipes
their peak, with and without activation checkpointing, is printed below the table:
:func:`qmuon_lightning.memory.decoder_activations`); on a GPU leave ~1-3 GiB of the budget
for the CUDA context and the allocator's slack. The model behind the numbers:
:mod:`qmuon_lightning.memory` and ``docs/memory.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import memory as mem

__all__ = ["run"]


# ------------------------------------------------------------------------------------ models
def recipe_model(cfg: dict[str, Any], vocab_size: int | None = None) -> tuple[Callable[..., nn.Module], dict[str, Any]]:
    """``(build, shape)``: ``build(**changes)`` makes the recipe's DecoderLM on the meta device
    (``changes``: ``n_layers=...``, ``d_model=...``, ...); ``shape``: the model's arguments."""
    from .data import ByteLMDataModule
    from .models.decoder_lm import DecoderLM, DecoderLMConfig

    kw = {k: v for k, v in cfg["model"].items() if k in DecoderLMConfig.__dataclass_fields__}
    kw["max_seq_len"] = cfg["data"]["seq_len"]
    if vocab_size is None:
        try:
            vocab_size = ByteLMDataModule(**cfg["data"]).vocab_size
        except (ValueError, FileNotFoundError, OSError) as e:
            raise SystemExit(f"qmuon-estimate: cannot resolve the recipe's vocabulary ({e}); pass --vocab_size") from None
    kw["vocab_size"] = int(vocab_size)

    def build(**changes: Any) -> nn.Module:
        with torch.device("meta"):
            return DecoderLM(DecoderLMConfig(**{**kw, **changes}))

    return build, kw


def hf_model(path: str) -> tuple[Callable[..., nn.Module], dict[str, Any]]:
    """``(build, shape)`` of a local Hugging Face config (a ``config.json`` or its folder; no
    download), built with ``AutoModelForCausalLM.from_config`` on the meta device."""
    try:
        import transformers
    except ImportError:  # pragma: no cover - optional dependency
        raise SystemExit("qmuon-estimate --hf_config needs transformers: pip install transformers") from None
    p = Path(path)
    config = transformers.AutoConfig.from_pretrained(str(p.parent if p.is_file() else p), local_files_only=True)
    base = config.to_dict()

    def build(**changes: Any) -> nn.Module:
        c = copy.deepcopy(config)
        for k, v in changes.items():
            setattr(c, k, v)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(c)

    return build, base


def recipe_setup(cfg: dict[str, Any]) -> mem.Setup | None:
    """The recipe's own optimizer as a :class:`~qmuon_lightning.memory.Setup`."""
    spec = dict(cfg.get("model", {}).get("optimizer") or {})
    if not spec:
        return None
    name = spec.get("name", "qmuon")
    weights = "bf16" if str(cfg.get("trainer", {}).get("precision", "")).startswith("bf16-true") else "fp32"
    if name in ("adamw", "torch_muon"):
        return mem.Setup(f"recipe ({name})", name, {}, weights)
    from qmuon.core.config import QMuonConfig

    opts = {k: v for k, v in spec.items() if k in QMuonConfig.field_names() and k not in ("lr", "weight_decay")}
    fmt = QMuonConfig.from_kwargs(opts).state_format
    return mem.Setup(f"recipe ({name}, {fmt})", "qmuon", opts, weights)


# ------------------------------------------------------------------------------------ growth
def _depth_key(shape: dict[str, Any]) -> str:
    for k in ("n_layers", "num_hidden_layers", "n_layer", "num_layers"):
        if k in shape:
            return k
    raise SystemExit("qmuon-estimate: cannot find the model's layer count to grow its depth; use --grow width")


def _width_changes(shape: dict[str, Any], k: int) -> dict[str, Any]:
    """A model ``k`` attention heads wide, with the head size, the MLP ratio and the grouped-query
    ratio of ``shape`` kept (DecoderLM or a Llama-style HF config)."""
    if "d_model" in shape:  # DecoderLM
        head = shape["d_model"] // shape["n_heads"]
        out: dict[str, Any] = {"d_model": k * head, "n_heads": k}
        kv = shape.get("n_kv_heads")
        if kv:
            out["n_kv_heads"] = max(1, k * kv // shape["n_heads"])
        if shape.get("mlp_hidden"):
            out["mlp_hidden"] = 64 * max(1, round(shape["mlp_hidden"] * k / shape["n_heads"] / 64))
        return out
    heads = shape["num_attention_heads"]
    head = shape.get("head_dim") or shape["hidden_size"] // heads
    out = {"hidden_size": k * head, "num_attention_heads": k}
    if shape.get("num_key_value_heads"):
        out["num_key_value_heads"] = max(1, k * shape["num_key_value_heads"] // heads)
    if shape.get("intermediate_size"):
        out["intermediate_size"] = 64 * max(1, round(shape["intermediate_size"] * k / heads / 64))
    return out


def _grower(build: Callable[..., nn.Module], shape: dict[str, Any], grow: str) -> tuple[Callable[[int], Any], str, int]:
    """``(inventory or model at size k, what k counts, k of the given model)``."""
    if grow == "depth":
        key = _depth_key(shape)
        return mem.depth_inventories(lambda k: build(**{key: k})), "layers", int(shape[key])
    heads = shape.get("n_heads", shape.get("num_attention_heads"))
    return (lambda k: build(**_width_changes(shape, k))), "attention heads (width)", int(heads)


# ------------------------------------------------------------------------------------ main
def _describe(model: nn.Module, inv: mem.Inventory, shape: dict[str, Any]) -> str:
    layers = shape.get("n_layers", shape.get("num_hidden_layers"))
    width = shape.get("d_model", shape.get("hidden_size"))
    vocab = shape.get("vocab_size")
    return (f"{type(model).__name__}: width {width}, {layers} layers, vocabulary {vocab}; {inv.n_params:,} parameters, "
            f"{inv.n_muon:,} ({inv.n_muon / max(1, inv.n_params):.0%}) in Muon matrices")


def run(argv: Sequence[str] | None, merge_recipe: Callable[[Sequence[str], Sequence[str]], dict[str, Any]]) -> dict[str, Any]:
    """Parse ``argv``, estimate, print the table; returns the numbers. ``merge_recipe(configs,
    overrides)``: the merged ``qmuon-train fit`` config (:func:`qmuon_lightning.cli.merged_config`)."""
    ap = argparse.ArgumentParser(
        prog="qmuon-estimate", description=__doc__.split("\n\n")[0],
        epilog="Other --key=value arguments are passed to the recipe parser (e.g. --model.n_layers=40).")
    ap.add_argument("--config", action="append", default=[], help="a qmuon-train recipe (repeat to merge, as qmuon-train)")
    ap.add_argument("--hf_config", help="a local Hugging Face config.json (or its folder) instead of a recipe")
    ap.add_argument("--vocab_size", type=int, help="vocabulary when the recipe's data cannot resolve it here")
    ap.add_argument("--budget", help="memory per device, e.g. 128GiB (a GB10), 80GB, 24GiB")
    ap.add_argument("--grow", choices=("depth", "width"), default="depth",
                    help="how the largest model within --budget grows: more layers (default) or more heads")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="where the step runs: picks torch's AdamW path and QMuon's NS dtype (default cuda)")
    ap.add_argument("--setups", help="comma-separated labels of the configurations to show (default: all)")
    ap.add_argument("--json", dest="json_out", help="also write the numbers to this JSON file")
    args, rest = ap.parse_known_args(argv)
    if bool(args.config) == bool(args.hf_config):
        ap.error("give either --config (a qmuon-train recipe, repeatable) or --hf_config")
    cfg: dict[str, Any] = {}
    if args.hf_config:
        if rest:
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
        build, shape = hf_model(args.hf_config)
        name = Path(args.hf_config).name
    else:
        cfg = merge_recipe(args.config, rest)
        build, shape = recipe_model(cfg, args.vocab_size)
        name = " + ".join(Path(c).name for c in args.config)
    setups = list(mem.STANDARD_SETUPS)
    own = recipe_setup(cfg) if cfg else None
    if own is not None:
        setups.insert(0, own)
    if args.setups:
        wanted = [s.strip() for s in args.setups.split(",") if s.strip()]
        known = {s.label: s for s in setups}
        bad = [w for w in wanted if w not in known]
        if bad:
            ap.error(f"unknown --setups {bad}; choose from: {', '.join(known)}")
        setups = [known[w] for w in wanted]
    budget = mem.parse_bytes(args.budget) if args.budget else None

    model = build()
    inv = mem.parameter_inventory(model)
    ests = [mem.estimate(inv, s, device=args.device) for s in setups]
    base = next((e for e in ests if e.setup.optimizer == "adamw" and e.available), None)
    grow_fn, unit, k0 = _grower(build, shape, args.grow)
    largest: dict[str, tuple[int, mem.MemoryEstimate | None]] = {}
    if budget is not None:
        for e in ests:
            if e.available:
                largest[e.setup.label] = mem.largest_within(grow_fn, e.setup, budget, device=args.device)

    headers = ["Optimizer", "Weights", "Grads", "Optimizer state", "Step temporaries", "Total", "B/param"]
    if base is not None:
        headers.append("vs AdamW")
    if budget is not None:
        headers += [f"Largest ({unit})", "Params there"]
    rows: list[list[str]] = [headers]
    for e in ests:
        if not e.available:
            rows.append([e.setup.label] + ["n/a"] * (len(headers) - 1))
            continue
        row = [e.setup.label, mem.format_bytes(e.weights + e.buffers), mem.format_bytes(e.grads),
               mem.format_bytes(e.state), mem.format_bytes(e.temporaries), mem.format_bytes(e.total),
               f"{e.bytes_per_param:.2f}"]
        if base is not None:
            row.append(f"{e.total / base.total:.2f}x")
        if budget is not None:
            k, le = largest[e.setup.label]
            row += [str(k) if k else "none", f"{le.n_params / 1e6:,.1f}M" if le is not None else "-"]
        rows.append(row)
    title = f"Memory usage for one training step of `{name}` on {args.device}" + (
        f" (budget {mem.format_bytes(budget)})" if budget is not None else "")
    print(_describe(model, inv, shape))
    print(mem.format_table(rows, title))
    missing = [e for e in ests if not e.available]
    for e in missing:
        print(f"n/a: {e.setup.label}: needs {', '.join(e.missing)}")
    print("Activations are not included; leave room for them and, on a GPU, ~1-3 GiB for the CUDA context and "
          "allocator slack. With gradient release the step's grads are the largest single gradient in flight.")
    activations: dict[str, Any] = {}
    if cfg and "d_model" in shape:
        from .models.decoder_lm import DecoderLMConfig

        c = DecoderLMConfig(**{k: v for k, v in shape.items() if k in DecoderLMConfig.__dataclass_fields__})
        batch, seq = int(cfg["data"]["batch_size"]), int(cfg["data"]["seq_len"])
        precision = str(cfg.get("trainer", {}).get("precision", "bf16-mixed"))
        off, on = (mem.decoder_activations(c, batch, seq, precision=precision, checkpointing=x) for x in (False, True))
        used = on if c.activation_checkpointing else off
        print(f"Activations of this recipe's batch ({batch} x {seq} tokens, {precision}): peak ~{mem.format_bytes(used.peak)} "
              f"({'with' if c.activation_checkpointing else 'without'} activation checkpointing; "
              f"{'without' if c.activation_checkpointing else 'with'} it: ~{mem.format_bytes((off if used is on else on).peak)}); "
              "qmuon_lightning.memory.decoder_activations")
        activations = {"batch_size": batch, "seq_len": seq, "precision": precision,
                       "checkpointing": c.activation_checkpointing, "without_checkpointing": off.as_dict(),
                       "with_checkpointing": on.as_dict()}
    result = {"model": name, "device": args.device, "n_params": inv.n_params, "n_muon": inv.n_muon,
              "budget": budget, "grow": args.grow, "size_of_given_model": k0,
              "estimates": [e.as_dict() for e in ests], "activations": activations,
              "largest": {k: {"size": v[0], "n_params": v[1].n_params if v[1] else None,
                              "total": v[1].total if v[1] else None} for k, v in largest.items()}}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result
