"""Which submodules become FSDP2 units when the LightningModule does not shard itself.

FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers one *unit* (a module's own parameters
not owned by an inner unit) before that module's forward and frees it afterwards, so peak memory is
about ``sharded model + the largest unit``. The usual layout is one unit per repeated transformer
block plus one for the rest (embeddings, final norm, output head). :func:`select_blocks` finds the
blocks by a policy and :func:`apply_sharding` applies ``fully_shard`` bottom-up: blocks first, then
the roots that hold the remaining parameters.

Policies (``QMuonFSDPStrategy(shard_policy=...)``):

* ``"auto"`` (default): the children of every ``nn.ModuleList``; if the model has none, modules
  whose class occurs at least twice in the model. Only the outermost match of a nesting chain is
  kept (a ``Block`` is a unit, not also its inner ``Linear`` layers), and a module that shares a
  parameter with a module outside it (tied weights) is never a unit of its own.
* ``"root"``: no blocks; every top-level child that holds parameters is one unit (the whole model
  is gathered at once: simplest, most memory).
* a list of classes or class names (``"Block"`` matches ``type(m).__name__``;
  ``"pkg.mod.Block"`` is imported): modules that are instances of them.
* a callable ``(qualified_name, module) -> bool``.

Roots: each direct child of the LightningModule that holds parameters outside the selected blocks
becomes a unit (for a ``ModuleList`` / ``ModuleDict``, which has no forward, its children instead). Parameters registered directly on the LightningModule make the LightningModule
itself the unit instead; FSDP2 then gathers them in the LightningModule's ``forward``, so the
training step must call ``self(...)``.
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardPolicy", "resolve_policy"]

#: ``"auto"``, ``"root"``, a sequence of classes / class names, or ``(name, module) -> bool``.
ShardPolicy = Union[str, Sequence[Union[str, type]], Callable[[str, nn.Module], bool]]

_NAMED_POLICIES = ("auto", "root")


def _import_class(path: str) -> type:
    module_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"shard_policy entry {path!r}: cannot import it ({e}); give an importable 'package.module.Class' "
            "path, a bare class name matched against type(module).__name__, or the class itself"
        ) from None
    if not isinstance(obj, type) or not issubclass(obj, nn.Module):
        raise ValueError(f"shard_policy entry {path!r} is {obj!r}, not an nn.Module subclass")
    return obj


def resolve_policy(policy: ShardPolicy) -> str | Callable[[str, nn.Module], bool]:
    """Validate ``policy`` and turn a class list into a predicate. Raises ``ValueError`` /
    ``TypeError`` naming the bad entry; runs in the strategy's constructor, before any process starts."""
    if isinstance(policy, str):
        if policy not in _NAMED_POLICIES:
            raise ValueError(
                f"shard_policy={policy!r} is not a policy: use 'auto', 'root', a list of block classes "
                "(or class names), or a callable (name, module) -> bool"
            )
        return policy
    if callable(policy) and not isinstance(policy, type):
        return policy
    if isinstance(policy, type):
        policy = [policy]
    if not isinstance(policy, Sequence) or not policy:
        raise TypeError(
            f"shard_policy must be 'auto', 'root', a non-empty list of classes / class names, or a callable; got {policy!r}"
        )
    classes: list[type] = []
    names: list[str] = []
    for entry in policy:
        if isinstance(entry, type):
            if not issubclass(entry, nn.Module):
                raise ValueError(f"shard_policy entry {entry!r} is not an nn.Module subclass")
            classes.append(entry)
        elif isinstance(entry, str) and "." in entry:
            classes.append(_import_class(entry))
        elif isinstance(entry, str) and entry:
            names.append(entry)
        else:
            raise TypeError(f"shard_policy entries must be classes or class names, got {entry!r}")
    cls_tuple, name_set = tuple(classes), frozenset(names)

    def by_class(_: str, module: nn.Module) -> bool:
        return isinstance(module, cls_tuple) or type(module).__name__ in name_set

    by_class.__qualname__ = f"by_class({[c.__name__ for c in classes] + sorted(names)})"
    return by_class


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _shares_params_outside(name: str, module: nn.Module, owners: dict[int, set[str]]) -> bool:
    """True if a parameter of ``module`` is also registered on a module outside it (tied weights)."""
    prefix = name + "."
    for p in module.parameters():
        for owner in owners[id(p)]:
            if owner != name and not owner.startswith(prefix):
                return True
    return False


def _param_owners(root: nn.Module) -> dict[int, set[str]]:
    owners: dict[int, set[str]] = {}
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(mod_name)
    return owners


def select_blocks(root: nn.Module, policy: ShardPolicy = "auto") -> list[tuple[str, nn.Module]]:
    """The modules of ``root`` that become FSDP units of their own, outermost first, as
    ``(qualified name, module)``. ``root`` itself is never a block."""
    resolved = resolve_policy(policy)
    if resolved == "root":
        return []
    owners = _param_owners(root)
    named = [(n, m) for n, m in root.named_modules() if n]
    if resolved == "auto":
        in_list = {id(c) for m in root.modules() if isinstance(m, nn.ModuleList) for c in m.children()}
        if in_list:
            predicate: Callable[[str, nn.Module], bool] = lambda _, m: id(m) in in_list  # noqa: E731
        else:
            counts = Counter(type(m) for _, m in named)
            predicate = lambda _, m: counts[type(m)] >= 2  # noqa: E731
    else:
        predicate = resolved  # type: ignore[assignment]
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if any(name.startswith(c + ".") for c, _ in chosen):
            continue  # inside a chosen block: the outermost match is the unit
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue  # containers have no forward; FSDP2 hooks forward
        if not _has_params(module) or not predicate(name, module):
            continue
        if _shares_params_outside(name, module, owners):
            continue
        chosen.append((name, module))
    return chosen


def select_roots(root: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The units that hold every parameter not inside a block (see the module docstring)."""
    if next(root.parameters(recurse=False), None) is not None:
        return [("", root)]
    block_params = {id(p) for _, b in blocks for p in b.parameters()}
    roots: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            qualified = f"{prefix}{name}"
            if not any(id(p) not in block_params for p in child.parameters()):
                continue
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(qualified + ".", child)  # containers have no forward for FSDP2 to hook: use their children
            else:
                roots.append((qualified, child))

    visit("", root)
    return roots


def is_sharded(module: nn.Module) -> bool:
    """True if ``fully_shard`` (FSDP2) or tensor parallelism already placed any parameter as a DTensor."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def apply_sharding(
    root: nn.Module, mesh: DeviceMesh, policy: ShardPolicy = "auto", *, root_unit: bool = False,
    **fully_shard_kwargs: Any,
) -> tuple[list[str], list[str]]:
    """``fully_shard`` the blocks chosen by ``policy``, then the roots. Returns the qualified names
    of both (``""`` is ``root`` itself).

    ``root_unit=True`` makes ``root`` itself the one root unit (the usual FSDP2 layout: blocks,
    then the whole model), for a ``root`` that is called through its ``forward``, as the model
    given to ``fabric.setup_module`` is. The Trainer's LightningModule usually is not (its
    ``training_step`` calls ``self.model(...)``), so there its children are the roots
    (:func:`select_roots`)."""
    from torch.distributed.fsdp import fully_shard

    blocks = select_blocks(root, policy)
    roots = [("", root)] if root_unit else select_roots(root, blocks)
    # Innermost first: fully_shard of an outer module skips parameters already owned by inner units.
    for _, module in sorted(blocks, key=lambda nm: -nm[0].count(".")):
        fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    for _, module in roots:
        fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    return [n for n, _ in blocks], [n for n, _ in roots]


def shard_unless_sharded(
    root: nn.Module, mesh: DeviceMesh, policy: ShardPolicy = "auto", *, tensor_parallel_size: int = 1,
    root_unit: bool = False, **fully_shard_kwargs: Any,
) -> tuple[list[str], list[str]] | None:
    """:func:`apply_sharding` unless the user's code already sharded ``root`` (then ``None``: a
    ``configure_model`` / ``parallelize_fn`` that shards is respected as it is). Used by the Trainer
    and the Fabric strategy alike.

    Tensor parallelism: the user's code applies its ``parallelize_module`` plan on the
    ``tensor_parallel`` mesh; when it did not also call ``fully_shard``, the policy shards the
    tensor-parallel model over ``mesh`` (the data-parallel dim), as Lightning's
    ``ModelParallelStrategy`` examples do by hand (FSDP2 over TP: colwise weights become
    ``(_StridedShard(0), Shard(0))``, rowwise ``(Shard(0), Shard(1))``, see
    :mod:`qmuon.distributed.tensor_parallel`)."""
    if _has_fsdp(root):
        return None
    if tensor_parallel_size != 1 and not is_sharded(root):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs your own code to apply tensor parallelism "
            "(parallelize_module on the 'tensor_parallel' mesh): configure_model with the Trainer, parallelize_fn with "
            "Fabric; the strategy then applies fully_shard along the data-parallel dimension"
        )
    if is_sharded(root) and tensor_parallel_size == 1:
        return None  # DTensor parameters placed by other code: respected
    return apply_sharding(root, mesh, policy, root_unit=root_unit, **fully_shard_kwargs)


def _has_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def describe_sharding(owner: str, blocks: Sequence[str], roots: Sequence[str], policy: ShardPolicy) -> str:
    """One log line: which units :func:`shard_unless_sharded` created."""
    shown = ", ".join(blocks[:4]) + (f", ... ({len(blocks)} blocks)" if len(blocks) > 4 else "")
    return (f"{owner}: fully_shard applied to {len(blocks)} block(s) [{shown}] and root(s) "
            f"{[r or '<root module>' for r in roots]} (shard_policy={policy!r})")


def check_replicate_size(replicate_size: Any, tensor_parallel_size: Any) -> None:
    """Refuse a bad ``replicate_size`` (HSDP replicas) in a strategy's constructor, before any
    process starts."""
    if not isinstance(replicate_size, int) or isinstance(replicate_size, bool) or replicate_size < 1:
        raise ValueError(f"replicate_size must be an int >= 1 (HSDP replicas; 1: plain FSDP2), got {replicate_size!r}")
    if replicate_size > 1 and tensor_parallel_size not in (1, "auto"):
        raise ValueError(f"replicate_size={replicate_size} (HSDP) with tensor_parallel_size={tensor_parallel_size} is "
                         "not supported; use one of them")


def hsdp_mesh(device_mesh: DeviceMesh, replicate_size: int, device_type: str) -> DeviceMesh:
    """The mesh the sharding policy shards with: Lightning's ``"data_parallel"`` mesh dim, or with
    ``replicate_size = R > 1`` an HSDP ``(replicate, shard)`` mesh of ``R x (data parallel / R)``
    over the same ranks (FSDP2 then reduce-scatters inside a replica and all-reduces across
    replicas; multi-node: shard inside a node, replicate across nodes). Shared by the Trainer and
    the Fabric strategy."""
    dp = device_mesh["data_parallel"]
    if replicate_size == 1:
        return dp
    if dp.size() % replicate_size or device_mesh.size() != dp.size():
        raise ValueError(f"replicate_size={replicate_size} must divide the data-parallel size {dp.size()} "
                         "(tensor_parallel_size 1)")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (replicate_size, dp.size() // replicate_size),
                            mesh_dim_names=("replicate", "shard"))
