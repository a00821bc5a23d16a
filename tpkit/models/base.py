"""What every model family shares: the loaded-model object, the one-pipeline cache, decoding, LoRA.

A family module (`sd3.py`, `flux.py`, `qwen_image.py`) subclasses `Model` with its schedule, prompt encoding and
velocity, and declares its pipeline class and defaults; everything here is the same for all.
Latents are stored and passed around unpacked, [B, C, h, w], whatever the transformer consumes,
so formulas, shards and train never see a family's packing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np
import torch

from tpkit import hub
from tpkit.errors import ModelError
from tpkit.layout import PRUNED, umask
from tpkit.runtime import pick_device, pick_dtype, quiet_libraries, set_cpu_threads, tpkit_home, tune_cpu_allocator

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' file name inside an adapter folder
MODEL_NOTE = "tpkit-model.json"  # in a fully fine-tuned pipeline folder: the base model it was trained from


@dataclass
class Model:
    """A loaded pipeline (text encoders and VAE optional) and the operations tpkit needs from it."""

    pipe: object
    model: str  # what the user passed (hub id, folder or a built-in name)
    device: torch.device
    dtype: torch.dtype
    lora_fused: bool = False  # the adapter is merged into the weights (see `load`)
    path: str = ""  # what `model` resolved to: a local folder or a hub id (`save_model` links its components)

    FAMILY: ClassVar[str] = ""
    PIPELINE: ClassVar[str] = ""  # the diffusers pipeline class
    TRANSFORMER: ClassVar[str] = ""  # its transformer's diffusers class (memory estimates build it from a config)
    VAE: ClassVar[str] = "AutoencoderKL"  # its VAE's diffusers class
    TEXT_COMPONENTS: ClassVar[tuple[str, ...]] = ()  # what `text_encoders=False` leaves out

    @property
    def transformer(self):
        return self.pipe.transformer

    # ---- what a family implements -------------------------------------------------------
    def sigmas(self, steps: int, resolution: int) -> list[float]:
        """sigma_0 = 1 > ... > sigma_T = 0, the family's schedule at this image size."""
        raise NotImplementedError

    def encode(self, prompts: list[str], text_length: int) -> dict[str, torch.Tensor]:
        """Prompt encodings, batch first, in the transformer's dtype; stages store them and pass
        them back to `velocity` without knowing the keys."""
        raise NotImplementedError

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float,
                 transformer=None) -> torch.Tensor:
        """v(x, sigma) as the sampler uses it (guidance applied), float32 [B, C, h, w].

        x: [B, C, h, w]; sigma: [B] (per sample, so branches at different steps share a batch);
        embeds: `encode`'s dict with batch B. Gradients flow when called outside no_grad
        (training), where `transformer` may be the accelerate-wrapped (DDP) module."""
        raise NotImplementedError

    def forwards(self, guidance: float) -> int:
        """Transformer forwards (samples through the network) per sample of one `velocity` call."""
        raise NotImplementedError

    def channels(self) -> int:
        """Latent channels C of the unpacked latent."""
        raise NotImplementedError

    def idle_parameters(self, transformer) -> list[str]:
        """Names of the transformer's parameters that no velocity depends on (their gradient is always None):
        train freezes them, as DDP requires a gradient for every trained parameter. SD3 and FLUX have none
        (their last block computes no text output)."""
        return []

    @classmethod
    def placeholder_embeds(cls, transformer_config: dict, batch: int, text_length: int, fill, dtype, device=None) -> dict:
        """Tensors of the shapes `encode` returns (`fill(*shape, dtype=, device=)`: zeros, randn), for memory
        estimates and benchmarks without text encoders."""
        raise NotImplementedError

    @classmethod
    def vae_factor(cls, vae_config: dict) -> int:
        """Pixels per latent cell of this family's VAE (an `AutoencoderKL`: 2 per level after the first)."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    # ---- shared ---------------------------------------------------------------------------
    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        f = self.pipe.vae_scale_factor  # the pipeline's, set from the VAE config (8 without a VAE loaded)
        return (self.channels(), resolution // f, resolution // f)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] -> images [B, 3, H, W] in [-1, 1] (float32): an `AutoencoderKL`'s
        scaling and shift undone, then its decoder. A family with another VAE overrides this."""
        vae = self.pipe.vae
        z = latents.to(self.device, torch.float32) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [B, C, h, w] -> uint8 images [B, H, W, 3]."""
        img = ((self.decode_latents(latents) / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return img.permute(0, 2, 3, 1).cpu().numpy()

    @staticmethod
    @contextlib.contextmanager
    def reference(transformer):
        """The base model inside: the LoRA adapters switched off (no second copy in memory). Which
        parameters are trained is kept as it was: peft's enable_adapters makes every adapter weight
        trainable again, idle ones included, and a gradient-checkpointed block recomputed in the backward
        would then save other tensors than its forward did."""
        trained = [p.requires_grad for p in transformer.parameters()]
        transformer.disable_adapters()
        try:
            yield transformer
        finally:
            transformer.enable_adapters()
            for p, flag in zip(transformer.parameters(), trained):
                p.requires_grad_(flag)

    def save_lora(self, transformer_or_state, config, folder: Path) -> None:
        """Save a diffusers-loadable adapter (`Pipeline.load_lora_weights(folder)`) atomically."""
        import diffusers

        state = transformer_or_state if isinstance(transformer_or_state, dict) else lora_state(transformer_or_state)
        # peft keeps the module names as a set, whose order changes with each process's string hashing:
        # sorted, two identical trainings write identical files
        metadata = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.to_dict().items()}
        with _written_atomically(folder) as tmp:
            getattr(diffusers, self.PIPELINE).save_lora_weights(
                tmp, transformer_lora_layers={k: v.detach().cpu() for k, v in state.items()},
                transformer_lora_adapter_metadata=metadata)


    def save_model(self, transformer, folder: Path) -> None:
        """Save a fully fine-tuned transformer as a diffusers pipeline folder, atomically: `transformer/`
        written (float32, the trained weights themselves, so the next round continues them exactly),
        every other component a link to the model this one was loaded from (nothing large copied), and
        MODEL_NOTE naming the base model (the KL reference of later rounds). `Pipeline.from_pretrained(folder)`
        and `tpkit rollout --model folder` load it."""
        source = local_folder(self.path)
        with _written_atomically(folder) as tmp:
            index = json.loads((source / "model_index.json").read_text())
            for name in index:
                if not name.startswith("_") and name != "transformer" and (source / name).exists():
                    os.symlink((source / name).resolve(), tmp / name)
            shutil.copyfile(source / "model_index.json", tmp / "model_index.json")
            transformer.save_pretrained(tmp / "transformer", safe_serialization=True)
            note = {"base_model": base_model(self.model), "family": self.FAMILY}
            (tmp / MODEL_NOTE).write_text(json.dumps(note, indent=1) + "\n")


@contextlib.contextmanager
def _written_atomically(folder: Path):
    """Yield a temporary folder beside `folder` to write into; then it replaces `folder` whole, with the
    umask's permissions (mkdtemp makes 0700 and safetensors 0600 files whatever the umask). An error
    leaves `folder` as it was."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o777 & ~umask())
        yield tmp
        for f in tmp.rglob("*"):  # links (to a base model's components) keep their targets' modes
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o666 & ~umask())
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def base_model(model: str) -> str:
    """The model a fully fine-tuned folder (`Model.save_model`) was trained from; `model` itself otherwise."""
    note = Path(model).expanduser() / MODEL_NOTE
    return json.loads(note.read_text())["base_model"] if note.is_file() else model


def local_folder(path: str) -> Path:
    """A model's local folder: `path` itself, or a hub id's snapshot in the local cache (nothing downloaded)."""
    if Path(path).expanduser().is_dir():
        return Path(path).expanduser().resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except Exception as e:  # not a repo id, or not (fully) in the cache
        raise ModelError(f"{path}: not a local folder nor a model in the hub cache ({hub._first_line(e)})",
                         "pass a local model folder as the rollout's model") from None


# The published VAE of SD3.5 and FLUX.1 (16 latent channels; 83.8 M parameters); the families differ in
# scaling/shift factors only.
VAE_CONFIG = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                  up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
                  latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)


def bare_model(cls: type[Model], transformer, vae, model: str, device, dtype) -> Model:
    """A family's `Model` around a transformer and a VAE alone (no text encoders, no scheduler): what
    memory estimates and the full-size benchmark run the family's own `velocity` and `decode` on."""
    from types import SimpleNamespace

    pipe = SimpleNamespace(transformer=transformer, vae=vae, vae_scale_factor=cls.vae_factor(vae.config))
    return cls(pipe=pipe, model=model, device=torch.device(device), dtype=dtype)


# --------------------------------------------------------------------------------------------
# What the families with packed latents and a resolution-dependent shift share (FLUX.1, Qwen-Image)
# --------------------------------------------------------------------------------------------


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: 2x2 patches as tokens (diffusers' `_pack_latents` of FLUX and Qwen-Image)."""
    B, C, h, w = x.shape
    return x.view(B, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (h // 2) * (w // 2), C * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, (h/2)(w/2), 4C] -> [B, C, h, w]: the inverse of `pack` (diffusers' `_unpack_latents`)."""
    B, _, D = tokens.shape
    return tokens.view(B, h // 2, w // 2, D // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, D // 4, h, w)


def shift_mu(tokens: int, config) -> float:
    """The resolution-dependent shift: mu linear in the image's token count (diffusers' calculate_shift),
    from `base_shift` at `base_image_seq_len` tokens to `max_shift` at `max_image_seq_len`."""
    b0, b1 = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    m0, m1 = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    return m0 + (m1 - m0) * (tokens - b0) / (b1 - b0)


def dynamic_shift_sigmas(pipe, steps: int, resolution: int) -> list[float]:
    """The pipelines' schedule with dynamic shifting (FluxPipeline, QwenImagePipeline): linspace(1, 1/T, T)
    shifted by mu(packed tokens at this resolution) in the scheduler's own way (its time-shift type and
    terminal stretch), then 0."""
    sched = pipe.scheduler
    h = resolution // pipe.vae_scale_factor
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=shift_mu((h // 2) ** 2, sched.config), device="cpu")
    return [float(s) for s in sched.sigmas]


# --------------------------------------------------------------------------------------------
# Built-in models: built once from constructor arguments under $TPKIT_HOME
# --------------------------------------------------------------------------------------------


def built_path(name: str, version: int) -> Path:
    """Where a built-in model built from constructor arguments lives (bump `version` when its architecture changes)."""
    return tpkit_home() / "models" / f"{name}-v{version}"


def built(path: Path, build: Callable[[Path], None]) -> str:
    """`path`, built on first use (atomically: concurrent builders race safely)."""
    if not (path / "model_index.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
        try:
            build(tmp)
            try:
                os.replace(tmp, path)  # atomic; a concurrent builder may have won the race
            except OSError:
                if not (path / "model_index.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def tiny_tokenizer():
    """Byte-level CLIP tokenizer: 256 byte symbols, their </w> forms, two specials, no merges."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"])}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


# --------------------------------------------------------------------------------------------
# Loading, with one cached inference pipeline
# --------------------------------------------------------------------------------------------

_CACHE: dict[tuple, Model] = {}  # the last frozen (inference) pipeline, reused by the next inference stage
# Text encoders rollout let go (`drop_text_encoders`), kept on the CPU for the next load of the same ones
# in this process (the next round's rollout, an evaluation): T5-XXL is not read from disk every round.
_TEXT_ENCODERS: dict[tuple, dict[str, torch.nn.Module]] = {}


def _text_key(cls: type[Model], path: str, dtype: torch.dtype) -> tuple:
    """What identifies a pipeline's text encoders: their folder (a fully fine-tuned model/ links to its
    base's), or the hub id; and the dtype."""
    folder = Path(path).expanduser() / "text_encoder"
    return cls.FAMILY, str(folder.resolve()) if folder.exists() else path, str(dtype)


def release() -> None:
    """Drop the cached inference pipeline (train calls this to free its memory first)."""
    _CACHE.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load(cls: type[Model], model: str, path: str, device: str = "auto", dtype: str = "auto", text_encoders: bool = True,
         lora: str | None = None, vae: bool = True, reuse: bool = False, fuse_lora: bool = False) -> Model:
    """Load `cls`'s pipeline from `path` (what `model` resolved to), optionally with a LoRA adapter.

    Stages load only what they use: score skips the text encoders, train also the VAE.
    reuse=True (inference stages): keep the pipeline for the next inference stage in this process
    and take a cached one that has at least what is asked for, so `tpkit run`'s score stage does
    not reload what its rollout just used. The cache holds one pipeline.
    fuse_lora=True: merge the adapter into the weights (W + s B A) and drop the LoRA layers, for
    stages whose numbers need not match training's bit for bit (score's branches, eval): about
    20 % faster calls on tiny-sd3. Rollout keeps the adapter separate, as train computes it, so the
    first training ratio stays exactly 1. A cached unfused pipeline is fused in place."""
    lora_id = (str(lora), (Path(lora) / LORA_WEIGHTS).stat().st_mtime_ns) if lora and (Path(lora) / LORA_WEIGHTS).is_file() else lora
    key = (cls.FAMILY, model, str(pick_device(device)), dtype, lora_id)
    fuse_lora = bool(fuse_lora and lora)
    if reuse:
        for (k, has_te, has_vae), m in _CACHE.items():
            if k == key and (has_te or not text_encoders) and (has_vae or not vae) and (fuse_lora or not m.lora_fused):
                if fuse_lora and not m.lora_fused:
                    _fuse(m)
                return m
    if (Path(path).expanduser() / PRUNED).is_file():
        raise ModelError(f"{path}: its weights were deleted by `tpkit run` (keep_rounds) once later rounds had trained",
                         "use a round it kept (the last keep_rounds and every evaluated one), or set keep_rounds = 0")
    quiet_libraries()
    import diffusers

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if dev.type == "cpu":
        tune_cpu_allocator()
        set_cpu_threads()
    skip = {} if text_encoders else {k: None for k in cls.TEXT_COMPONENTS}
    if text_encoders:  # the ones a rollout of this process let go, instead of reading them again
        skip.update(_TEXT_ENCODERS.pop(_text_key(cls, path, dt), {}))
    if not vae:
        skip["vae"] = None
    pipe = hub.load(getattr(diffusers, cls.PIPELINE).from_pretrained, path, "model",
                    "pass a local folder with --model (the built-in tiny models need nothing)", dtype=dt, **skip)
    pipe.to(dev)
    pipe.set_progress_bar_config(disable=True)
    for name in ("transformer", "vae", *cls.TEXT_COMPONENTS):  # frozen
        m = getattr(pipe, name, None)
        if isinstance(m, torch.nn.Module):
            m.eval().requires_grad_(False)
    if lora:
        load_lora(pipe, lora)
    loaded = cls(pipe=pipe, model=model, device=dev, dtype=dt, path=path)
    if fuse_lora:
        _fuse(loaded)
    if reuse:
        release()
        _CACHE[(key, text_encoders, vae)] = loaded
    return loaded


def drop_text_encoders(m: Model) -> None:
    """Free a loaded model's accelerator memory of its text encoders (rollout, once every prompt is
    encoded: on SD3.5 they are 10 of its 15 GB in bf16). They move to the CPU, where the next `load`
    of the same ones in this process takes them (`_TEXT_ENCODERS`; one set is kept); a cached pipeline
    becomes one without them, so no later stage expects them."""
    parts = {name: getattr(m.pipe, name) for name in m.TEXT_COMPONENTS
             if isinstance(getattr(m.pipe, name, None), torch.nn.Module)}
    _TEXT_ENCODERS.clear()
    _TEXT_ENCODERS[_text_key(type(m), m.path, m.dtype)] = {name: part.to("cpu") for name, part in parts.items()}
    for name in parts:
        setattr(m.pipe, name, None)
    for key, cached in list(_CACHE.items()):
        if cached is m:
            del _CACHE[key]
            _CACHE[(key[0], False, key[2])] = m
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fuse(m: Model) -> None:
    m.pipe.fuse_lora(components=["transformer"])
    m.pipe.unload_lora_weights()  # keeps the merged weights, removes the peft layers
    m.lora_fused = True


def load_lora(pipe, lora: str) -> None:
    if not (Path(lora) / LORA_WEIGHTS).is_file():
        raise ModelError(f"{lora}: no {LORA_WEIGHTS} there", "pass the adapter/ folder written by `tpkit train`")
    pipe.load_lora_weights(lora)


# --------------------------------------------------------------------------------------------
# LoRA training (peft on the transformer; the same for every family)
# --------------------------------------------------------------------------------------------


def add_trainable_lora(transformer, rank: int, alpha: int, targets: list[str] | tuple[str, ...], init: str | None = None):
    """Add a peft LoRA adapter ("default") to the frozen transformer; trainable params in float32.

    `init`: an adapter folder written by `save_lora` (a previous round) to start from. Returns
    the config, which `save_lora` stores so diffusers restores the same alpha.
    """
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets))
    transformer.add_adapter(config)
    if init:
        path = Path(init) / LORA_WEIGHTS
        if not path.is_file():
            raise ModelError(f"{init}: no {LORA_WEIGHTS} there", "pass the adapter/ folder written by `tpkit train`")
        state = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
        result = set_peft_model_state_dict(transformer, state, adapter_name="default")
        if getattr(result, "unexpected_keys", None):
            raise ModelError(f"{init}: adapter does not match the LoRA settings ({result.unexpected_keys[0]} ...)",
                             "use the same lora rank and target modules as the run that wrote it")
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return config


def lora_state(transformer) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer)


# --------------------------------------------------------------------------------------------
# What train updates: a LoRA, or every weight (finetune = "full")
# --------------------------------------------------------------------------------------------


def make_fully_trainable(transformer) -> None:
    """Every weight of the transformer trainable, in float32 (the master weights: mixed precision
    computes in bf16/fp16 from them; saved as they are, so the next round continues them exactly)."""
    transformer.float().requires_grad_(True)


def trained_state(transformer, finetune: str) -> dict[str, torch.Tensor]:
    """The weights train updates: the LoRA's (peft names), or the whole transformer's state dict."""
    return lora_state(transformer) if finetune == "lora" else transformer.state_dict()


def load_trained_state(transformer, state: dict[str, torch.Tensor], finetune: str) -> None:
    """Put `trained_state`'s weights back (a mid-round checkpoint); every key must match."""
    if finetune == "lora":
        from peft.utils import set_peft_model_state_dict

        set_peft_model_state_dict(transformer, state, adapter_name="default")
    else:
        transformer.load_state_dict(state, strict=True)
