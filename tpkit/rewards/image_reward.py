"""ImageReward (Xu et al., NeurIPS 2023) on transformers' BLIP modules, from the official checkpoint.

The `image-reward` package needs timm and fairscale, which pull torchvision (it breaks the CPU
install), so the model is rebuilt here from transformers' BLIP ports and the official
`ImageReward.pt` (THUDM/ImageReward) is loaded by renaming its keys at load time:

    score = (MLP(BERT_cls(tokens(prompt), cross-attending to ViT(image))) - 0.16717362830052426) / 1.0333394966054072

- image: Resize(224, bicubic) of the shorter side, CenterCrop(224), RGB in [0, 1], normalised with
  CLIP's mean and std (ImageReward's `_transform`, reproduced with PIL and NumPy);
- ViT (`blip.visual_encoder.*`, BLIP's ViT-L/16: pre-norm blocks, fused qkv, LayerNorm eps 1e-6, the
  final norm applied to every token) -> `BlipVisionModel` (`embeddings.class_embedding`,
  `embeddings.position_embedding`, `embeddings.patch_embedding`, `encoder.layers.N.{layer_norm1,
  self_attn.qkv, self_attn.projection, layer_norm2, mlp.fc1, mlp.fc2}`, `post_layernorm`);
- text (`blip.text_encoder.*`, BLIP's med BERT with cross-attention in every layer, no token-type
  embeddings) -> `BlipTextModel` under the same names, run bidirectionally (is_decoder=False);
  tokens: bert-base-uncased (google-bert/) plus BLIP's two added tokens ([DEC], [ENC]; 30524 ids), padded to 35,
  the [CLS] token's last hidden state is the feature (ImageReward's `score`, no [ENC] swap);
- MLP (`mlp.layers.{0,2,4,6,7}`): 768 -> 1024 -> 128 -> 64 -> 16 -> 1 with no activations, the same
  stack as the LAION aesthetic head.

Sizes come from the checkpoint's shapes (so any BLIP width or depth loads); head counts are width /
64 (ViT-L 16, BERT-base 12; at least 1) unless given. Keys the score does not use (`blip.vision_proj`,
`blip.text_proj`, position-id buffers) are ignored; any other unknown or missing key is an error.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from tpkit import hub
from tpkit.rewards.clip import AestheticHead, _batch_size, _dtype
from tpkit.errors import ModelError
from tpkit.rewards.options import RewardFn, take_options
from tpkit.runtime import pick_device

CHECKPOINT = "THUDM/ImageReward:ImageReward.pt"
TOKENIZER = "google-bert/bert-base-uncased"
MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward's normalisation of the MLP output
IMAGE_SIZE, MAX_TOKENS = 224, 35
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
UNUSED = re.compile(r"blip\.(vision_proj|text_proj)\.|.*position_ids$")
FIX = "--reward-opt imagereward.checkpoint=PATH (ImageReward.pt, or repo_id:filename on the hub)"


def preprocess(image, size: int = IMAGE_SIZE) -> np.ndarray:
    """ImageReward's transform without torchvision: [3, size, size] float32."""
    from PIL import Image

    image = image.convert("RGB")
    w, h = image.size
    if min(w, h) != size:  # torchvision's Resize(int): the shorter side to size, the longer truncated
        if w <= h:
            new = (size, int(size * h / w))
        else:
            new = (int(size * w / h), size)
        image = image.resize(new, Image.BICUBIC)
    w, h = image.size
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    image = image.crop((left, top, left + size, top + size))
    x = np.asarray(image, dtype=np.float32) / 255.0
    x = (x - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)
    return x.transpose(2, 0, 1).copy()


def _vision_key(key: str) -> str | None:
    k = key.removeprefix("blip.visual_encoder.")
    fixed = {"cls_token": "embeddings.class_embedding", "pos_embed": "embeddings.position_embedding",
             "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
             "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
             "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}
    if k in fixed:
        return fixed[k]
    m = re.fullmatch(r"blocks\.(\d+)\.(norm1|attn\.qkv|attn\.proj|norm2|mlp\.fc1|mlp\.fc2)\.(weight|bias)", k)
    if not m:
        return None
    part = {"norm1": "layer_norm1", "attn.qkv": "self_attn.qkv", "attn.proj": "self_attn.projection",
            "norm2": "layer_norm2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}[m.group(2)]
    return f"encoder.layers.{m.group(1)}.{part}.{m.group(3)}"


def split_checkpoint(state: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """The official state dict as (BlipVisionModel, BlipTextModel, MLP) state dicts."""
    vision, text, mlp, unknown = {}, {}, {}, []
    for key, value in state.items():
        if UNUSED.match(key):
            continue
        if key.startswith("blip.visual_encoder."):
            new = _vision_key(key)
            (vision.__setitem__(new, value) if new else unknown.append(key))
        elif key.startswith("blip.text_encoder."):
            text[key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp."):
            mlp[key.removeprefix("mlp.")] = value
        else:
            unknown.append(key)
    if unknown or not vision or not text or not mlp:
        what = f"unknown keys ({', '.join(unknown[:3])}...)" if unknown else "no ViT, text encoder or MLP weights"
        raise ModelError(f"not an ImageReward checkpoint: {what}", FIX)
    return vision, text, mlp


def build(state: dict[str, torch.Tensor], vision_heads: int = 0, text_heads: int = 0):
    """(BlipVisionModel, BlipTextModel, MLP head) with the checkpoint's weights, sizes from its shapes."""
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    vsd, tsd, msd = split_checkpoint(state)
    width = vsd["embeddings.class_embedding"].shape[-1]
    patch = vsd["embeddings.patch_embedding.weight"].shape[-1]
    tokens = vsd["embeddings.position_embedding"].shape[1] - 1
    depth = 1 + max(int(k.split(".")[2]) for k in vsd if k.startswith("encoder.layers."))
    vision = BlipVisionModel(BlipVisionConfig(
        hidden_size=width, intermediate_size=vsd["encoder.layers.0.mlp.fc1.weight"].shape[0], num_hidden_layers=depth,
        num_attention_heads=vision_heads or max(1, width // 64), image_size=patch * round(tokens ** 0.5), patch_size=patch,
        layer_norm_eps=1e-6, hidden_act="gelu"))
    hidden = tsd["embeddings.word_embeddings.weight"].shape[1]
    text = BlipTextModel(BlipTextConfig(
        vocab_size=tsd["embeddings.word_embeddings.weight"].shape[0], hidden_size=hidden,
        encoder_hidden_size=width, intermediate_size=tsd["encoder.layer.0.intermediate.dense.weight"].shape[0],
        num_hidden_layers=1 + max(int(k.split(".")[2]) for k in tsd if k.startswith("encoder.layer.")),
        num_attention_heads=text_heads or max(1, hidden // 64),
        max_position_embeddings=tsd["embeddings.position_embeddings.weight"].shape[0], layer_norm_eps=1e-12,
        hidden_act="gelu", is_decoder=True), add_pooling_layer=False)  # is_decoder builds the cross-attention
    head = AestheticHead(msd["layers.0.weight"].shape[1])
    for name, module, sd in (("ViT", vision, vsd), ("text encoder", text, tsd), ("MLP", head, msd)):
        missing, unexpected = module.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ModelError(f"ImageReward checkpoint does not fit BLIP's {name}: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}", FIX)
    return vision.eval(), text.eval(), head.eval()


def load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return hub.state_dict(path, "ImageReward checkpoint", FIX)


def load_tokenizer(id_or_path: str):
    """bert-base-uncased with BLIP's added tokens ([DEC] as bos, [ENC]), as ImageReward's `init_tokenizer`."""
    from transformers import BertTokenizer

    tok = hub.load(BertTokenizer.from_pretrained, id_or_path, "ImageReward tokenizer (bert-base-uncased)",
                   "--reward-opt imagereward.tokenizer=PATH (a bert-base-uncased tokenizer folder)")
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


class ImageReward:
    """The scorer: `(images, prompts) -> list[float]`, batched, no gradients."""

    def __init__(self, state: dict, tokenizer, batch_size: int = 16, dtype: torch.dtype = torch.float32,
                 device=None, vision_heads: int = 0, text_heads: int = 0):
        self.device = device or torch.device("cpu")
        self.vision, self.text, self.head = build(state, vision_heads, text_heads)
        for m in (self.vision, self.text, self.head):
            m.to(self.device, dtype).requires_grad_(False)
        self.tokenizer, self.batch_size, self.dtype = tokenizer, batch_size, dtype
        self.image_size = self.vision.config.image_size
        if len(tokenizer) != self.text.config.vocab_size:  # 30522 + [DEC] + [ENC] for the official checkpoint
            raise ModelError(f"the tokenizer has {len(tokenizer)} ids but the checkpoint's text encoder "
                             f"{self.text.config.vocab_size}", "use bert-base-uncased, the tokenizer ImageReward was trained with")

    @torch.no_grad()
    def __call__(self, images: list, prompts: list[str]) -> list[float]:
        out: list[float] = []
        for b in range(0, len(images), self.batch_size):
            pixels = torch.from_numpy(np.stack([preprocess(im, self.image_size) for im in images[b: b + self.batch_size]]))
            tok = self.tokenizer(list(prompts[b: b + self.batch_size]), padding="max_length", truncation=True,
                                 max_length=MAX_TOKENS, return_tensors="pt")
            image_embeds = self.vision(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
            image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
            hidden = self.text(input_ids=tok["input_ids"].to(self.device),
                               attention_mask=tok["attention_mask"].to(self.device),
                               encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                               is_decoder=False).last_hidden_state
            rewards = self.head(hidden[:, 0, :]).squeeze(-1).float()
            out += ((rewards - MEAN) / STD).cpu().tolist()
        return out


def imagereward(options: dict) -> RewardFn:
    """ImageReward-v1.0: about -2..2, higher is preferred (see the module docstring).

    Options: checkpoint (ImageReward.pt path or repo_id:filename), tokenizer (bert-base-uncased folder
    or hub id), batch_size, dtype (float32 default; float16/bfloat16 only used on CUDA)."""
    o = take_options("imagereward", options, {"checkpoint": CHECKPOINT, "tokenizer": TOKENIZER, "batch_size": 16,
                                              "dtype": "float32"})
    device = pick_device("auto")
    tokenizer = load_tokenizer(str(o["tokenizer"]))  # small: fail before reading 1.7 GB of weights
    path = hub.file(str(o["checkpoint"]), "ImageReward checkpoint", FIX)
    model = ImageReward(load_checkpoint(path), tokenizer, _batch_size("imagereward", o["batch_size"]),
                        _dtype("imagereward", o["dtype"], device), device)

    def score(images, prompts, metadata):
        return model(images, prompts)

    return score


def imagereward_files(options: dict) -> list[tuple]:
    """What imagereward loads (see registry.REQUIREMENTS): the checkpoint file and a BERT tokenizer."""
    return [("checkpoint", str(options.get("checkpoint", CHECKPOINT)), "file", "checkpoint"),
            ("tokenizer", str(options.get("tokenizer", TOKENIZER)), "bert-tokenizer", "tokenizer")]
