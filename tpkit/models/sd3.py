"""The Stable Diffusion 3 / 3.5 family (SD3.5-Medium and -Large, the built-in tiny-sd3 and tiny-shapes).

Prompt encodings: CLIP-L + CLIP-G + T5 for the prompt and for the empty negative prompt;
velocity: classifier-free guidance, one doubled batch (two transformer forwards a sample).
The tiny model is built from constructor arguments (fixed seed, nothing downloaded) and saved
under $TPKIT_HOME; tiny-shapes ships inside the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tpkit.errors import ModelError
from tpkit.models import base
from tpkit.models.base import Model, tiny_tokenizer
from tpkit.models.names import SHAPES_MODEL, TINY_MODEL
from tpkit.runtime import quiet_libraries

NAME = "sd3"
TINY, SHAPES = TINY_MODEL, SHAPES_MODEL
_TINY_VERSION = 3  # bump when the tiny architecture changes, so old caches are not reused
TINY_RESOLUTION = 64
CLIP_TOKENS = 77  # the CLIP tokens before the T5 ones in every prompt encoding (both CLIPs' 77, concatenated in width)

# The release's LoRA targets: the eight projections of every block's joint attention. Qualified with
# `attn.` so that on SD3.5-Medium they do not also match the second attention (`attn2`) of its 13
# dual-attention (MMDiT-X) blocks: 191 adapted layers, as in the published runs, not 243.
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out")
# Opt-in: the second (image-only) attention of SD3.5's dual-attention blocks.
LORA_TARGETS_ATTN2 = ("attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
# Opt-in: the feed-forward layers of every block, image and text stream (`ff.net.2` does not match
# `ff_context.net.2`: peft matches whole dotted suffixes).
LORA_TARGETS_FF = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")

# Defaults of SD3.5 (hub ids and folders). Text length = T5 tokens per prompt (`max_sequence_length`):
# 128 as the authors' release encodes prompts in training and evaluation. Guidance: the CFG scale of
# rollouts and evaluation, 4.5 as the release samples SD3.5. `sizes`: SD3.5-Medium's, for doctor's
# memory estimates (transformer parameters, latent channels, VAE factor, text widths).
DEFAULTS = {"resolution": 512, "text_length": 128, "guidance": 4.5, "lora_targets": LORA_TARGETS,
            "lora_targets_optional": LORA_TARGETS_ATTN2 + LORA_TARGETS_FF,
            # what one prompt's stored encodings and one LoRA rank cost (doctor's disk estimate): 2 sets (the prompt
            # and the empty negative) of 77 CLIP + T5 tokens x 4096 and a 2048 pooled vector; ~191 adapted
            # 1536x1536 linears of SD3.5-Medium in float32
            "sizes": {"latent_channels": 16, "vae_factor": 8, "prompt_sets": 2, "clip_tokens": 77, "text_dim": 4096,
                      "pooled_dim": 2048, "lora_bytes_per_rank": 3_000_000}}
# The published models' configs (diffusers' transformer/config.json of each repository), for estimates
# and benchmarks made without their weights: transformer, VAE, and the text encoders' parameters (CLIP-L
# 123 M, OpenCLIP bigG 695 M, T5-XXL's encoder 4,762 M).
_SD35 = dict(sample_size=128, patch_size=2, in_channels=16, attention_head_dim=64, joint_attention_dim=4096,
             pooled_projection_dim=2048, out_channels=16, qk_norm="rms_norm")
_SD35_VAE = dict(base.VAE_CONFIG, scaling_factor=1.5305, shift_factor=0.0609)
PUBLISHED = {
    "stabilityai/stable-diffusion-3.5-medium": {
        "transformer": dict(_SD35, num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                            pos_embed_max_size=384, dual_attention_layers=list(range(13))),
        "vae": _SD35_VAE, "text_params": 5_580_000_000},
    "stabilityai/stable-diffusion-3.5-large": {
        "transformer": dict(_SD35, num_layers=38, num_attention_heads=38, caption_projection_dim=2432,
                            pos_embed_max_size=192, dual_attention_layers=[]),
        "vae": _SD35_VAE, "text_params": 5_580_000_000},
}
_TINY_SIZES = {**DEFAULTS["sizes"], "text_dim": 64, "pooled_dim": 64, "lora_bytes_per_rank": 20_000}
BUILTIN = {TINY: {"resolution": 64, "text_length": 128, "sizes": _TINY_SIZES},
           # trained with 12 T5 tokens; guidance chosen on train-split prompts after pretraining (README)
           SHAPES: {"resolution": 64, "text_length": 12, "guidance": 2.0,
                    "sizes": {**_TINY_SIZES, "vae_factor": 4, "latent_channels": 4, "clip_tokens": 12}}}

# --------------------------------------------------------------------------------------------
# Built-in tiny model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyArch:
    """The shape of a tiny SD3 built from constructor arguments; the defaults are tiny-sd3's
    (`tpkit.shapes.model.Arch` gives tiny-shapes' own)."""

    resolution: int = TINY_RESOLUTION
    vae_channels: tuple[int, ...] = (16, 16, 16, 16)  # one VAE level per entry: downsamples 2^(levels - 1)
    latent_channels: int = 16
    vae_groups: int = 1  # 1: the VAE normalises over all channels at once (see build_tiny_sd3)
    scaling_factor: float = 1.5305
    shift_factor: float = 0.0609
    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    pos_embed_max_size: int = 32
    clip_hidden: int = 32  # both CLIPs' width; the T5's and the transformer's text width are twice it
    clip_layers: int = 2
    clip_heads: int = 2
    t5_ff: int = 64
    t5_heads: int = 4
    t5_layers: int = 1
    shift: float = 3.0  # FlowMatchEulerDiscreteScheduler's


def build_tiny(arch: TinyArch, tok, seed: int = 0):
    """A randomly initialised `StableDiffusion3Pipeline` of shape `arch` over one tokenizer `tok` (used for
    all three text encoders), deterministic from `seed`: the one builder of both built-in SD3 models."""
    quiet_libraries()
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    f = 2 ** (len(arch.vae_channels) - 1)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=arch.resolution // f, patch_size=2, in_channels=arch.latent_channels,
        out_channels=arch.latent_channels, num_layers=arch.layers, attention_head_dim=arch.head_dim,
        num_attention_heads=arch.heads, joint_attention_dim=2 * arch.clip_hidden,
        caption_projection_dim=arch.heads * arch.head_dim, pooled_projection_dim=2 * arch.clip_hidden,
        pos_embed_max_size=arch.pos_embed_max_size, qk_norm="rms_norm",
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=arch.latent_channels, sample_size=arch.resolution,
        down_block_types=("DownEncoderBlock2D",) * len(arch.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(arch.vae_channels), block_out_channels=tuple(arch.vae_channels),
        layers_per_block=1, norm_num_groups=arch.vae_groups, use_quant_conv=False, use_post_quant_conv=False,
        scaling_factor=arch.scaling_factor, shift_factor=arch.shift_factor,
    )
    clip = dict(vocab_size=len(tok), hidden_size=arch.clip_hidden, intermediate_size=2 * arch.clip_hidden,
                num_hidden_layers=arch.clip_layers, num_attention_heads=arch.clip_heads, projection_dim=arch.clip_hidden,
                max_position_embeddings=tok.model_max_length, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip))
    torch.manual_seed(seed + 3)
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip))
    torch.manual_seed(seed + 4)
    text_encoder_3 = T5EncoderModel(T5Config(
        vocab_size=len(tok), d_model=2 * arch.clip_hidden, d_ff=arch.t5_ff, d_kv=arch.clip_hidden // arch.clip_heads,
        num_layers=arch.t5_layers, num_heads=arch.t5_heads, decoder_start_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, dropout_rate=0.0))
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=arch.shift), vae=vae,
        text_encoder=text_encoder, tokenizer=tok, text_encoder_2=text_encoder_2, tokenizer_2=tok,
        text_encoder_3=text_encoder_3, tokenizer_3=tok,
    )


def build_tiny_sd3(path: Path) -> None:
    """tiny-sd3: a complete, deterministic, randomly initialised StableDiffusion3Pipeline (about 3 MB).

    Same structure as SD3.5-Medium in miniature: a 2-block MMDiT with RMS q/k norm, a VAE that
    downsamples 8x with 16 latent channels (64 px -> 8x8 latent), two CLIP text encoders with
    projection and a T5 encoder, over a byte-level tokenizer. The VAE normalises over all channels
    at once (one group), so that shifts of the latent reach the image: with per-group norms a random
    decoder maps almost every latent to the same texture and no reward can be learned on CPU.
    """
    build_tiny(TinyArch(), tiny_tokenizer()).save_pretrained(path)


def location(model: str) -> Path | None:
    """Where a built-in model lives (tiny-shapes: inside the package; tiny-sd3: built on first use); None otherwise."""
    if model == SHAPES:
        return Path(__file__).resolve().parent / SHAPES
    return base.built_path(TINY, _TINY_VERSION) if model == TINY else None


def resolve(model: str) -> str:
    """A built-in name -> its folder (tiny-sd3 built on first use); anything else as given."""
    if model == TINY:
        return base.built(location(model), build_tiny_sd3)
    return str(location(model) or model)

# --------------------------------------------------------------------------------------------
# The loaded model
# --------------------------------------------------------------------------------------------


class SD3(Model):
    FAMILY = NAME
    PIPELINE = "StableDiffusion3Pipeline"
    TRANSFORMER = "SD3Transformer2DModel"
    TEXT_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")

    def channels(self) -> int:
        return self.transformer.config.in_channels

    def forwards(self, guidance: float) -> int:
        return 2 if guidance > 1.0 else 1

    @classmethod
    def placeholder_embeds(cls, transformer_config: dict, batch: int, text_length: int, fill, dtype, device=None) -> dict:
        joint, pooled, n = transformer_config["joint_attention_dim"], transformer_config["pooled_projection_dim"], CLIP_TOKENS + text_length
        r = lambda *s: fill(*s, dtype=dtype, device=device)  # noqa: E731
        return dict(prompt_embeds=r(batch, n, joint), pooled_prompt_embeds=r(batch, pooled),
                    negative_prompt_embeds=r(batch, n, joint), negative_pooled_prompt_embeds=r(batch, pooled))

    # ---- schedule -----------------------------------------------------------------------
    def sigmas(self, steps: int, resolution: int) -> list[float]:
        """The FlowMatchEuler scheduler's sigmas with its static shift (3.0 for SD3.5), any size."""
        sched = self.pipe.scheduler
        sched.set_timesteps(steps, device="cpu")
        return [float(s) for s in sched.sigmas]

    # ---- text ---------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str], text_length: int) -> dict[str, torch.Tensor]:
        """Prompt and empty-negative embeddings, in the transformer's dtype, batch = len(prompts):
        prompt_embeds [B, 77 + L, 4096], pooled_prompt_embeds [B, 2048] and their negative_ twins
        (SD3.5-Medium's widths; L = text_length T5 tokens)."""
        if self.pipe.text_encoder is None:
            raise ModelError("this stage loaded the model without text encoders", "internal: load with text_encoders=True")
        pe, npe, pooled, npooled = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=True, negative_prompt=[""] * len(prompts), max_sequence_length=text_length,
        )
        out = dict(prompt_embeds=pe, pooled_prompt_embeds=pooled, negative_prompt_embeds=npe,
                   negative_pooled_prompt_embeds=npooled)
        return {k: v.to(self.dtype) for k, v in out.items()}

    # ---- velocity -----------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float,
                 transformer=None) -> torch.Tensor:
        """v = v_uncond + w (v_text - v_uncond), float32 [B, C, h, w] (see `Model.velocity`).

        CFG runs as one doubled batch (w <= 1: the text branch alone); the transformer's timestep
        input is 1000 sigma."""
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


MODEL = SD3


def load(model: str, **kwargs) -> SD3:
    """`base.load` for this family (by hub id, local folder, tiny-sd3 or tiny-shapes)."""
    return base.load(SD3, model, resolve(model), **kwargs)
