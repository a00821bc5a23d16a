"""The Stable Diffusion 3 / 3.5 model family: loading, prompt encoding, CFG velocity, decoding, LoRA.

The only module that imports diffusers. Every model, the built-in `tiny-sd3` included, is loaded
by `StableDiffusion3Pipeline.from_pretrained(id_or_local_folder)`; the tiny one is first built
from constructor arguments (fixed seed, nothing downloaded) and saved under $TPKIT_HOME.
Stages that do not need the text encoders (score, train) load without them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tpkit import hub
from tpkit.runtime import pick_device, pick_dtype, quiet_libraries, set_cpu_threads, tpkit_home, tune_cpu_allocator
from tpkit.config import SHAPES_MODEL, TINY_MODEL
from tpkit.errors import ModelError

TINY_RESOLUTION = 64
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' file name inside an adapter folder
_TINY_VERSION = 2  # bump when the tiny architecture changes, so old caches are not reused


# --------------------------------------------------------------------------------------------
# Built-in tiny model
# --------------------------------------------------------------------------------------------


def _tiny_tokenizer():
    """Byte-level CLIP tokenizer: 256 byte symbols, their </w> forms, two specials, no merges."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"])}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def build_tiny_sd3(path: Path) -> None:
    """A complete, deterministic, randomly initialised StableDiffusion3Pipeline (about 3 MB).

    Same structure as SD3.5-Medium in miniature: a 2-block MMDiT with RMS q/k norm, a VAE that
    downsamples 8x with 16 latent channels (64 px -> 8x8 latent), two CLIP text encoders with
    projection and a T5 encoder. The VAE normalises over all channels at once (one group), so
    that shifts of the latent reach the image: with per-group norms a random decoder maps
    almost every latent to the same texture and no reward can be learned on CPU.
    """
    quiet_libraries()
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tok = _tiny_tokenizer()
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=TINY_RESOLUTION // 8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=32,
        pooled_projection_dim=64, pos_embed_max_size=32, qk_norm="rms_norm",
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, sample_size=TINY_RESOLUTION,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=1,
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609,
    )
    clip_cfg = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, projection_dim=32, max_position_embeddings=77,
                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(2)
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    torch.manual_seed(3)
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    torch.manual_seed(4)
    text_encoder_3 = T5EncoderModel(T5Config(vocab_size=len(tok), d_model=64, d_ff=64, d_kv=16, num_layers=1,
                                             num_heads=4, decoder_start_token_id=0, pad_token_id=tok.pad_token_id))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=tok, text_encoder_2=text_encoder_2, tokenizer_2=tok,
        text_encoder_3=text_encoder_3, tokenizer_3=tok,
    )
    pipe.save_pretrained(path)


def resolve_model(model: str) -> str:
    """`tiny-sd3` -> its folder under $TPKIT_HOME (built on first use); anything else as given."""
    if model == SHAPES_MODEL:  # pretrained weights shipped inside the package (tpkit.shapes_model)
        from tpkit.shapes_model import weights_dir

        return str(weights_dir())
    if model != TINY_MODEL:
        return model
    path = tpkit_home() / "models" / f"{TINY_MODEL}-v{_TINY_VERSION}"
    if not (path / "model_index.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
        try:
            build_tiny_sd3(tmp)
            try:
                os.replace(tmp, path)  # atomic; a concurrent builder may have won the race
            except OSError:
                if not (path / "model_index.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@dataclass
class SD3:
    """A loaded SD3 pipeline (text encoders optional) and the operations tpkit needs from it."""

    pipe: object
    model: str  # what the user passed (hub id, folder or tiny-sd3)
    device: torch.device
    dtype: torch.dtype
    lora_fused: bool = False  # the adapter is merged into the weights (see `load`)

    @property
    def transformer(self):
        return self.pipe.transformer

    # ---- schedule -----------------------------------------------------------------------
    def sigmas(self, steps: int) -> list[float]:
        """sigma_0 = 1 > ... > sigma_T = 0 of the model's FlowMatchEuler scheduler (with its shift)."""
        sched = self.pipe.scheduler
        sched.set_timesteps(steps, device="cpu")
        return [float(s) for s in sched.sigmas]

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        f = 2 ** (len(self.pipe.vae.config.block_out_channels) - 1)
        return (self.transformer.config.in_channels, resolution // f, resolution // f)

    # ---- text ---------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str], max_sequence_length: int = 128) -> dict[str, torch.Tensor]:
        """Prompt and empty-negative embeddings, in the transformer's dtype, batch = len(prompts)."""
        if self.pipe.text_encoder is None:
            raise ModelError("this stage loaded the model without text encoders", "internal: load with text_encoders=True")
        pe, npe, pooled, npooled = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=True, negative_prompt=[""] * len(prompts), max_sequence_length=max_sequence_length,
        )
        out = dict(prompt_embeds=pe, pooled_prompt_embeds=pooled, negative_prompt_embeds=npe,
                   negative_pooled_prompt_embeds=npooled)
        return {k: v.to(self.dtype) for k, v in out.items()}

    # ---- velocity -----------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float,
                 transformer=None) -> torch.Tensor:
        """v = v_uncond + w (v_text - v_uncond), float32 [B, C, h, w].

        x: [B, C, h, w]; sigma: [B] (per-sample, so branches at different steps share a batch);
        embeds: EMBED_KEYS -> [B, ...]. CFG runs as one doubled batch; the transformer's timestep
        input is 1000 sigma. Gradients flow when called outside no_grad (training), where
        `transformer` may be the accelerate-wrapped (DDP) module.
        """
        transformer = transformer or self.transformer
        x = x.to(self.device)
        sigma = sigma.to(self.device, torch.float32)
        if guidance > 1.0:
            hidden = torch.cat([x, x])
            enc = torch.cat([embeds["negative_prompt_embeds"], embeds["prompt_embeds"]])
            pooled = torch.cat([embeds["negative_pooled_prompt_embeds"], embeds["pooled_prompt_embeds"]])
            t = torch.cat([sigma, sigma])
        else:
            hidden, enc, pooled, t = x, embeds["prompt_embeds"], embeds["pooled_prompt_embeds"], sigma
        out = transformer(
            hidden_states=hidden.to(self.dtype), timestep=t * 1000.0, encoder_hidden_states=enc.to(self.device, self.dtype),
            pooled_projections=pooled.to(self.device, self.dtype), return_dict=False,
        )[0].float()
        if guidance > 1.0:
            v_uncond, v_text = out.chunk(2)
            return v_uncond + guidance * (v_text - v_uncond)
        return out

    # ---- images -------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [B, C, h, w] -> uint8 images [B, H, W, 3]."""
        vae = self.pipe.vae
        z = latents.to(self.device, torch.float32) / vae.config.scaling_factor + vae.config.shift_factor
        img = vae.decode(z.to(vae.dtype), return_dict=False)[0].float()
        img = ((img / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return img.permute(0, 2, 3, 1).cpu().numpy()


_CACHE: dict[tuple, SD3] = {}  # the last frozen (inference) pipeline, reused by the next inference stage


def release() -> None:
    """Drop the cached inference pipeline (train calls this to free its memory first)."""
    _CACHE.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load(model: str, device: str = "auto", dtype: str = "auto", text_encoders: bool = True,
         lora: str | None = None, vae: bool = True, reuse: bool = False, fuse_lora: bool = False) -> SD3:
    """Load an SD3 pipeline by hub id, local folder or `tiny-sd3`, optionally with a LoRA adapter.

    Stages load only what they use: score skips the text encoders, train also the VAE.
    reuse=True (inference stages): keep the pipeline for the next inference stage in this process
    and take a cached one that has at least what is asked for, so `tpkit run`'s score stage does
    not reload what its rollout just used. The cache holds one pipeline.
    fuse_lora=True: merge the adapter into the weights (W + s B A) and drop the LoRA layers, for
    stages whose numbers need not match training's bit for bit (score's branches, eval): about
    20 % faster calls on tiny-sd3. Rollout keeps the adapter separate, as train computes it, so the
    first training ratio stays exactly 1. A cached unfused pipeline is fused in place."""
    lora_id = (str(lora), (Path(lora) / LORA_WEIGHTS).stat().st_mtime_ns) if lora and (Path(lora) / LORA_WEIGHTS).is_file() else lora
    key = (model, str(pick_device(device)), dtype, lora_id)
    fuse_lora = bool(fuse_lora and lora)
    if reuse:
        for (k, has_te, has_vae), m in _CACHE.items():
            if k == key and (has_te or not text_encoders) and (has_vae or not vae) and (fuse_lora or not m.lora_fused):
                if fuse_lora and not m.lora_fused:
                    _fuse(m)
                return m
    quiet_libraries()
    from diffusers import StableDiffusion3Pipeline

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if dev.type == "cpu":
        tune_cpu_allocator()
        set_cpu_threads()
    path = resolve_model(model)
    skip = {} if text_encoders else {k: None for k in (
        "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")}
    if not vae:
        skip["vae"] = None
    pipe = hub.load(StableDiffusion3Pipeline.from_pretrained, path, "model",
                    f"pass a local folder with --model (`--model {TINY_MODEL}` needs nothing)", dtype=dt, **skip)
    pipe.to(dev)
    pipe.set_progress_bar_config(disable=True)
    for m in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):  # frozen
        if m is not None:
            m.eval().requires_grad_(False)
    if lora:
        load_lora(pipe, lora)
    loaded = SD3(pipe=pipe, model=model, device=dev, dtype=dt)
    if fuse_lora:
        _fuse(loaded)
    if reuse:
        release()
        _CACHE[(key, text_encoders, vae)] = loaded
    return loaded


def _fuse(m: SD3) -> None:
    m.pipe.fuse_lora(components=["transformer"])
    m.pipe.unload_lora_weights()  # keeps the merged weights, removes the peft layers
    m.lora_fused = True


def load_lora(pipe, lora: str) -> None:
    if not (Path(lora) / LORA_WEIGHTS).is_file():
        raise ModelError(f"{lora}: no pytorch_lora_weights.safetensors there",
                         "pass the adapter/ folder written by `tpkit train`")
    pipe.load_lora_weights(lora)


# --------------------------------------------------------------------------------------------
# LoRA training
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


def save_lora(transformer_or_state, config, folder: Path) -> None:
    """Save a diffusers-loadable adapter (pipe.load_lora_weights(folder)) atomically."""
    from diffusers import StableDiffusion3Pipeline

    from tpkit.layout import umask

    state = transformer_or_state if isinstance(transformer_or_state, dict) else lora_state(transformer_or_state)
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700 whatever the umask
        StableDiffusion3Pipeline.save_lora_weights(
            tmp, transformer_lora_layers={k: v.detach().cpu() for k, v in state.items()},
            transformer_lora_adapter_metadata=config.to_dict())
        for f in tmp.iterdir():  # safetensors writes 0600 files whatever the umask
            os.chmod(f, 0o666 & ~umask())
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
