"""The FLUX.1 family (FLUX.1-dev, and the built-in tiny-flux), on diffusers' FluxPipeline.

Differences from SD3 that the rest of tpkit never sees:
- the transformer takes *packed* latents, 2x2 patches of the [C, h, w] latent as tokens of width
  4C, with `img_ids` (each token's row and column) and `txt_ids` (zeros); tpkit stores unpacked
  latents and packs and unpacks inside `velocity`;
- FLUX.1-dev is guidance-distilled: the guidance scale (3.5) is an input of the network, so one
  velocity is one transformer forward, with no negative prompt;
- the schedule's shift depends on the image's token count (`calculate_shift`: mu grows linearly
  from 0.5 at 256 tokens to 1.15 at 4096), so `sigmas` takes the resolution;
- prompt encodings are the T5 sequence and CLIP-L's pooled vector.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpkit.models.names import FLUX_MODEL
from tpkit.errors import ModelError
from tpkit.models import base
from tpkit.models.base import Model, pack, tiny_tokenizer, unpack
from tpkit.runtime import quiet_libraries

NAME = "flux"
TINY = FLUX_MODEL
_TINY_VERSION = 1

# The release's FLUX LoRA targets (flow_grpo scripts/train_flux.py): attention projections of both
# streams and the feed-forward layers of the double-stream blocks.
LORA_TARGETS = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2")
# Opt-in: the single-stream blocks' projections (their attention is matched by `attn.to_*` already).
LORA_TARGETS_SINGLE = ("proj_mlp", "proj_out")

# FLUX.1-dev: 1024 px native, trained by the release at 512; distilled guidance 3.5; T5 tokens as the
# release encodes prompts (128). `sizes` for doctor's disk estimate: one set of encodings (no negative
# prompt), T5 x 4096 and CLIP-L's 768 pooled; a rank of the default targets is ~2.8 M float32 parameters
# (19 double blocks x 12 linears of width 3072/12288, 38 single blocks' q/k/v).
DEFAULTS = {"resolution": 512, "text_length": 128, "guidance": 3.5, "lora_targets": LORA_TARGETS,
            "lora_targets_optional": LORA_TARGETS_SINGLE,
            "sizes": {"latent_channels": 16, "vae_factor": 8, "prompt_sets": 1, "clip_tokens": 0, "text_dim": 4096,
                      "pooled_dim": 768, "lora_bytes_per_rank": 11_200_000}}
# FLUX.1-dev's published configs (see sd3.PUBLISHED): transformer, VAE, text encoders (CLIP-L 123 M,
# T5-XXL's encoder 4,762 M).
PUBLISHED = {
    "black-forest-labs/FLUX.1-dev": {
        "transformer": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                            guidance_embeds=True, axes_dims_rope=[16, 56, 56]),
        "vae": dict(base.VAE_CONFIG, scaling_factor=0.3611, shift_factor=0.1159), "text_params": 4_885_000_000},
}
BUILTIN = {TINY: {"resolution": 64, "sizes": {**DEFAULTS["sizes"], "text_dim": 64, "pooled_dim": 32,
                                             "lora_bytes_per_rank": 20_000}}}

# --------------------------------------------------------------------------------------------
# Built-in tiny model
# --------------------------------------------------------------------------------------------


def build_tiny_flux(path: Path) -> None:
    """A complete, deterministic, randomly initialised FluxPipeline (about 2 MB).

    FLUX.1-dev in miniature: one double-stream and one single-stream block with guidance
    embedding and 3-axis RoPE, a VAE that downsamples 8x to 16 channels (64 px -> 8x8 latent,
    16 packed tokens), CLIP-L (pooled) and T5 text encoders, FLUX.1-dev's scheduler (dynamic
    shift). The VAE normalises over all channels at once, as tiny-sd3's does (see there why)."""
    quiet_libraries()
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, sample_size=64,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=1,
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159,
    )
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id))
    torch.manual_seed(3)
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tok), d_model=64, d_ff=64, d_kv=16, num_layers=1,
                                             num_heads=4, decoder_start_token_id=0, pad_token_id=tok.pad_token_id))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                 text_encoder_2=text_encoder_2, tokenizer_2=tok).save_pretrained(path)


def location(model: str) -> Path | None:
    """Where tiny-flux lives (built on first use); None for other models."""
    return base.built_path(TINY, _TINY_VERSION) if model == TINY else None


def resolve(model: str) -> str:
    """tiny-flux -> its folder (built on first use); anything else as given."""
    return base.built(location(model), build_tiny_flux) if model == TINY else model

# --------------------------------------------------------------------------------------------
# The loaded model
# --------------------------------------------------------------------------------------------


def image_ids(h: int, w: int) -> torch.Tensor:
    """[(h/2)(w/2), 3]: (0, row, column) of each packed token, FluxPipeline._prepare_latent_image_ids."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


class Flux(Model):
    FAMILY = NAME
    PIPELINE = "FluxPipeline"
    TRANSFORMER = "FluxTransformer2DModel"
    TEXT_COMPONENTS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")

    def channels(self) -> int:
        return self.transformer.config.in_channels // 4  # 2x2 patches packed into the token width

    def forwards(self, guidance: float) -> int:
        return 1  # guidance is an input (distilled), not a second pass

    @classmethod
    def placeholder_embeds(cls, transformer_config: dict, batch: int, text_length: int, fill, dtype, device=None) -> dict:
        r = lambda *s: fill(*s, dtype=dtype, device=device)  # noqa: E731
        return dict(prompt_embeds=r(batch, text_length, transformer_config["joint_attention_dim"]),
                    pooled_prompt_embeds=r(batch, transformer_config["pooled_projection_dim"]))

    def sigmas(self, steps: int, resolution: int) -> list[float]:
        """FluxPipeline's: linspace(1, 1/T, T), shifted by mu(tokens at this resolution), then 0."""
        return base.dynamic_shift_sigmas(self.pipe, steps, resolution)

    @torch.no_grad()
    def encode(self, prompts: list[str], text_length: int) -> dict[str, torch.Tensor]:
        """prompt_embeds [B, L, 4096] (T5, L = text_length) and pooled_prompt_embeds [B, 768] (CLIP-L),
        FLUX.1-dev's widths, in the transformer's dtype. No negative prompt: guidance is distilled."""
        if self.pipe.text_encoder is None:
            raise ModelError("this stage loaded the model without text encoders", "internal: load with text_encoders=True")
        pe, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device, num_images_per_prompt=1,
                                                max_sequence_length=text_length)
        return {"prompt_embeds": pe.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)}

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float,
                 transformer=None) -> torch.Tensor:
        """One forward on packed tokens, unpacked to float32 [B, C, h, w] (see `Model.velocity`).

        The transformer's timestep input is sigma (FluxPipeline passes timestep / 1000; the
        model scales it by 1000 itself), and so is the guidance scale, where the model embeds it."""
        transformer = transformer or self.transformer
        B, _, h, w = x.shape
        enc = embeds["prompt_embeds"].to(self.device, self.dtype)
        g = torch.full((B,), guidance, device=self.device, dtype=torch.float32) if self.transformer.config.guidance_embeds else None
        out = transformer(
            hidden_states=pack(x.to(self.device)).to(self.dtype), timestep=sigma.to(self.device, self.dtype), guidance=g,
            pooled_projections=embeds["pooled_prompt_embeds"].to(self.device, self.dtype), encoder_hidden_states=enc,
            txt_ids=torch.zeros(enc.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=image_ids(h, w).to(self.device, self.dtype), return_dict=False,
        )[0]
        return unpack(out.float(), h, w)


MODEL = Flux


def load(model: str, **kwargs) -> Flux:
    """`base.load` for this family (by hub id, local folder or tiny-flux)."""
    return base.load(Flux, model, resolve(model), **kwargs)
