"""CLIP-based rewards: PickScore, CLIPScore and the LAION aesthetic predictor.

Each factory loads its models once (by hub id or local folder, through `tpkit.hub.load`, so a
missing model fails at start-up with a message naming the option to set), puts them in eval
mode on `pick_device("auto")` and returns a callable `(images, prompts, metadata) -> list[float]`
that scores in batches under `torch.no_grad()`.

- pickscore: `logit_scale.exp() * cos(image, prompt) * scale` with the PickScore_v1 CLIP-H/14
  (Kirstain et al. 2023). With `scale = 1` (default) scores are on the published scale, about
  20-24 for SD3.5 images. Flow-GRPO and TP-GRPO train on `score / 26`: set
  `--reward-opt pickscore.scale=1/26` (or 0.0384615) to reproduce their reward values.
- clipscore: CLIP-S of Hessel et al. 2021, `weight * max(cos(image, prompt), 0)` with
  CLIP ViT-L/14 and `weight = 2.5`.
- `tiny-shapes-pickscore`, a built-in name for `model` and `processor` (pickscore, clipscore): the
  tiny-shapes testbed's CLIP preference model, shipped in the package (`tpkit.shapes.preference`).
- aesthetic: LAION aesthetic predictor v2 (christophschuhmann/improved-aesthetic-predictor,
  `sac+logos+ava1-l14-linearMSE.pth`): an MLP head (no activations) on the L2-normalised CLIP
  ViT-L/14 image embedding; about 1-10, higher is prettier. Prompts are ignored.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpkit import hub
from tpkit.errors import ModelError, RewardError
from tpkit.models.names import SHAPES_PICKSCORE
from tpkit.rewards.options import RewardFn, take_options
from tpkit.runtime import pick_device, quiet_libraries

MAX_TEXT_TOKENS = 77  # CLIP's context length; PickScore's reference truncates prompts to it
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIP_L14 = "openai/clip-vit-large-patch14"
# The published head is in christophschuhmann/improved-aesthetic-predictor (GitHub); this hub
# repo mirrors the same file and is what most hub-based users (and caches) fetch it from.
AESTHETIC_HEAD = "camenduru/improved-aesthetic-predictor:sac+logos+ava1-l14-linearMSE.pth"
# Built-in CLIP models: name -> folder inside the package (CLIPModel and its processor, save_pretrained).
BUILTIN_MODELS = {SHAPES_PICKSCORE: Path(__file__).resolve().parent / SHAPES_PICKSCORE}


def resolve(model: str) -> str:
    """A built-in model name -> its folder; anything else (a hub id, a local folder) as given."""
    return str(BUILTIN_MODELS.get(model, model))


# ---------------------------------------------------------------------------------------------
# Options


def _number(reward: str, option: str, value: Any) -> float:
    """A float option; strings like '0.5' or '1/26' are accepted (handy on the command line)."""
    if isinstance(value, bool):
        raise RewardError(f"reward {reward!r}: option {option} = {value!r} is not a number", f"use e.g. {option}=1.0")
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(Fraction(str(value).strip()))
    except (ValueError, ZeroDivisionError):
        raise RewardError(f"reward {reward!r}: option {option} = {value!r} is not a number",
                          f"use e.g. --reward-opt {reward}.{option}=1.0") from None


def _batch_size(reward: str, value: Any) -> int:
    try:
        n = int(str(value)) if not isinstance(value, bool) else 0
    except ValueError:
        n = 0
    if n < 1:
        raise RewardError(f"reward {reward!r}: batch_size = {value!r} is not a positive integer",
                          f"use e.g. --reward-opt {reward}.batch_size=16")
    return n


def _dtype(reward: str, value: Any, device: torch.device) -> torch.dtype:
    if value not in DTYPES:
        raise RewardError(f"reward {reward!r}: unknown dtype {value!r}", f"use one of {', '.join(DTYPES)}")
    if device.type == "cpu" and value != "float32":
        return torch.float32  # half precision is slow or unsupported on CPU; keep scores exact there
    return DTYPES[value]


# ---------------------------------------------------------------------------------------------
# Shared CLIP loading and embedding


class ClipEmbedder:
    """A CLIPModel + CLIPProcessor on the reward device, embedding images and texts in batches.

    Embeddings are L2-normalised float32 tensors on the CPU, one row per input."""

    def __init__(self, reward: str, model: str, processor: str | None, batch_size: int, dtype: str,
                 what: str = "CLIP model"):
        from transformers import CLIPModel, CLIPProcessor

        quiet_libraries()  # no "Loading weights" bar inside tpkit's progress
        self.device = pick_device("auto")
        self.dtype = _dtype(reward, dtype, self.device)
        self.batch_size = batch_size
        model, processor = resolve(model), resolve(processor) if processor is not None else None
        proc_option = "processor" if processor is not None else "model"
        # The processor first: it is small, so a missing one fails before seconds of weight loading.
        self.processor = hub.load(CLIPProcessor.from_pretrained, processor or model,
                                  f"{reward} processor" if processor is not None else f"{what} (processor files)",
                                  f"--reward-opt {reward}.{proc_option}=PATH (a local folder or hub id)")
        self.model = hub.load(CLIPModel.from_pretrained, model, what,
                              f"--reward-opt {reward}.model=PATH (a local folder or hub id)")
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)

    @property
    def projection_dim(self) -> int:
        return int(self.model.config.projection_dim)

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.detach().float().exp().item())

    @staticmethod
    def _features(out) -> torch.Tensor:
        # transformers >= 5 returns a model output whose pooler_output is the projected embedding.
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    @staticmethod
    def _normalise(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x / x.norm(p=2, dim=-1, keepdim=True)

    def images(self, images: list) -> torch.Tensor:
        rows = []
        with torch.no_grad():
            for b in range(0, len(images), self.batch_size):
                batch = [im.convert("RGB") for im in images[b: b + self.batch_size]]
                pixels = self.processor(images=batch, return_tensors="pt")["pixel_values"]
                out = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))
                rows.append(self._normalise(self._features(out)).cpu())
        return torch.cat(rows) if rows else torch.zeros(0, self.projection_dim)

    def texts(self, texts: list[str]) -> torch.Tensor:
        rows = []
        with torch.no_grad():
            for b in range(0, len(texts), self.batch_size):
                tok = self.processor(text=list(texts[b: b + self.batch_size]), padding=True, truncation=True,
                                     max_length=MAX_TEXT_TOKENS, return_tensors="pt")
                out = self.model.get_text_features(input_ids=tok["input_ids"].to(self.device),
                                                   attention_mask=tok["attention_mask"].to(self.device))
                rows.append(self._normalise(self._features(out)).cpu())
        return torch.cat(rows) if rows else torch.zeros(0, self.projection_dim)

    def cosine(self, images: list, prompts: list[str]) -> torch.Tensor:
        """cos(image_i, prompt_i) for each image with its own prompt."""
        if len(images) != len(prompts):
            raise RewardError(f"{len(images)} images but {len(prompts)} prompts", "pass one prompt per image")
        return (self.images(images) * self.texts(prompts)).sum(-1)


# ---------------------------------------------------------------------------------------------
# PickScore and CLIPScore


def pickscore(options: dict) -> RewardFn:
    """PickScore_v1: `logit_scale.exp() * cos(image, prompt) * scale` (≈ 20-24 for SD3.5 at scale 1).

    Options: model (PickScore CLIP weights), processor (the CLIP-H/14 processor PickScore was trained
    with), scale (1 = published scale; Flow-GRPO/TP-GRPO train on score/26, i.e. scale=1/26),
    batch_size, dtype (float32 default; float16/bfloat16 only used on CUDA)."""
    o = take_options("pickscore", options, {"model": PICKSCORE_MODEL, "processor": PICKSCORE_PROCESSOR,
                                            "scale": 1.0, "batch_size": 16, "dtype": "float32"})
    scale = _number("pickscore", "scale", o["scale"])
    clip = ClipEmbedder("pickscore", str(o["model"]), str(o["processor"]), _batch_size("pickscore", o["batch_size"]),
                        o["dtype"], what="PickScore model")
    factor = clip.logit_scale * scale

    def score(images, prompts, metadata):
        return (factor * clip.cosine(images, prompts)).tolist()

    return score


def pickscore_files(options: dict) -> list[tuple]:
    """What pickscore loads (see registry.REQUIREMENTS): CLIP weights, and the processor from another repo."""
    return [("model", resolve(str(options.get("model", PICKSCORE_MODEL))), "clip-model", "model"),
            ("processor", resolve(str(options.get("processor", PICKSCORE_PROCESSOR))), "processor", "processor")]


def clipscore(options: dict) -> RewardFn:
    """CLIP-S (Hessel et al. 2021): `weight * max(cos(image, prompt), 0)` with CLIP ViT-L/14, weight 2.5.

    Options: model (a CLIPModel folder or hub id, which must hold its processor files too), weight,
    batch_size, dtype."""
    o = take_options("clipscore", options, {"model": CLIP_L14, "weight": 2.5, "batch_size": 16, "dtype": "float32"})
    weight = _number("clipscore", "weight", o["weight"])
    clip = ClipEmbedder("clipscore", str(o["model"]), None, _batch_size("clipscore", o["batch_size"]), o["dtype"],
                        what="CLIPScore CLIP model")

    def score(images, prompts, metadata):
        return (weight * clip.cosine(images, prompts).clamp(min=0)).tolist()

    return score


def clipscore_files(options: dict) -> list[tuple]:
    """What clipscore loads (see registry.REQUIREMENTS): a CLIP model with its processor."""
    return [("model", resolve(str(options.get("model", CLIP_L14))), "clip", "model")]


# ---------------------------------------------------------------------------------------------
# LAION aesthetic predictor v2


class AestheticHead(nn.Module):
    """The improved-aesthetic-predictor MLP, layer for layer, so its state-dict keys
    (layers.0/2/4/6/7.weight|bias) load unchanged. Linear layers only: the published model has
    its ReLUs commented out; the dropouts are inactive in eval mode."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


def _head_file(spec: str) -> Path:
    """A local .pth/.safetensors path, or 'repo_id:filename' from the hub (cache first, fail fast offline)."""
    return hub.file(spec, "aesthetic head", "--reward-opt aesthetic.head=PATH (the .pth file, or repo_id:filename on the hub)",
                    " (or get it from github.com/christophschuhmann/improved-aesthetic-predictor)")


def load_aesthetic_head(path: Path, input_size: int) -> AestheticHead:
    fix = "--reward-opt aesthetic.head=PATH to the improved-aesthetic-predictor weights (sac+logos+ava1-l14-linearMSE.pth)"
    state = hub.state_dict(path, "aesthetic head", fix)
    first = state.get("layers.0.weight") if isinstance(state, dict) else None
    if not isinstance(first, torch.Tensor) or first.ndim != 2:
        raise ModelError(f"aesthetic head {path} is not an improved-aesthetic-predictor state dict "
                         "(no layers.0.weight)", fix)
    if first.shape[1] != input_size:
        raise ModelError(f"aesthetic head {path} takes {first.shape[1]}-dim embeddings but the CLIP model gives "
                         f"{input_size}-dim ones", "use the head trained for this CLIP model (768 for ViT-L/14)")
    head = AestheticHead(input_size)
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ModelError(f"aesthetic head {path} does not match the predictor's layers: {str(e)[:300]}", fix) from None
    return head


def aesthetic(options: dict) -> RewardFn:
    """LAION aesthetic predictor v2: MLP head on the L2-normalised CLIP ViT-L/14 image embedding.

    Options: model (CLIP, with its processor files), head (.pth/.safetensors path or
    repo_id:filename; default the sac+logos+ava1-l14-linearMSE head), batch_size, dtype."""
    o = take_options("aesthetic", options, {"model": CLIP_L14, "head": AESTHETIC_HEAD, "batch_size": 16,
                                            "dtype": "float32"})
    batch_size = _batch_size("aesthetic", o["batch_size"])
    head_file = _head_file(str(o["head"]))  # the small file first: fail before loading CLIP
    clip = ClipEmbedder("aesthetic", str(o["model"]), None, batch_size, o["dtype"], what="aesthetic CLIP model")
    head = load_aesthetic_head(head_file, clip.projection_dim).to(clip.device).eval()

    def score(images, prompts, metadata):
        embeds = clip.images(images)
        with torch.no_grad():
            return head(embeds.to(clip.device)).squeeze(-1).float().cpu().tolist()

    return score


def aesthetic_files(options: dict) -> list[tuple]:
    """What aesthetic loads (see registry.REQUIREMENTS): a CLIP model with its processor, and the head's file."""
    return [("model", str(options.get("model", CLIP_L14)), "clip", "model"),
            ("head", str(options.get("head", AESTHETIC_HEAD)), "file", "head")]
