"""Sharded training (`train.fsdp = true`): torch's FSDP2 (`fully_shard`) splits the trained weights, their
gradients and AdamW's moments over the processes, where DDP keeps a full copy of each on every process.

What is sharded: every transformer block (the classes diffusers lists in the model's `_no_split_modules`,
the units accelerate's FSDP plugin wraps too) and then the root (embedders, final norm and projection).
A unit's weights are gathered for its forward and again for its backward and freed after each (full
shard, ZeRO-3): a process holds 1/world of the weights and optimizer state plus about two blocks in full.
Gradients are reduce-scattered and averaged over the processes, as DDP averages them, so the loss scaling,
clipping (over the whole gradient) and AdamW give what one process gives, within float rounding.

tpkit shards itself, on GPUs and CPUs alike (gloo on CPUs: the tests compare 2 sharded processes with 1),
rather than through accelerate's FSDP plugin, which accelerate enables only on GPUs. Under `accelerate
launch` with an FSDP config (which sets ACCELERATE_USE_FSDP=true) train shards this way too, and the
variable is cleared so accelerate does not wrap the model a second time.

Files stay what one process writes: weights and optimizer state are gathered whole onto the main process
(one tensor at a time, onto its CPU) and saved in the layout an unsharded run saves, so a round trained
sharded continues unsharded and back, on any number of processes.
"""

from __future__ import annotations

import os

import torch

_launcher_asked = False  # remembered: the variable is cleared at the first train of a `tpkit run`


def requested_by_launcher() -> bool:
    """Whether `accelerate launch` was given an FSDP config (it sets ACCELERATE_USE_FSDP=true)."""
    global _launcher_asked
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        os.environ["ACCELERATE_USE_FSDP"] = "false"  # accelerate would wrap the model with its own plugin
        _launcher_asked = True
    return _launcher_asked


def blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks, each a unit of its own (the rest is the root's): the modules of the classes
    diffusers lists in `_no_split_modules`. Read before sharding, which renames the classes."""
    names = set(getattr(transformer, "_no_split_modules", None) or ())
    if not names:  # every diffusers transformer tpkit loads names them; a new family must too
        raise ValueError(f"{type(transformer).__name__} names no blocks (_no_split_modules) to shard by")
    return [m for m in transformer.modules() if type(m).__name__ in names]


def shard(transformer: torch.nn.Module, device: torch.device, world: int) -> None:
    """Shard `transformer` in place over the `world` processes onto `device`: each block, then the root.
    Its parameters become DTensors (same names, global shapes); build the optimizer after this."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for module in blocks(transformer):
        fully_shard(module, mesh=mesh)
    fully_shard(transformer, mesh=mesh)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (the tensor itself when it is not sharded)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole on every process (the tensor itself when it is not sharded)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gather(state: dict[str, torch.Tensor], main: bool) -> dict[str, torch.Tensor] | None:
    """`state` with every sharded tensor gathered whole, one at a time, kept on the main process's CPU
    (None elsewhere). Every process must call it with the same keys in the same order."""
    out = {}
    for k, v in state.items():
        full = whole(v)
        if main:
            out[k] = full.detach().cpu()
        del full
    return out if main else None


def host(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An unsharded module of the transformer's class and config holding `state` (gathered weights on the
    CPU), built without allocating weights of its own: what `save_pretrained` writes from."""
    with torch.device("meta"):
        module = type(transformer).from_config(transformer.config)
    module.load_state_dict(state, strict=True, assign=True)
    return module


def optimizer_state(transformer: torch.nn.Module, optimizer: torch.optim.Optimizer, names: list[str],
                    main: bool) -> dict | None:
    """The sharded optimizer's state gathered whole onto the main process's CPU (None elsewhere), in
    `optimizer.state_dict()`'s layout: parameters numbered in the order of `names` (the trained
    parameters' names, the order the optimizer was given them). Every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(transformer, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not main:
        return None
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in full["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]}


def load_optimizer_state(transformer: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict,
                         names: list[str]) -> None:
    """Put a saved `optimizer.state_dict()` (parameters numbered in the order of `names`; the same on
    every process) into the sharded optimizer: each process keeps its shard of every moment."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    by_name = {"state": {names[i]: s for i, s in saved["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    set_optimizer_state_dict(transformer, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
