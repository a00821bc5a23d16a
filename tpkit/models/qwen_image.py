"""The Qwen-Image family (Qwen/Qwen-Image, and the built-in tiny-qwen-image), on diffusers' QwenImagePipeline.

Differences from SD3 and FLUX that the rest of tpkit never sees:
- the text encoder is a vision-language model (Qwen2.5-VL): a prompt is wrapped in the pipeline's chat
  template, and its last hidden states after the template's 34-token system prefix are the encoding,
  with an attention mask. The pipeline pads each batch to its longest prompt; tpkit pads (or cuts)
  every prompt to `text_length` tokens with the mask marking the padding, so that stored encodings of
  different prompts stack into one batch (score's branches, train's micro-batches). The transformer
  masks padded tokens out of attention and places text RoPE positions after the image's, so padding
  changes no image token's output;
- true classifier-free guidance (not distilled): the prompt and a negative prompt (" ", as the published
  Qwen-Image GRPO configs sample) in one doubled batch, combined as v_neg + w (v_cond - v_neg) and
  rescaled per token to the conditional velocity's norm, as QwenImagePipeline does; both encodings are
  stored;
- packed latents (2x2 patches, as FLUX) with `img_shapes` for the RoPE; the schedule's dynamic shift
  (exponential time shift, stretched to a terminal sigma of 0.02 by Qwen-Image's scheduler config);
- a 3-D (video) VAE: latents get a frame axis of 1 and are de-normalised by per-channel
  `latents_mean` / `latents_std` instead of one scaling factor and shift.

What the seam had to learn (docs/design.md, section 4, "One module per model family"): its VAE class,
latent normalisation and scale factor (`Model.decode_latents`, `Model.VAE`, `Model.vae_factor`) and the
shapes of its encodings for memory estimates (`Model.placeholder_embeds`) were SD3/FLUX facts written
outside the family modules; they are now the family's. Packing and the dynamic-shift schedule moved from
flux.py to `base` for both. Its last block computes a text output nothing reads, so the family names
those parameters (`Model.idle_parameters`) and train freezes them (DDP wants a gradient for every
trained one); and `Model.reference` now restores which parameters train (peft's enable_adapters would
make those trainable again). No stage's logic changed: the stored encodings are a dict of tensors the
stages pass back untouched, masks included.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpkit.errors import ModelError
from tpkit.models import base
from tpkit.models.base import Model, pack, unpack
from tpkit.models.names import QWEN_IMAGE_MODEL
from tpkit.runtime import quiet_libraries

NAME = "qwen-image"
TINY = QWEN_IMAGE_MODEL
_TINY_VERSION = 1
NEGATIVE_PROMPT = " "  # the published Qwen-Image GRPO configs' (flow_grpo train_qwenimage.py; verl)

# The published Qwen-Image GRPO LoRA targets (flow_grpo scripts/train_qwenimage.py; verl's recipe): the
# eight projections of every block's joint attention and both streams' feed-forward layers.
LORA_TARGETS = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2")

# Qwen-Image as the published GRPO configs train it: 512 px, true CFG 4, and 256 text tokens per prompt
# (verl's max_sequence_length; the chat template's answer prefix included). `sizes` for doctor's disk
# estimate: two sets of encodings (prompt and negative) of 256 x 3584 (Qwen2.5-VL-7B's width); a rank of
# the default targets is 6.6 M float32 parameters (60 blocks x 8 attention linears 3072 -> 3072 and 4
# feed-forward linears 3072 <-> 12288).
DEFAULTS = {"resolution": 512, "text_length": 256, "guidance": 4.0, "lora_targets": LORA_TARGETS,
            "lora_targets_optional": (),
            "sizes": {"latent_channels": 16, "vae_factor": 8, "prompt_sets": 2, "clip_tokens": 0, "text_dim": 3584,
                      "pooled_dim": 0, "lora_bytes_per_rank": 26_500_000}}
# Qwen/Qwen-Image's published configs (its transformer/ and vae/ config.json; see sd3.PUBLISHED): a 20 B
# MMDiT of 60 blocks, the Wan-style 3-D VAE (diffusers' defaults are Qwen-Image's), Qwen2.5-VL-7B (8.29 B
# with its vision tower, which text-to-image never runs but loads).
PUBLISHED = {
    "Qwen/Qwen-Image": {
        "transformer": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                            axes_dims_rope=[16, 56, 56]),
        "vae": dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                    temperal_downsample=[False, True, True], dropout=0.0),
        "text_params": 8_290_000_000},
}
BUILTIN = {TINY: {"resolution": 64, "text_length": 64,
                  "sizes": {**DEFAULTS["sizes"], "text_dim": 32, "lora_bytes_per_rank": 40_000}}}

# Qwen-Image's scheduler config (scheduler/scheduler_config.json of Qwen/Qwen-Image).
SCHEDULER = dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                 max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")

# --------------------------------------------------------------------------------------------
# Built-in tiny model
# --------------------------------------------------------------------------------------------

# The chat template's system prefix, pre-token by pre-token (Qwen2's pre-tokenizer splits words with
# their leading space, punctuation and newlines apart): with a merge for each, it is 34 tokens, as with
# the real tokenizer, so the pipeline's fixed `prompt_template_encode_start_idx` drops exactly it.
_TEMPLATE_WORDS = ("system", "Describe", " the", " image", " by", " detailing", " color", " shape", " size", " texture",
                   " quantity", " text", " spatial", " relationships", " of", " objects", " and", " background",
                   "user", "assistant")


def tiny_qwen_tokenizer():
    """A byte-level Qwen2 tokenizer: the 256 byte symbols, merges that make each word of the chat template
    one token, and the chat specials <|im_start|>, <|im_end|> (<|endoftext|> pads)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(byte.values())}
    merges: list[tuple[str, str]] = []
    for word in _TEMPLATE_WORDS:
        symbols = [byte[b] for b in word.encode()]
        left = symbols[0]
        for right in symbols[1:]:
            if (left, right) not in merges:
                merges.append((left, right))
                vocab.setdefault(left + right, len(vocab))
            left += right
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def build_tiny_qwen_image(path: Path) -> None:
    """tiny-qwen-image: a complete, deterministic, randomly initialised QwenImagePipeline (about 2 MB).

    Qwen-Image in miniature: a 2-block MMDiT with 3-axis RoPE and packed latents, a 3-D VAE that
    downsamples 8x to 16 channels (64 px -> 8x8 latent, 16 packed tokens; Qwen-Image's latents_mean/std),
    a 2-layer Qwen2.5-VL (text model of width 32 with multimodal RoPE, a one-block vision tower) over a
    byte-level tokenizer with the chat template's words (`tiny_qwen_tokenizer`), and Qwen-Image's scheduler."""
    quiet_libraries()
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = tiny_qwen_tokenizer()
    n, pad = len(tok), tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6))
    torch.manual_seed(1)
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    torch.manual_seed(2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=pad, eos_token_id=pad,
                         pad_token_id=pad, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                            "rope_theta": 1e6}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        # ids past the vocabulary: text-to-image never feeds images or video
        image_token_id=n, video_token_id=n + 1, vision_start_token_id=n + 2, vision_end_token_id=n + 3))
    QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=text_encoder,
                      tokenizer=tok, transformer=transformer).save_pretrained(path)


def location(model: str) -> Path | None:
    """Where tiny-qwen-image lives (built on first use); None for other models."""
    return base.built_path(TINY, _TINY_VERSION) if model == TINY else None


def resolve(model: str) -> str:
    """tiny-qwen-image -> its folder (built on first use); anything else as given."""
    return base.built(location(model), build_tiny_qwen_image) if model == TINY else model

# --------------------------------------------------------------------------------------------
# The loaded model
# --------------------------------------------------------------------------------------------


def padded(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L', D] encodings and their [B, L'] mask (None: all valid) cut or zero-padded to [B, length, D] and
    [B, length] (int64, 1 = a prompt token), as the pipeline pads a batch to its longest prompt."""
    B, n, D = embeds.shape
    mask = torch.ones(B, n, dtype=torch.long, device=embeds.device) if mask is None else mask.long()
    if n >= length:
        return embeds[:, :length], mask[:, :length]
    return (torch.cat([embeds, embeds.new_zeros(B, length - n, D)], 1),
            torch.cat([mask, mask.new_zeros(B, length - n)], 1))


def true_cfg(v_cond: torch.Tensor, v_neg: torch.Tensor, scale: float) -> torch.Tensor:
    """QwenImagePipeline's guidance on packed velocities [B, N, 4C]: v = v_neg + w (v_cond - v_neg), then
    rescaled token by token to the conditional velocity's norm (over the token width), ||v|| = ||v_cond||."""
    combined = v_neg + scale * (v_cond - v_neg)
    return combined * (v_cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImage(Model):
    FAMILY = NAME
    PIPELINE = "QwenImagePipeline"
    TRANSFORMER = "QwenImageTransformer2DModel"
    VAE = "AutoencoderKLQwenImage"
    TEXT_COMPONENTS = ("text_encoder", "tokenizer")

    def channels(self) -> int:
        return self.transformer.config.in_channels // 4  # 2x2 patches packed into the token width

    def forwards(self, guidance: float) -> int:
        return 2 if guidance > 1.0 else 1  # true CFG: the negative prompt is a second pass

    def idle_parameters(self, transformer) -> list[str]:
        """The last block's text-stream output (its attention's text projection and text feed-forward): the
        transformer returns the image tokens only, so nothing reads what they compute."""
        last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}."
        return [n for n, _ in transformer.named_parameters() if n.startswith((last + "attn.to_add_out", last + "txt_mlp."))]

    @classmethod
    def vae_factor(cls, vae_config: dict) -> int:
        return 2 ** len(vae_config["temperal_downsample"])  # QwenImagePipeline's vae_scale_factor

    @classmethod
    def placeholder_embeds(cls, transformer_config: dict, batch: int, text_length: int, fill, dtype, device=None) -> dict:
        e = lambda: fill(batch, text_length, transformer_config["joint_attention_dim"], dtype=dtype, device=device)  # noqa: E731
        m = lambda: torch.ones(batch, text_length, dtype=torch.long, device=device)  # noqa: E731
        return dict(prompt_embeds=e(), prompt_embeds_mask=m(), negative_prompt_embeds=e(), negative_prompt_embeds_mask=m())

    def sigmas(self, steps: int, resolution: int) -> list[float]:
        """QwenImagePipeline's: linspace(1, 1/T, T), shifted by mu(tokens at this resolution) with the
        scheduler's exponential time shift and terminal stretch, then 0."""
        return base.dynamic_shift_sigmas(self.pipe, steps, resolution)

    @torch.no_grad()
    def encode(self, prompts: list[str], text_length: int) -> dict[str, torch.Tensor]:
        """prompt_embeds [B, L, 3584] (Qwen2.5-VL-7B's width; L = text_length) in the transformer's dtype and
        prompt_embeds_mask [B, L] (int64), and their negative_ twins for the negative prompt " "."""
        if self.pipe.text_encoder is None:
            raise ModelError("this stage loaded the model without text encoders", "internal: load with text_encoders=True")
        out = {}
        for prefix, texts in (("", prompts), ("negative_", [NEGATIVE_PROMPT] * len(prompts))):
            pe, mask = self.pipe.encode_prompt(prompt=texts, device=self.device, num_images_per_prompt=1,
                                               max_sequence_length=text_length)
            pe, mask = padded(pe, mask, text_length)
            out[f"{prefix}prompt_embeds"], out[f"{prefix}prompt_embeds_mask"] = pe.to(self.dtype), mask
        return out

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float,
                 transformer=None) -> torch.Tensor:
        """The guided velocity (`true_cfg`; w <= 1: the prompt's alone), float32 [B, C, h, w] (see
        `Model.velocity`). One forward on packed tokens, the CFG pair as one doubled batch; the
        transformer's timestep input is sigma (the pipeline passes timestep / 1000)."""
        transformer = transformer or self.transformer
        B, _, h, w = x.shape
        tokens = pack(x.to(self.device)).to(self.dtype)
        t = sigma.to(self.device, self.dtype)
        enc, mask = embeds["prompt_embeds"], embeds["prompt_embeds_mask"]
        cfg = guidance > 1.0
        if cfg:
            tokens, t = torch.cat([tokens, tokens]), torch.cat([t, t])
            enc = torch.cat([enc, embeds["negative_prompt_embeds"]])
            mask = torch.cat([mask, embeds["negative_prompt_embeds_mask"]])
        out = transformer(
            hidden_states=tokens, timestep=t, encoder_hidden_states=enc.to(self.device, self.dtype),
            encoder_hidden_states_mask=mask.to(self.device), img_shapes=[[(1, h // 2, w // 2)]] * tokens.shape[0],
            return_dict=False,
        )[0].float()
        if cfg:
            out = true_cfg(*out.chunk(2), guidance)
        return unpack(out, h, w)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The 3-D VAE on one frame: latents de-normalised per channel (z / (1 / std) + mean, the pipeline's
        arithmetic), decoded, the frame axis dropped; [B, 3, H, W] in [-1, 1]."""
        vae = self.pipe.vae
        z = latents.to(self.device, torch.float32)[:, :, None]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(shape)
        z = z / (1.0 / std) + mean
        return vae.decode(z.to(vae.dtype), return_dict=False)[0][:, :, 0].float()


MODEL = QwenImage


def load(model: str, **kwargs) -> QwenImage:
    """`base.load` for this family (by hub id, local folder or tiny-qwen-image)."""
    return base.load(QwenImage, model, resolve(model), **kwargs)
