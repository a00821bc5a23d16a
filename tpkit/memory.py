"""Peak accelerator memory per process of each stage of a recipe, estimated before anything is loaded
or downloaded (`tpkit doctor RECIPE` prints it).

Weights and optimizer state come from parameter counts: the model's configs (its local folder, the hub
cache, or the family's PUBLISHED configs) instantiated without memory. Activations come from running
the family's own `velocity` (CFG included, at the stage's batch) and, for train, its backward through
the LoRA (or every weight) with gradient checkpointing as the recipe sets it, on fake tensors
(torch's FakeTensorMode: shapes and dtypes, no memory, no arithmetic), counting the bytes of tensor
storage alive at once (`PeakMemory`, the same counter that measures real runs). So the estimate follows
the code that will run, at full size, in seconds on a laptop.

What it leaves out (the table says so): reward models (score, eval), the CUDA context and caching
allocator's slack (~1-2 GB a GPU), NCCL buffers, and the difference between the CPU's and the GPU's
attention kernels (both run without storing the attention matrix at these shapes; checked on the CPU
against measured peaks of the tiny models, and on a GPU by bench/device/fullsize.sh).
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tpkit import models, sharding
from tpkit.config import lora_targets
from tpkit.models import base
from tpkit.runtime import pick_dtype

GiB = 2**30


class PeakMemory(TorchDispatchMode):
    """The most bytes of tensor storage that ops inside the block allocated and held at once (any device,
    real or fake tensors). Storage that existed before (weights, inputs) and views of it are not counted.

        with PeakMemory() as pm:
            model(x).sum().backward()
        pm.peak  # bytes
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live and key not in inputs:  # a new allocation, not a view
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.now)
        return out


@dataclass
class Architecture:
    """What the estimate needs of a model: its family, transformer and VAE configs, text encoders' parameters."""

    family: str
    transformer: dict
    vae: dict
    text_params: int
    source: str  # where the configs came from


@dataclass
class StageMemory:
    stage: str
    parts: dict[str, int] = field(default_factory=dict)  # what -> bytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def architecture(model: str, family: str | None = None) -> Architecture | None:
    """The model's configs: the family's PUBLISHED ones for a published hub id, else its local folder's
    (a built-in model, a folder, or a hub id in the local cache); None when neither is at hand."""
    name = family or models.family_of(model)
    fam = models.family(name)
    if model in getattr(fam, "PUBLISHED", {}):
        p = fam.PUBLISHED[model]
        return Architecture(name, p["transformer"], p["vae"], p["text_params"], "published configs")
    try:  # a built-in model not built yet has no configs to read (doctor builds nothing)
        folder = fam.location(model) if model in fam.BUILTIN else base.local_folder(model)
    except Exception:  # not local, not cached: nothing to read without downloading
        return None
    read = lambda c: {k: v for k, v in json.loads((folder / c / "config.json").read_text()).items()  # noqa: E731
                      if not k.startswith("_")}
    try:
        transformer, vae = read("transformer"), read("vae")
    except OSError:
        return None
    return Architecture(name, transformer, vae, _text_params(folder), f"{folder}")


def _text_params(folder: Path) -> int:
    """Parameters of a pipeline folder's text encoders, from their configs (instantiated on the meta device)."""
    import transformers

    index = json.loads((folder / "model_index.json").read_text())
    total = 0
    for name, spec in index.items():
        if name.startswith("text_encoder") and isinstance(spec, list) and spec[0] == "transformers":
            config = transformers.AutoConfig.from_pretrained(folder / name)
            with torch.device("meta"):
                total += sum(p.numel() for p in getattr(transformers, spec[1])(config).parameters())
    return total


def build_model(arch: Architecture, dtype: torch.dtype, device="meta"):
    """The family's bare `Model` (transformer + VAE, randomly initialised) on the device of the enclosing
    `torch.device(...)` block, `device`: the meta device for estimates, a GPU for the benchmark."""
    import diffusers

    cls = models.family(arch.family).MODEL
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the model's dtype (no float32 copy first)
    try:
        transformer = getattr(diffusers, cls.TRANSFORMER)(**arch.transformer).eval().requires_grad_(False)
        vae = getattr(diffusers, cls.VAE)(**arch.vae).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(previous)
    return base.bare_model(cls, transformer, vae, "estimate", device, dtype)


def transformer_params(arch: Architecture) -> int:
    """Parameters of the transformer these configs build (on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(arch, torch.bfloat16).transformer.parameters())


def embeddings(model, transformer_config: dict, batch: int, text_length: int, dtype, device=None,
               fill=torch.zeros) -> dict:
    """Prompt embeddings of the shapes the family's `encode` returns (zeros, or `fill`: e.g. torch.randn),
    for estimates and benchmarks without text encoders."""
    return model.placeholder_embeds(transformer_config, batch, text_length, fill, dtype, device)


@contextlib.contextmanager
def flash_attention():
    """Attention as the GPU runs it: a fused kernel that stores the output and its log-sum-exp, never the
    N x N attention matrix. On the meta device PyTorch would otherwise decompose it into the plain
    math (and in float32), an overestimate by the attention matrices of every layer."""
    import torch.nn.functional as F

    plain = F.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p or enable_gqa or query.device.type != "meta":
            return plain(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)
        # a padding mask (Qwen-Image's text) is broadcast over the queries, as the memory-efficient kernel takes it
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, is_causal=is_causal,
                                                                         attn_mask=attn_mask, scale=scale)[0]

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def velocity_peak(model, arch: Architecture, batch: int, resolution: int, text_length: int, guidance: float,
                  train: bool = False, autocast: torch.dtype | None = None, keep_grads: bool = True) -> int:
    """Peak bytes allocated by one `velocity` call (train: and its backward), beyond the weights.
    keep_grads=False: each parameter's gradient is dropped as soon as it is complete, as sharded training
    hands it on (reduce-scattered) block by block: the activations' peak alone."""
    x = torch.zeros(batch, *model.latent_shape(resolution))
    emb = embeddings(model, arch.transformer, batch, text_length, model.dtype)
    cast = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    grad = contextlib.nullcontext() if train else torch.no_grad()
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
             for p in model.transformer.parameters() if p.requires_grad and not keep_grads]
    try:
        with grad, PeakMemory() as pm:
            with cast:
                v = model.velocity(x, torch.full((batch,), 0.5), emb, guidance)
            if train:
                v.square().mean().backward()
    finally:
        for h in hooks:
            h.remove()
    return pm.peak


def decode_peak(model, batch: int, resolution: int) -> int:
    """Peak bytes of the VAE decoding a batch of latents (`Model.decode` less its uint8 copy to the host)."""
    with torch.no_grad(), PeakMemory() as pm:
        model.decode_latents(torch.zeros(batch, *model.latent_shape(resolution), dtype=model.pipe.vae.dtype))
    return pm.peak


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def estimate(recipe, arch: Architecture, cuda: bool = True, processes: int = 1) -> list[StageMemory]:
    """Peak memory per process of rollout, score, train and eval (eval_every > 0) for a recipe, with the
    recipe's dtypes as they resolve on a GPU (cuda=True) or on this CPU; train's sharded over `processes`
    when the recipe says train.fsdp."""
    ro, sc, ev = recipe.rollout, recipe.score, recipe.eval
    device = torch.device("cuda" if cuda else "cpu")
    dtype = pick_dtype(ro.dtype, device)
    res, text_length = ro.resolution, ro.max_sequence_length or models.default(ro.model, "text_length", arch.family)
    out = []
    with torch.device("meta"), flash_attention():
        model = build_model(arch, dtype)
        P = sum(p.numel() for p in model.transformer.parameters())
        V = sum(p.numel() for p in model.pipe.vae.parameters())
        b = _bytes(dtype)
        act = lambda batch, **kw: velocity_peak(model, arch, batch, res, text_length, ro.guidance, **kw)  # noqa: E731
        # 1. rollout: the whole pipeline encodes every prompt, then the text encoders go (rollout.py) before the
        #    batches of velocity calls and the decoding of their final latents (at the same batch).
        sampling = max(act(ro.batch_size), decode_peak(model, ro.batch_size, res))
        out.append(StageMemory("rollout", {"transformer": P * b, "VAE": V * b,
                                           "text encoders (encoding), then activations (sampling)":
                                               max(arch.text_params * b, sampling)}))
        # 2. score: no text encoders; branch batches, then decode batches (reward models not counted).
        out.append(StageMemory("score", {"transformer": P * b, "VAE": V * b,
                                          "activations": max(act(sc.batch_size), decode_peak(model, sc.decode_batch_size, res))}))
        # 3. eval: like rollout, at the evaluation's batch (traced before train makes the model trainable).
        if recipe.eval_every:
            eb = ev.batch_size
            evaluation = StageMemory("eval", {"transformer": P * b, "text encoders": arch.text_params * b, "VAE": V * b,
                                              "activations": max(act(eb), decode_peak(model, eb, res))})
        # 4. train: the trained weights (float32), their gradients and AdamW's moments, the reference, activations.
        out.append(train_memory(model, arch, recipe, act, P, b, processes))
    return out + ([evaluation] if recipe.eval_every else [])


def train_memory(model, arch: Architecture, recipe, act, P: int, b: int, processes: int = 1) -> StageMemory:
    """Train's memory on `model` (made trainable here, as train.py does): P transformer parameters of b
    bytes; act(batch, train=True, autocast=..., keep_grads=...) traces a micro-batch's forward and backward.

    With train.fsdp over n = `processes` > 1 (`tpkit.sharding`): 1/n of the weights (trained and frozen),
    of their gradients, AdamW's moments and the reference; the units gathered whole at once (the root,
    which stays gathered through a forward and its backward, the block computing and the next one being
    gathered, and for full fine-tuning one block's whole gradient before it is reduce-scattered); and
    the activations, traced with each gradient handed on as soon as it is complete."""
    tr, ro = recipe.train, recipe.rollout
    n = processes if tr.fsdp else 1
    share = f", 1/{n}" if n > 1 else ""
    micro = tr.micro_batch_size or ro.batch_size
    moments = 2 if tr.optimizer == "adamw8bit" else 8  # two moments a parameter: float32, or 8-bit
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(tr.mixed_precision)
    t = model.transformer
    if tr.gradient_checkpointing:
        t.enable_gradient_checkpointing()
    if tr.finetune == "full":
        base.make_fully_trainable(t)
        model.dtype = torch.float32  # the trained weights are float32 masters (train.py)
        parts = {f"trained weights (float32){share}": P * 4 // n}
        if n > 1:  # unsharded, the traced backward holds them (below)
            parts[f"their gradients{share}"] = P * 4 // n
        parts[f"optimizer moments{share}"] = P * moments // n
        if tr.beta > 0:
            parts[f"KL reference (frozen copy){share}"] = P * b // n
    else:
        base.add_trainable_lora(t, tr.lora_rank, tr.lora_alpha, lora_targets(tr.lora_targets, arch.family))
        lora = sum(p.numel() for p in t.parameters() if p.requires_grad)
        grads = 4 if n > 1 else 0
        parts = {f"transformer{share}": P * b // n,
                 f"LoRA (float32){', its gradients' if n > 1 else ''} and moments{share}": lora * (4 + grads + moments) // n}
    if n == 1:  # gradients are allocated by the backward pass, so the traced peak holds them
        parts["activations and gradients"] = act(micro, train=True, autocast=autocast)
        return StageMemory("train", parts)
    blocks = sharding.blocks(t)  # the units train shards by
    in_blocks = {id(p) for m in blocks for p in m.parameters()}
    nbytes = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
    block = max(nbytes(m.parameters()) for m in blocks)
    gathered = nbytes(p for p in t.parameters() if id(p) not in in_blocks) + 2 * block
    if tr.finetune == "full":
        gathered += block  # a block's gradient, float32 as its weights
    parts["gathered whole: the root and 2 blocks" + (", a block's gradient" if tr.finetune == "full" else "")] = gathered
    parts["activations"] = act(micro, train=True, autocast=autocast, keep_grads=False)
    return StageMemory("train", parts)


# --------------------------------------------------------------------------------------------
# Out of memory: the largest batch the estimate says fits (runtime.memory_options names it)
# --------------------------------------------------------------------------------------------

FIT_SHARE = 0.9  # of the GPU's memory: the rest for the CUDA context and the allocator's fragments


def loaded_architecture(model) -> Architecture:
    """A loaded model's own configs (what it runs with, whatever its folder)."""
    clean = lambda c: {k: v for k, v in dict(c).items() if not k.startswith("_")}  # noqa: E731
    return Architecture(model.FAMILY, clean(model.transformer.config), clean(model.pipe.vae.config), 0, "loaded")


def resident_bytes(model) -> int:
    """Bytes of every weight and buffer a loaded pipeline holds (transformer, VAE, text encoders loaded)."""
    seen, total = set(), 0
    for part in vars(model.pipe).values() if not hasattr(model.pipe, "components") else model.pipe.components.values():
        if isinstance(part, torch.nn.Module):
            for t in (*part.parameters(), *part.buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total


def largest_fitting(limit: int, fixed: int, peak, upto: int) -> int | None:
    """The largest batch b < upto with fixed + peak(b) <= limit (peak grows with b), None if not even 1."""
    lo, hi = 0, upto - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fixed + peak(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def suggest_batch(model, kind: str, value: int, resolution: int, text_length: int, guidance: float,
                  train_cfg=None, limit: int | None = None) -> int | None:
    """After an out-of-memory at batch `value`: the largest smaller batch the estimate says fits
    FIT_SHARE of the model's GPU (`limit`: bytes, else the GPU's), for a `kind` of work: "velocity"
    (rollout, score's branches, eval), "decode" (the VAE) or "train" (a micro-batch's forward and
    backward, train_cfg the TrainConfig). None on a CPU, or where even 1 does not fit."""
    if limit is None:
        if model.device.type != "cuda":
            return None
        limit = int(FIT_SHARE * torch.cuda.get_device_properties(model.device).total_memory)
    arch = loaded_architecture(model)
    with torch.device("meta"), flash_attention():
        meta = build_model(arch, model.dtype)
        P = sum(p.numel() for p in meta.transformer.parameters())
        if kind == "train":
            import dataclasses
            from types import SimpleNamespace

            def peak(b: int) -> int:
                m = build_model(arch, model.dtype)
                act = lambda batch, **kw: velocity_peak(m, arch, batch, resolution, text_length, guidance, **kw)  # noqa: E731
                recipe = SimpleNamespace(train=dataclasses.replace(train_cfg, micro_batch_size=b),
                                         rollout=SimpleNamespace(batch_size=b))
                # sharded (train.fsdp), over the processes the launcher started
                return train_memory(m, arch, recipe, act, P, _bytes(model.dtype),
                                    int(os.environ.get("WORLD_SIZE", "1"))).total

            return largest_fitting(limit, 0, peak, value)
        fixed = resident_bytes(model)
        if kind == "decode":
            return largest_fitting(limit, fixed, lambda b: decode_peak(meta, b, resolution), value)
        return largest_fitting(limit, fixed, lambda b: velocity_peak(meta, arch, b, resolution, text_length, guidance),
                               value)
