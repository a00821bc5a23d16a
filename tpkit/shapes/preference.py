"""`tiny-shapes-pickscore`: a learned, continuous preference model for the tiny-shapes testbed.

An ordinary `transformers` `CLIPModel` with its `CLIPProcessor`, saved with `save_pretrained` inside
the package (`tpkit/rewards/tiny-shapes-pickscore/`) and scored by the `pickscore` reward exactly as
PickScore_v1 is (`logit_scale.exp() * cos(image, prompt)`): `--reward pickscore --reward-opt
pickscore.model=tiny-shapes-pickscore --reward-opt pickscore.processor=tiny-shapes-pickscore`. So
the testbed's reward is continuous (no ties between two images of one prompt, unlike GenEval's
dense score), learned, and fallible in the ways real preference models are.

Model: ViT (patch 8 on 64 px -> 64 patches, width 128, 4 layers) and a text transformer (width 128,
3 layers) over the word-level tokenizer of tiny-shapes itself (every caption word one token), both
projected to 128 dimensions; about 1.5 M parameters, 6 MB in float32.

Training (`tpkit pretrain-shapes-reward --out DIR`; fixed seed; resumable: rerun the same command):
**train-split prompts only** (`tpkit.shapes.scenes.is_test`): no test prompt is ever a caption,
positive or negative, so the test split measures captions the model never read. Each batch is
pairs of scenes: a scene for a train prompt P, and a scene for a prompt N that changes one detail
of P (a class, a colour, a count, the relation, which colour goes with which shape), each scene
checked by GenEval's own judge on its true boxes to satisfy its prompt and not the other. The loss
is cross-entropy both ways: each image against its caption, the pair's other caption and more
one-detail-wrong and random captions (every one checked false for that image: `negatives`); each
caption against the two images of its pair (the one it describes wins). Images are augmented
(colour jitter, Gaussian blur of up to 2 px, noise) so that blurry samples of the generator are
judged, not only crisp renders. From step `rank_start` a Bradley-Terry term also ranks pairs of the
generator's own samples of one prompt by their dense score (`sample_pairs`, the sample bank) and, in
probes the shipped model does not use (`bench/shapes/reward/`), rendered near misses of a prompt
(`graded_pairs`, `graded_by`) and the two captions of a bank sample that the shapes detector's verdict on
it tells apart (`caption_pairs`); and a training-only head that regresses where each shape class is from the
image embedding (`layout_aux`).

Quality is measured on **test-split** prompts (`pairwise_accuracy`, `bench/shapes/reward/`): the
matching caption against a one-detail-wrong caption, per GenEval task.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from tpkit import layout, models
from tpkit.config import RolloutConfig
from tpkit.errors import InputError
from tpkit.geneval import detectors
from tpkit.geneval import prompts as gp
from tpkit.geneval.judge import judge
from tpkit.models.names import SHAPES_MODEL, SHAPES_PICKSCORE
from tpkit.rewards.clip import BUILTIN_MODELS
from tpkit.shapes import model as shapes_model
from tpkit.shapes import scenes as shapes
from tpkit.shapes.model import caption_words, word_tokenizer
from tpkit.ui import console

NAME = SHAPES_PICKSCORE
SIZE = shapes.CANVAS  # 64 px: the tiny-shapes resolution
TEXT_POSITIONS = 77  # CLIP's context length: the reward truncates to it, so any prompt fits
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)  # pixels to [-1, 1]
GRADED_BY = ("truth", "detector")
BANKS = ("samples", "branches")
DETECTED_IMAGES = 16  # detector_aux: bank samples a batch whose detections the head regresses
CONSISTENT_IMAGES, SHIFT_MOST = 16, 4  # shift_consistency: images a batch moved, by up to this many px (half a patch)
BLOB_BLUR, BLOB_GAIN = 3.0, 4.0  # "detector" grading: Gaussian blur sigma up to this, then contrast gain up to this
# absolute_pairs: where a single shape is, per axis (first half, second half of the canvas); the words these add
# to the prompts' vocabulary ("left" and "right" are in it)
WHERE = {"x": ("on the left", "on the right"), "y": ("at the top", "at the bottom")}
WHERE_WORDS = ("on", "at", "the", "top", "bottom")


def weights_dir() -> Path:
    """The committed model folder inside the installed package."""
    return BUILTIN_MODELS[NAME]


HEAD_DIM = 32  # `--width W` keeps each attention head this wide: W // HEAD_DIM heads


@dataclass
class Arch:
    width: int = 128  # both towers' hidden size (the MLPs are 4x); 1.48 M parameters in all at 128, 3.25 M at 192
    vision_layers: int = 4
    text_layers: int = 3
    heads: int = 4
    patch: int = 8  # the ViT's patch side in px: 8 -> 64 patches of 64 px; 4 -> 256, about 3.5x the training step
    projection: int = 128


@dataclass
class Recipe:
    seed: int = 0
    steps: int = 2500  # about 27 minutes on 2 cores (one renders, one trains), after the bank's 2
    pairs: int = 32  # scene pairs per batch (64 images)
    negatives: int = 8  # extra captions per image, each checked false for it (one-detail-wrong first)
    lr: float = 1e-3
    warmup: int = 200
    weight_decay: float = 0.05
    blur: float = 2.0  # Gaussian blur sigma up to this many px (on 70 % of the images)
    noise: float = 0.06  # pixel noise std up to this (in [0, 1] units)
    jitter: float = 0.12  # per-channel gain 1 +- jitter, offset +- jitter / 2
    checkpoint_minutes: float = 2.0
    sample_pairs: int = 12  # pairs of tiny-shapes samples of one prompt per batch, ranked by the dense score (0: none)
    samples_per_prompt: int = 8  # the bank: tiny-shapes samples of each train prompt
    sample_steps: int = 10  # ... drawn with this many ODE steps (the rollout's: what the reward judges in RL)
    # What the bank holds. "samples": ODE samples from fresh noise, ranked within a prompt (the shipped model).
    # "branches": samples_per_prompt rollouts a prompt, each the ODE completions from every state of one SDE
    # trajectory (`shapes_model.branch_images`, the rollout's sampler and noise level), ranked within a trajectory:
    # the very images whose rewards R_k give TP-GRPO its step rewards d_k. Two completions of one trajectory share
    # the noise they start from, so where the dense score differs, mostly one detail does (an object lost, gained,
    # recoloured): the generator's own near misses, where fresh samples of a prompt differ in everything.
    bank: str = "samples"
    # The ranking term from this step on, at this weight: from the first step it has a text-free solution
    # (every caption embedded alike, the image's quality alone ranks a pair), which kept the captions at chance.
    rank_start: int = 800
    rank_weight: float = 0.5
    # Ranked pairs of rendered near misses per batch (`scenes.edited_scene`: 0-2 objects dropped, added,
    # recoloured or reshaped), ordered by their dense score for the prompt, in the same ranking term from
    # rank_start: the grades of the generator's samples (a missing object, an extra one, one colour wrong)
    # on unlimited scenes, where the sample bank's few are memorised. 0: none (the shipped model).
    graded_pairs: int = 0
    # How a graded pair is graded: "truth" (crisp renders, the scene's true boxes as perfect detections) or
    # "detector" (renders blurred and saturated into the generator's blobs, where a rounded square may pass
    # for a circle, then judged as the samples are: the shapes detector, then GenEval's judge).
    graded_by: str = "truth"
    # Bank samples per batch, each ranked under two captions, its prompt and a one-detail-wrong train prompt,
    # by their dense scores on the shapes detector's detections of that sample (Bradley-Terry, from rank_start):
    # the detector's verdict on the generator's own blobs (a rounded square it calls a circle ranks "circle"
    # above "square"), which the ranking of samples of one prompt learns only as a memorised bank. 0: none.
    caption_pairs: int = 0
    # Relative share of each GenEval task's scene pairs, in `shapes.TAGS` order (None: alike, the shipped
    # model's draw): `--task-weight position=3` for more of the relation scenes the model finds hardest.
    task_weights: tuple[float, ...] | None = None
    # Weight of a training-only objective: a linear head on the image embedding regresses, for every shape class,
    # whether the rendered scene holds it and where its centre is (`layout_targets`); the head is thrown away, the
    # saved model stays a plain CLIPModel. Why: a relation starts with no gradient. At initialisation a scene and its
    # mirror embed alike, so "left of" and "right of" get no push apart, and so neither do the two images; the head
    # makes the image embedding say where things are (`bench/shapes/relation_saddle.py`). In the full recipe it
    # teaches the relation of the train prompts, but not of unseen shape pairs (`bench/shapes/reward/layout-bn/`).
    # 0: none (the shipped model).
    layout_aux: float = 0.0
    # Share of position pairs whose partner is the same scene mirrored across the relation's axis and captioned
    # with the opposite relation (where that prompt is of the split): a pair that differs in nothing but where the
    # shapes are, so both loss terms pull "left of" and "right of" apart. Otherwise the partner is a scene of a
    # one-detail-wrong prompt, which mostly differs in its shapes. 0: none (the shipped model).
    mirror_pairs: float = 0.0
    # Weight of a training-only term: the augmented renders of the first CONSISTENT_IMAGES images of a batch again,
    # moved by 1-SHIFT_MOST whole pixels (`pixel_shifts`), must get the reward of their own caption they got unmoved
    # (squared difference of exp(logit_scale) * cos, the scale held). Why: a ViT with 8 px patches sees a moved image
    # through another grid. Moved by one pixel, a blurred render's reward under the shipped model changes by 0.39 on
    # average (a prompt's renders spread by 0.53), and its ranks of a prompt's samples agree with themselves at only
    # 0.72 (`bench/shapes/dense_reliability.py`), where GenEval's dense score agrees at 0.99. At weight 1 it mends that
    # (0.84) but costs rendered accuracy and leaves the correlation with the dense score as it was
    # (`bench/shapes/reward/shift/`). 0: none (the shipped model).
    shift_consistency: float = 0.0
    # A curriculum from absolute positions to relations. absolute_pairs of a batch's pairs are a single shape wholly
    # in one half of the canvas, captioned where it is ("a photo of a circle on the left"; `_absolute_pair`), and the
    # same scene mirrored ("... on the right"), for every shape, including those the test split's relations pair;
    # scene pairs of position prompts are drawn only from step relation_start on (the ranking terms are not held
    # back). Why: a relation is learned only for the pairs of shapes it was contrasted on
    # (`bench/shapes/reward/mirror/`); where each shape is, learned first and for every shape, might be what an unseen
    # pair's relation is composed of. It is not: with 4 pairs from step 0 and relations from step 400 the places are
    # learned (1.000) and unseen pairs' relations stay at chance, at a cost in colour (`bench/shapes/reward/absolute/`,
    # `bench/shapes/relation_both_ways.py`). 0, 0: none (the shipped model).
    absolute_pairs: int = 0
    relation_start: int = 0
    # Weight of a training-only objective on the generator's own blobs: a head on the image embedding regresses how
    # many objects of each colour and class the shapes detector finds in DETECTED_IMAGES bank samples a batch
    # (`detected_counts`), from rank_start (from the first step it held the captions at chance); thrown away like the
    # layout head. Why: linear probes of the shipped model's frozen image embedding recover only a third of the
    # variance of those counts on test prompts' samples (R^2 0.33; `bench/shapes/embedding_probe.py`), so the tower
    # does not carry what decides the dense score, and one ranking bit a pair (the sample ranking, --caption-pairs)
    # never taught it. At 0.5 with a bank of 16 a prompt the probe reads 0.41 and the reward's correlation with the
    # dense score stays where it was (`bench/shapes/reward/counts/`). 0: none (the shipped model).
    detector_aux: float = 0.0
    arch: Arch = field(default_factory=Arch)

    def validate(self) -> "Recipe":
        """Every count and rate in range before any work; an InputError naming the option otherwise."""
        for name in ("seed", "steps", "pairs", "negatives", "warmup", "sample_pairs", "samples_per_prompt", "sample_steps",
                     "rank_start", "graded_pairs", "caption_pairs", "absolute_pairs", "relation_start"):
            value = getattr(self, name)
            low = 0 if name in ("seed", "warmup", "sample_pairs", "rank_start", "graded_pairs", "caption_pairs",
                                "absolute_pairs", "relation_start") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{flag} {value!r} must be a whole number >= {low}", f"e.g. {flag} {getattr(Recipe, name)}")
        a = self.arch
        if not (type(a.width) is int and a.width >= HEAD_DIM and a.width % HEAD_DIM == 0):
            raise InputError(f"--width {a.width!r} must be a positive multiple of {HEAD_DIM}, each attention head's width",
                             f"e.g. --width {2 * Arch().width}")
        if a.heads * HEAD_DIM != a.width:  # (the CLI derives the heads; a Python caller may not)
            raise InputError(f"Arch(width={a.width}, heads={a.heads}): each head must be {HEAD_DIM} wide",
                             f"use Arch(width={a.width}, heads={a.width // HEAD_DIM})")
        if not (type(a.patch) is int and 0 < a.patch <= SIZE and SIZE % a.patch == 0):
            raise InputError(f"--patch {a.patch!r} must divide the {SIZE} px image into whole patches", "e.g. --patch 8 or --patch 4")
        if self.absolute_pairs > self.pairs:
            raise InputError(f"--absolute-pairs {self.absolute_pairs} is more than the batch's {self.pairs} pairs",
                             "e.g. --absolute-pairs 4")
        if self.sample_pairs and self.bank == "branches" and self.sample_steps < 2:
            raise InputError(f"--sample-steps {self.sample_steps}: ranking the states of one trajectory needs at least 2",
                             "e.g. --sample-steps 10 (the rollout's)")
        if self.sample_pairs and self.bank == "samples" and self.samples_per_prompt < 2:
            raise InputError(f"--samples-per-prompt {self.samples_per_prompt}: ranking samples of one prompt needs at least 2",
                             "e.g. --samples-per-prompt 8, or --sample-pairs 0 (rendered scenes only)")
        for name in ("lr", "weight_decay", "blur", "noise", "jitter", "checkpoint_minutes", "rank_weight", "layout_aux",
                     "shift_consistency", "detector_aux"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InputError(f"{name} = {value!r} must be a finite number >= 0", f"e.g. {getattr(Recipe, name)}")
        if not (isinstance(self.mirror_pairs, (int, float)) and 0 <= self.mirror_pairs <= 1):
            raise InputError(f"--mirror-pairs {self.mirror_pairs!r} must be a share in [0, 1]", "e.g. --mirror-pairs 1")
        if self.bank not in BANKS:
            raise InputError(f"--bank {self.bank!r} is not one of {', '.join(BANKS)}", "e.g. --bank branches")
        if self.graded_by not in GRADED_BY:
            raise InputError(f"--graded-by {self.graded_by!r} is not one of {', '.join(GRADED_BY)}", "e.g. --graded-by detector")
        w = self.task_weights
        if w is not None and not (len(w) == len(shapes.TAGS) and all(math.isfinite(x) and x >= 0 for x in w) and sum(w) > 0):
            raise InputError(f"task_weights = {w!r}: one finite weight >= 0 per task ({', '.join(shapes.TAGS)}), not all 0",
                             "e.g. --task-weight position=3")
        return self


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def build(arch: Arch | None = None, seed: int = 0, words: tuple[str, ...] = ()):
    """A randomly initialised (CLIPModel, CLIPProcessor), deterministic from `seed`; `words`: one token each beyond
    the prompts' vocabulary (a larger vocabulary draws another initialisation)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    arch = arch or Arch()
    tok = word_tokenizer(caption_words() + ["photo", *words], max_length=TEXT_POSITIONS)
    text = dict(vocab_size=len(tok), hidden_size=arch.width, intermediate_size=4 * arch.width,
                num_hidden_layers=arch.text_layers, num_attention_heads=arch.heads,
                max_position_embeddings=TEXT_POSITIONS, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=arch.width, intermediate_size=4 * arch.width, num_hidden_layers=arch.vision_layers,
                  num_attention_heads=arch.heads, image_size=SIZE, patch_size=arch.patch)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=arch.projection))
    images = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE},
                                image_mean=list(MEAN), image_std=list(STD), do_convert_rgb=True)
    return model, CLIPProcessor(image_processor=images, tokenizer=tok)


# --------------------------------------------------------------------------------------------
# Captions: one detail wrong
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _prompts(tag: str, split: str | None) -> tuple[dict, ...]:
    """`scenes.split_prompts`, computed once (read only here: the dicts are shared)."""
    return tuple(shapes.split_prompts(tag, split))


@lru_cache(maxsize=None)
def _test_prompts() -> frozenset[str]:
    return frozenset(m["prompt"] for tag in shapes.TAGS for m in _prompts(tag, "test"))


def _in_split(meta: dict, split: str | None) -> bool:
    return split is None or (meta["prompt"] in _test_prompts()) == (split == "test")


def _parts(meta: dict) -> dict:
    """The arguments of `scenes.metadata` that made a prompt (a, b, colour, colour_b, count, relation)."""
    inc, tag = meta["include"], meta["tag"]
    if tag == "position":
        return {"a": inc[1]["class"], "b": inc[0]["class"], "relation": inc[1]["position"][0]}
    out = {"a": inc[0]["class"], "colour": inc[0].get("color"), "count": int(inc[0]["count"])}
    if len(inc) > 1:
        out.update(b=inc[1]["class"], colour_b=inc[1].get("color"))
    return out


def one_detail_wrong(meta: dict) -> list[dict]:
    """Every prompt of the same task that changes exactly one detail of `meta`: one object's class, one
    colour, the count, the relation (its opposite, or the other axis), or which colour goes with which
    shape. Not checked against a scene (a changed relation may still hold): see `negatives`."""
    tag, p = meta["tag"], _parts(meta)
    a, b = p["a"], p.get("b")
    others = lambda *used: [s for s in shapes.SHAPES if s not in used]  # noqa: E731
    out = []
    if tag == "single_object":
        out += [shapes.metadata(tag, c) for c in others(a)]
    elif tag == "two_object":
        out += [shapes.metadata(tag, c, b) for c in others(a, b)] + [shapes.metadata(tag, a, c) for c in others(a, b)]
    elif tag == "counting":
        out += [shapes.metadata(tag, a, count=n) for n in range(2, shapes.MAX_COUNT + 1) if n != p["count"]]
        out += [shapes.metadata(tag, c, count=p["count"]) for c in others(a)]
    elif tag == "colors":
        out += [shapes.metadata(tag, a, colour=c) for c in shapes.COLOURS if c != p["colour"]]
        out += [shapes.metadata(tag, c, colour=p["colour"]) for c in others(a)]
    elif tag == "position":
        out += [shapes.metadata(tag, a, b, relation=r) for r in gp.RELATIONS if r != p["relation"]]
        out += [shapes.metadata(tag, c, b, relation=p["relation"]) for c in others(a, b)]
        out += [shapes.metadata(tag, a, c, relation=p["relation"]) for c in others(a, b)]
    elif tag == "color_attr":
        ca, cb = p["colour"], p["colour_b"]
        out.append(shapes.metadata(tag, a, b, colour=cb, colour_b=ca))  # the binding swapped
        out += [shapes.metadata(tag, a, b, colour=c, colour_b=cb) for c in shapes.COLOURS if c not in (ca, cb)]
        out += [shapes.metadata(tag, a, b, colour=ca, colour_b=c) for c in shapes.COLOURS if c not in (ca, cb)]
        out += [shapes.metadata(tag, c, b, colour=ca, colour_b=cb) for c in others(a, b)]
    return out


def negatives(meta: dict, scene: shapes.Scene, rng: np.random.Generator, n: int, split: str | None = "train",
              first: list[dict] = ()) -> list[str]:
    """Up to n captions false for `scene` (GenEval's judge on its true boxes says so): `first`, then
    one-detail-wrong prompts of `meta` in random order, then random prompts of any task; of `split`
    only (None: both)."""
    boxes = shapes.visible_boxes(scene.objects)
    wrong = one_detail_wrong(meta)
    pool = list(first) + [wrong[i] for i in rng.permutation(len(wrong))]
    for _ in range(20 * n):  # then random prompts
        tag = shapes.TAGS[int(rng.integers(len(shapes.TAGS)))]
        cands = _prompts(tag, split)
        pool.append(cands[int(rng.integers(len(cands)))])
    out: list[str] = []
    for m in pool:
        if len(out) >= n:
            break
        if (m["prompt"] not in out and m["prompt"] != meta["prompt"] and _in_split(m, split)
                and not shapes.satisfied(m, scene.objects, boxes)):
            out.append(m["prompt"])
    return out


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@dataclass
class Batch:
    pixels: torch.Tensor  # [2P, 3, SIZE, SIZE] in [-1, 1]; images 2i and 2i + 1 are a pair
    captions: list[str]  # [2P]: each image's own prompt
    candidates: list[list[str]]  # [2P][1 + negatives]: the own prompt first, then captions false for the image
    ranked: torch.Tensor | None = None  # [2S, 3, SIZE, SIZE] in [-1, 1]: tiny-shapes samples, 2i better than 2i + 1
    ranked_captions: list[str] = field(default_factory=list)  # [S]: the prompt both samples of pair i were drawn for
    captioned: torch.Tensor | None = None  # [C, 3, SIZE, SIZE] in [-1, 1]: tiny-shapes samples of the bank
    caption_pairs: list[tuple[str, str]] = field(default_factory=list)  # [C]: (better, worse) caption for sample i
    layout: torch.Tensor | None = None  # [2P, len(SHAPES), 3]: `layout_targets` of the rendered scenes (layout_aux)
    moved: torch.Tensor | None = None  # [K, 3, SIZE, SIZE]: pixels[:K] moved by whole pixels (shift_consistency)
    detected: torch.Tensor | None = None  # [M, 3, SIZE, SIZE] in [-1, 1]: bank samples (detector_aux) ...
    counts: torch.Tensor | None = None  # [M, len(DETECTED)]: ... and `detected_counts` of each


# --------------------------------------------------------------------------------------------
# The sample bank: the generator's own images, judged
# --------------------------------------------------------------------------------------------

BANK = "samples.npz"  # in the run folder, beside state.pt
VERDICTS = "samples.verdicts.npz"  # beside the bank: `_caption_verdicts`, detected once
COUNTS = "samples.counts.npz"  # beside the bank: `_bank_counts`, detected once


def train_prompts() -> list[dict]:
    """Every train-split prompt, task by task (GenEval's order)."""
    return [m for tag in shapes.TAGS for m in _prompts(tag, "train")]


def sample_bank(path: Path, r: Recipe, metas: list[dict] | None = None, progress: bool = True,
                batch_size: int = 64) -> Path:
    """Draw r.samples_per_prompt tiny-shapes samples of every train prompt (or of `metas`) with the
    rollout's sampler (ODE, r.sample_steps Euler steps, CFG; noise seeded by r.seed) and judge each with
    GenEval's judge and the shapes detector. Writes `path` (npz, atomically): images uint8 [N, 64, 64, 3],
    prompts [N] str, dense [N] float (GenEval's dense score), correct [N] bool. With r.bank "branches",
    r.samples_per_prompt SDE trajectories a prompt instead, and the ODE completion from each of their
    r.sample_steps states (N = prompts x samples_per_prompt x sample_steps), with trajectory [N] int (which
    one) and step [N] int (k of s_k)."""
    from rich.progress import Progress

    from PIL import Image

    metas = train_prompts() if metas is None else metas
    if any(shapes.is_test(m) for m in metas):  # the reward never reads a test prompt, not even as a sample's caption
        raise ValueError("sample_bank: test-split prompt given")
    jobs = [m for m in metas for _ in range(r.samples_per_prompt)]
    branches = r.bank == "branches"
    per_job = r.sample_steps if branches else 1  # images a job gives
    m = models.load(SHAPES_MODEL, device="cpu")
    detector, colours = detectors.load_models("shapes")
    images, dense, correct = [], [], []
    with Progress(console=console, disable=not progress) as bar:
        what = "ODE completions along SDE trajectories" if branches else "tiny-shapes samples"
        task = bar.add_task(f"[bold]sample bank[/] ({what} of the train prompts, judged)", total=len(jobs))
        for b in range(0, len(jobs), batch_size):
            batch = jobs[b: b + batch_size]
            emb = m.encode([meta["prompt"] for meta in batch], shapes_model.TEXT_LENGTH)
            g = torch.Generator().manual_seed(r.seed * 1_000_003 + b)
            x = torch.randn(len(batch), *m.latent_shape(shapes_model.RESOLUTION), generator=g)
            if branches:
                arrays = shapes_model.branch_images(m, emb, x, r.sample_steps, shapes_model.GUIDANCE,
                                                    RolloutConfig.sampler, RolloutConfig.noise_level, g)
                arrays = arrays.reshape(-1, *arrays.shape[2:])  # trajectory-major: s_0..s_{T-1} of each
            else:
                arrays = shapes_model.ode_images(m, emb, x, r.sample_steps, shapes_model.GUIDANCE)
            judged = detectors.detect_and_judge([Image.fromarray(a) for a in arrays],
                                                [meta for meta in batch for _ in range(per_job)], detector, colours)
            images.append(arrays)
            dense += [j.score for j in judged]
            correct += [bool(j.correct) for j in judged]
            bar.update(task, advance=len(batch))
    tmp = path.with_name(path.name + ".tmp.npz")
    prompts = [meta["prompt"] for meta in jobs for _ in range(per_job)]
    where = ({"trajectory": np.repeat(np.arange(len(jobs)), per_job), "step": np.tile(np.arange(per_job), len(jobs))}
             if branches else {})
    np.savez_compressed(tmp, images=np.concatenate(images), prompts=np.array(prompts), dense=np.array(dense, np.float64),
                        correct=np.array(correct), settings=np.array(_bank_settings(r)), **where)
    os.replace(tmp, path)
    return path


def _bank_settings(r: Recipe) -> str:
    """What a bank is drawn from (the generator is the shipped tiny-shapes)."""
    settings = f"seed={r.seed} samples_per_prompt={r.samples_per_prompt} sample_steps={r.sample_steps}"
    if r.bank == "branches":  # (a samples bank's settings read as before branches existed: older banks still resume)
        settings += f" bank=branches sampler={RolloutConfig.sampler} noise_level={RolloutConfig.noise_level}"
    return settings


def bank_settings(path: Path) -> str | None:
    with np.load(path) as z:
        return str(z["settings"]) if "settings" in z.files else None


@lru_cache(maxsize=2)
def _bank(path: str) -> dict:
    """The bank, and per task its groups whose dense scores differ (the ones that make pairs): the samples of
    one prompt, or in a branches bank the completions along one trajectory."""
    with np.load(path) as z:
        bank = {k: z[k] for k in z.files}
    tag_of = {m["prompt"]: m["tag"] for m in train_prompts()}
    key = bank["trajectory"] if "trajectory" in bank else bank["prompts"]
    groups: dict[str, list[np.ndarray]] = {}
    for g in np.unique(key):
        idx = np.flatnonzero(key == g)
        if np.ptp(bank["dense"][idx]) > 0:
            groups.setdefault(tag_of[str(bank["prompts"][idx[0]])], []).append(idx)
    return {**bank, "groups": groups}


def _ranked_pairs(rng: np.random.Generator, bank: dict, n: int) -> tuple[np.ndarray, list[str]]:
    """n pairs (better, worse) of bank samples of one group (`_bank`) with different dense scores: a task uniformly
    (so that the few counting prompts count as much as the many colour-binding ones), then a group."""
    tags = sorted(bank["groups"])
    order, captions = [], []
    for _ in range(n):
        groups = bank["groups"][tags[int(rng.integers(len(tags)))]]
        idx = groups[int(rng.integers(len(groups)))]
        while True:
            i, j = rng.choice(idx, 2, replace=False)
            if bank["dense"][i] != bank["dense"][j]:
                break
        order += [i, j] if bank["dense"][i] > bank["dense"][j] else [j, i]
        captions.append(str(bank["prompts"][i]))
    return np.asarray(order), captions


def _beside_bank(path: str, name: str, compute) -> dict[str, np.ndarray]:
    """What `compute()` derives from the bank's pixels (arrays by name), computed once and kept beside the bank in
    `name`, keyed by those pixels: the processes making batches and a resumed run read it instead. Two processes may
    compute at once: each writes its own temporary file, and either result is the same."""
    key = hashlib.sha1(_bank(path)["images"].tobytes()).hexdigest()
    cache = Path(path).with_name(name)
    if cache.is_file():
        with np.load(cache) as z:
            if str(z["bank"]) == key:
                return {k: z[k] for k in z.files if k != "bank"}
    arrays = compute()
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp.npz")
    np.savez_compressed(tmp, bank=np.array(key), **arrays)
    os.replace(tmp, cache)
    return arrays


def _bank_detections(path: str) -> list[list[dict]]:
    """The shapes detector's detections of every bank sample (about 8 ms an image), colours as GenEval's judge reads them."""
    from PIL import Image

    detector, _ = detectors.load_models("shapes")
    images = _bank(path)["images"]
    found = []
    for start in range(0, len(images), 256):
        found += detector([Image.fromarray(a) for a in images[start: start + 256]])
    return [[dict(d, color=d.get("color")) for d in dets] for dets in found]


@lru_cache(maxsize=2)
def _caption_verdicts(path: str) -> dict[str, list[tuple[int, str, str]]]:
    """Per task, (sample, better caption, worse caption) for every bank sample and every one-detail-wrong
    train prompt of its own whose dense score on the sample's detections (the shapes detector, GenEval's
    judge) differs from its own prompt's. Refused (InputError) when there are none. Detected once a bank
    (minutes for a large one) and kept beside it (VERDICTS)."""
    def compute() -> dict[str, np.ndarray]:
        bank = _bank(path)
        meta_of = {m["prompt"]: m for m in train_prompts()}
        rows = []
        for i, dets in enumerate(_bank_detections(path)):
            meta = meta_of[str(bank["prompts"][i])]
            own = judge(meta, dets).score
            for w in one_detail_wrong(meta):
                if _in_split(w, "train") and (other := judge(w, dets).score) != own:
                    pair = (meta["prompt"], w["prompt"]) if own > other else (w["prompt"], meta["prompt"])
                    rows.append((meta["tag"], i, *pair))
        return {"tags": np.array([t for t, *_ in rows], dtype=str), "index": np.array([i for _, i, _, _ in rows], dtype=np.int64),
                "better": np.array([b for *_, b, _ in rows], dtype=str), "worse": np.array([w for *_, w in rows], dtype=str)}

    z = _beside_bank(path, VERDICTS, compute)
    out: dict[str, list[tuple[int, str, str]]] = {}
    for tag, i, better, worse in zip(z["tags"], z["index"], z["better"], z["worse"]):
        out.setdefault(str(tag), []).append((int(i), str(better), str(worse)))
    return _refuse_empty(out, path)


DETECTED = tuple((c, k) for c in shapes.COLOURS for k in shapes.SHAPES)  # what `detected_counts` counts, in this order


def detected_counts(detections: list[dict]) -> np.ndarray:
    """[len(DETECTED)]: how many of an image's detections are of each (colour, class)."""
    out = np.zeros(len(DETECTED), np.float32)
    for d in detections:
        if (d.get("color"), d["class"]) in DETECTED:
            out[DETECTED.index((d.get("color"), d["class"]))] += 1
    return out


@lru_cache(maxsize=2)
def _bank_counts(path: str) -> np.ndarray:
    """[N, len(DETECTED)]: `detected_counts` of every bank sample (`detector_aux`'s targets), kept beside it (COUNTS)."""
    compute = lambda: {"counts": np.stack([detected_counts(d) for d in _bank_detections(path)])}  # noqa: E731
    return _beside_bank(path, COUNTS, compute)["counts"]


def _refuse_empty(verdicts: dict, bank: str) -> dict:
    """A term asked for but with nothing to rank would drop out silently: the run would learn less than it says."""
    if not verdicts:
        raise InputError(f"{bank}: the detector finds every sample's captions alike; --caption-pairs has nothing to rank",
                         "pass --caption-pairs 0, or draw a new bank (a new --out)")
    return verdicts


def _caption_pairs(rng: np.random.Generator, verdicts: dict[str, list[tuple[int, str, str]]],
                   n: int) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """n (sample, better caption, worse caption) of `_caption_verdicts`: a task uniformly, then one of its verdicts."""
    tags = sorted(verdicts)
    picks = []
    for _ in range(n):
        entries = verdicts[tags[int(rng.integers(len(tags)))]]
        picks.append(entries[int(rng.integers(len(entries)))])
    return np.asarray([i for i, _, _ in picks]), [(a, b) for _, a, b in picks]


def _draw_prompt(rng: np.random.Generator, split: str, task_weights: tuple[float, ...] | None,
                 relations: bool = True) -> dict:
    """A prompt of the split: its task with the relative `task_weights` (None: alike), then uniformly; no position
    prompt unless `relations`."""
    if not relations:
        alike = (1.0,) * len(shapes.TAGS)
        task_weights = tuple(0.0 if t == "position" else w for t, w in zip(shapes.TAGS, task_weights or alike))
    if task_weights is None:  # its own draw, so that the shipped recipe's batches stay what they were
        tag = shapes.TAGS[int(rng.integers(len(shapes.TAGS)))]
    else:
        p_task = np.asarray(task_weights, dtype=float) / sum(task_weights)
        tag = shapes.TAGS[int(rng.choice(len(p_task), p=p_task))]
    cands = _prompts(tag, split)
    return cands[int(rng.integers(len(cands)))]


def _graded_pairs(rng: np.random.Generator, n: int, split: str, task_weights: tuple[float, ...] | None,
                  by: str = "truth") -> tuple[np.ndarray, list[str]]:
    """n pairs of rendered near misses of a prompt each, the better first: uint8 [2n, SIZE, SIZE, 3], n prompts."""
    images, captions = [], []
    for _ in range(n):
        p = _draw_prompt(rng, split, task_weights)
        images += [shapes.render(s, SIZE) for s in _graded_pair(rng, p)] if by == "truth" else _blob_pair(rng, p)
        captions.append(p["prompt"])
    return np.stack(images), captions


def _graded_pair(rng: np.random.Generator, meta: dict) -> tuple[shapes.Scene, shapes.Scene]:
    """Two near misses of `meta` (0-2 edits each) whose dense scores for it differ, the higher first."""
    while True:
        a, b = (shapes.edited_scene(meta, rng, int(rng.integers(3))) for _ in range(2))
        sa, sb = (shapes.truth_score(meta, s.objects) for s in (a, b))
        if sa != sb:
            return (a, b) if sa > sb else (b, a)


def _blob_pair(rng: np.random.Generator, meta: dict) -> list[np.ndarray]:
    """Two near misses of `meta` made blobs (`blobs`) whose dense scores for it, by the shapes detector and
    GenEval's judge, differ, the higher first."""
    from PIL import Image

    detector, colours = detectors.load_models("shapes")
    while True:
        images = [blobs(shapes.render(shapes.edited_scene(meta, rng, int(rng.integers(3))), SIZE), rng) for _ in range(2)]
        sa, sb = (j.score for j in detectors.detect_and_judge([Image.fromarray(a) for a in images], [meta, meta],
                                                               detector, colours))
        if sa != sb:
            return images if sa > sb else images[::-1]


def blobs(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8: Gaussian blur (sigma up to BLOB_BLUR px), then contrast stretched about
    mid-grey (gain up to BLOB_GAIN) and clipped: corners rounded and edges hard again, as tiny-shapes' saturating
    decoder draws them (most of its pixel values are exactly 0 or 255)."""
    sigma, gain = rng.uniform(0, BLOB_BLUR), rng.uniform(1, BLOB_GAIN)
    a = (shapes.blur(image, sigma) if sigma > 0.1 else image.astype(np.float64)) / 255.0
    return (np.clip((a - 0.5) * gain + 0.5, 0, 1) * 255).round().astype(np.uint8)


def _pair(rng: np.random.Generator, split: str, n_neg: int, task_weights: tuple[float, ...] | None = None,
          mirror: float = 0.0, relations: bool = True) -> tuple[list, list[str], list[list[str]]]:
    """A train prompt P and a one-detail-wrong prompt N of the split, a scene for each that satisfies its
    own prompt and not the other's; P's task drawn with the relative `task_weights` (None: alike; no position
    prompt unless `relations`). A position P, with probability `mirror`: N is P's relation flipped and its scene
    P's mirrored (`_mirrored_pair`)."""
    while True:
        p = _draw_prompt(rng, split, task_weights, relations)
        # the draw only when asked for: the shipped recipe's batches stay what they were
        if mirror and p["tag"] == "position" and rng.random() < mirror and (pair := _mirrored_pair(rng, p, split, n_neg)):
            return pair
        wrong = [m for m in one_detail_wrong(p) if _in_split(m, split)]
        if not wrong:
            continue
        q = wrong[int(rng.integers(len(wrong)))]
        sp, sq = shapes.scene_for(p, rng), shapes.scene_for(q, rng)
        if shapes.satisfied(q, sp.objects) or shapes.satisfied(p, sq.objects):
            continue
        cand_p = [p["prompt"]] + negatives(p, sp, rng, n_neg, split, first=[q])
        cand_q = [q["prompt"]] + negatives(q, sq, rng, n_neg, split, first=[p])
        return [sp, sq], [p["prompt"], q["prompt"]], [cand_p, cand_q]


def flipped_relation(meta: dict) -> dict:
    """A position prompt with its relation the opposite one, same shapes in the same order."""
    p = _parts(meta)
    return shapes.metadata("position", p["a"], p["b"], relation=OPPOSITE[p["relation"]])


def _mirrored_pair(rng: np.random.Generator, p: dict, split: str, n_neg: int) -> tuple[list, list[str], list[list[str]]] | None:
    """A scene of position prompt P and the same scene mirrored across P's relation's axis, captioned Q, P's
    relation flipped (`_pair`'s return); None when Q is not of the split or the mirror breaks a scene rule."""
    q = flipped_relation(p)
    if not _in_split(q, split):
        return None
    sp = shapes.scene_for(p, rng)
    sq = shapes.mirrored(sp, q, "x" if _parts(p)["relation"] in ("left of", "right of") else "y")
    if not (shapes.valid_layout(sq.objects) and shapes.satisfied(q, sq.objects) and not shapes.satisfied(p, sq.objects)):
        return None  # "y" keeps triangles pointing up, so what covers what can change
    cand_p = [p["prompt"]] + negatives(p, sp, rng, n_neg, split, first=[q])
    cand_q = [q["prompt"]] + negatives(q, sq, rng, n_neg, split, first=[p])
    return [sp, sq], [p["prompt"], q["prompt"]], [cand_p, cand_q]


def where_caption(shape: str, where: str) -> str:
    """"a photo of a circle on the left": an absolute position (`WHERE`), not a GenEval prompt."""
    return f"a photo of a {shape} {where}"


def _absolute_pair(rng: np.random.Generator, split: str, n_neg: int,
                   axis: str | None = None) -> tuple[list, list[str], list[list[str]]]:
    """A single shape (any, its colour random) wholly in the first half of the canvas along `axis` ("x" or "y"; None:
    drawn at random, as training does), captioned where it is (`where_caption`), and the same scene mirrored into the
    other half, captioned so (`_pair`'s return). Each image's candidates: its caption, the mirror's, the same place
    with every other shape, then `negatives` of the single-object prompt (other shapes, prompts of the split false for
    it). Never a caption of the other axis: a shape on the left may be at the top too."""
    if axis is None:
        axis = "xy"[int(rng.integers(2))]
    shape = shapes.SHAPES[int(rng.integers(len(shapes.SHAPES)))]
    meta = shapes.metadata("single_object", shape)
    k = 0 if axis == "x" else 1
    while True:
        scene = shapes.scene_for(meta, rng)
        box = shapes.visible_boxes(scene.objects)[0]
        if box[k + 2] <= SIZE / 2:
            break
        if box[k] >= SIZE / 2:
            scene = shapes.mirrored(scene, meta, axis)
            break
    mirror = shapes.mirrored(scene, meta, axis)
    captions = [where_caption(shape, w) for w in WHERE[axis]]
    cands = []
    for i, s in enumerate((scene, mirror)):
        other_shapes = [where_caption(o, WHERE[axis][i]) for o in shapes.SHAPES if o != shape]
        first = [captions[i], captions[1 - i]] + [other_shapes[j] for j in rng.permutation(len(other_shapes))]
        cands.append(first[:1 + n_neg] + negatives(meta, s, rng, 1 + n_neg - len(first), split))
    return [scene, mirror], captions, cands


def layout_targets(scenes: list[shapes.Scene]) -> torch.Tensor:
    """[N, len(SHAPES), 3]: for each scene and shape class, (1 if the scene holds one, else 0, then the mean
    centre of those objects, x and y scaled to [-1, 1] over the canvas; 0, 0 when absent)."""
    out = torch.zeros(len(scenes), len(shapes.SHAPES), 3)
    for i, scene in enumerate(scenes):
        for k, shape in enumerate(shapes.SHAPES):
            objs = [o for o in scene.objects if o.shape == shape]
            if objs:
                out[i, k, 0] = 1.0
                out[i, k, 1] = 2 * float(np.mean([o.x for o in objs])) / scene.size - 1
                out[i, k, 2] = 2 * float(np.mean([o.y for o in objs])) / scene.size - 1
    return out


def layout_head(arch: Arch) -> torch.nn.Sequential:
    """The training-only head of `layout_aux`: image embedding [N, D] -> [N, len(SHAPES) * 3] (presence logit,
    x, y), linear on the embedding standardised over the batch. Why standardised: early on every image's unit
    embedding points nearly the same way, so a plain linear head has to grow its weights to ~1/(the spread),
    which Adam does at lr per step. Trained on the layout loss alone for 300 steps, a plain head is still at
    0.93 (its loss at initialisation: 1.0); standardised it reaches 0.59."""
    return torch.nn.Sequential(torch.nn.BatchNorm1d(arch.projection, affine=False),
                               torch.nn.Linear(arch.projection, 3 * len(shapes.SHAPES)))


def layout_loss(head: torch.nn.Module, img: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of each class's presence, plus the squared error of the centres of the classes
    present: img [N, D] (the normalised embedding the reward's cosine uses), target [N, len(SHAPES), 3]."""
    y = head(img).view(target.shape)
    present = target[..., 0]
    l_present = torch.nn.functional.binary_cross_entropy_with_logits(y[..., 0], present)
    l_centre = (((y[..., 1:] - target[..., 1:]) ** 2).sum(-1) * present).sum() / present.sum().clamp(min=1)
    return l_present + l_centre


def detector_head(arch: Arch) -> torch.nn.Sequential:
    """The training-only head of `detector_aux`: image embedding [N, D] -> [N, len(DETECTED)] counts, linear on the
    embedding standardised over the batch (as `layout_head`, and for its reason)."""
    return torch.nn.Sequential(torch.nn.BatchNorm1d(arch.projection, affine=False),
                               torch.nn.Linear(arch.projection, len(DETECTED)))


def pixel_shifts(images: np.ndarray, rng: np.random.Generator, most: int) -> np.ndarray:
    """uint8 [B, H, W, 3] -> int [B, 2]: for each image a move (dy, dx) by whole pixels, uniform over the moves
    other than (0, 0) with |dy|, |dx| <= most that keep its drawing (pixels with a channel below 245: the white
    background excluded) on the canvas; (0, 0) for an empty canvas or one with no room. With np.roll, the strip
    a move brings in from the far edge is then background."""
    out = np.zeros((len(images), 2), np.int64)
    for i, a in enumerate(images):
        ys, xs = np.nonzero((a < 245).any(-1))
        if len(xs) == 0:
            continue
        (h, w) = a.shape[:2]
        room = [range(max(-most, -lo), min(most, size - 1 - hi) + 1) for lo, hi, size in ((ys.min(), ys.max(), h),
                                                                                            (xs.min(), xs.max(), w))]
        moves = [(dy, dx) for dy in room[0] for dx in room[1] if (dy, dx) != (0, 0)]
        if moves:
            out[i] = moves[int(rng.integers(len(moves)))]
    return out


def augment(images: np.ndarray, rng: np.random.Generator, r: Recipe) -> np.ndarray:
    """uint8 [B, H, W, 3] -> float [B, H, W, 3] in [0, 1]: per-channel gain and offset, Gaussian blur,
    pixel noise (renders made to look like the generator's soft, slightly off-colour samples)."""
    out = []
    for im in images:
        a = im.astype(np.float64)
        if r.blur > 0 and rng.random() < 0.7:
            a = shapes.blur(im, float(rng.uniform(0.3, r.blur)))
        a = a / 255.0
        a = a * (1 + rng.uniform(-r.jitter, r.jitter, 3)) + rng.uniform(-r.jitter / 2, r.jitter / 2, 3)
        a = a + rng.normal(0, rng.uniform(0, r.noise), a.shape)
        out.append(np.clip(a, 0, 1))
    return np.stack(out)


def batch_for(r: Recipe, step: int, bank: str | None = None) -> Batch:
    """Step `step`'s batch: its own random stream (seed, step), so that a resumed run, or one whose batches
    another process made, sees the very same data. bank: the sample bank's path (when r.sample_pairs,
    r.caption_pairs or r.detector_aux > 0)."""
    return make_batch(np.random.default_rng([r.seed, step]), r, bank=bank, step=step)


class Prefetch:
    """Batches made `ahead` steps in advance by one worker process (the other core trains), or inline."""

    def __init__(self, r: Recipe, start: int, workers: int, ahead: int = 3, bank: str | None = None):
        import concurrent.futures as cf
        import multiprocessing

        self.r, self.next, self.ahead, self.queue, self.bank = r, start, ahead, {}, bank
        self.pool = (cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
                     if workers > 0 else None)

    def get(self, step: int) -> Batch:
        if self.pool is None:
            return batch_for(self.r, step, self.bank)
        while self.next < min(step + self.ahead, self.r.steps) or self.next <= step:
            self.queue[self.next] = self.pool.submit(batch_for, self.r, self.next, self.bank)
            self.next += 1
        return self.queue.pop(step).result()

    def close(self) -> None:
        if self.pool is not None:
            for f in self.queue.values():
                f.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)


def _to_model(pixels: np.ndarray) -> torch.Tensor:
    """[B, H, W, 3] in [0, 1] -> [B, 3, H, W] in [-1, 1] (the processor's normalisation)."""
    return (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() - 0.5) / 0.5


def make_batch(rng: np.random.Generator, r: Recipe, split: str = "train", bank: str | None = None, step: int = 0) -> Batch:
    scenes_, captions, candidates = [], [], []
    for i in range(r.pairs):
        if i < r.absolute_pairs:
            s, c, k = _absolute_pair(rng, split, r.negatives)
        else:
            s, c, k = _pair(rng, split, r.negatives, r.task_weights, r.mirror_pairs, relations=step >= r.relation_start)
        scenes_ += s
        captions += c
        candidates += k
    renders = np.stack([shapes.render(s, SIZE) for s in scenes_])
    pixels = augment(renders, rng, r)
    batch = Batch(_to_model(pixels), captions, candidates, layout=layout_targets(scenes_) if r.layout_aux else None)
    if r.shift_consistency:  # drawn only when asked for: the shipped recipe's batches stay what they were
        k = min(CONSISTENT_IMAGES, len(renders))
        moves = pixel_shifts(renders[:k], rng, SHIFT_MOST)
        batch.moved = _to_model(np.stack([np.roll(pixels[i], tuple(moves[i]), (0, 1)) for i in range(k)]))
    if step < r.rank_start:
        return batch
    ranked = []
    b = _bank(bank) if bank is not None else None
    if r.detector_aux and b is not None:
        idx = rng.integers(len(b["images"]), size=DETECTED_IMAGES)
        batch.detected = _to_model(b["images"][idx] / 255.0)  # as they are: the counts are of these pixels
        batch.counts = torch.from_numpy(_bank_counts(bank)[idx])
    if r.caption_pairs and b is not None:
        idx, batch.caption_pairs = _caption_pairs(rng, _caption_verdicts(bank), r.caption_pairs)
        batch.captioned = _to_model(b["images"][idx] / 255.0)  # as they are: the verdict is on these pixels
    # the generator's samples as they are: what the reward judges in RL
    if r.sample_pairs and b is not None:  # as with the verdicts, an empty term is refused, not dropped
        if not b["groups"]:
            raise InputError(f"{bank}: no prompt's samples differ in dense score; --sample-pairs has nothing to rank",
                             "pass --sample-pairs 0, or more --samples-per-prompt (a new --out)")
        order, caps = _ranked_pairs(rng, b, r.sample_pairs)
        ranked.append(b["images"][order] / 255.0)
        batch.ranked_captions += caps
    if r.graded_pairs:
        images, caps = _graded_pairs(rng, r.graded_pairs, split, r.task_weights, r.graded_by)
        # detector-graded images are judged as they are: augmenting them could change the detector's verdict
        ranked.append(augment(images, rng, r) if r.graded_by == "truth" else images / 255.0)
        batch.ranked_captions += caps
    if ranked:
        batch.ranked = _to_model(np.concatenate(ranked))
    return batch


# --------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------


def embed_images(model, pixels: torch.Tensor) -> torch.Tensor:
    """L2-normalised image embeddings [B, D]."""
    img = model.get_image_features(pixel_values=pixels)
    img = img if isinstance(img, torch.Tensor) else img.pooler_output
    return torch.nn.functional.normalize(img, dim=-1)


def embed(model, tok, pixels: torch.Tensor, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised image [B, D] and text [T, D] embeddings (the reward's cosines)."""
    t = tok(texts, padding=True, return_tensors="pt")
    txt = model.get_text_features(input_ids=t["input_ids"], attention_mask=t["attention_mask"])
    txt = txt if isinstance(txt, torch.Tensor) else txt.pooler_output
    return embed_images(model, pixels), torch.nn.functional.normalize(txt, dim=-1)


def _bradley_terry(r: torch.Tensor) -> tuple[torch.Tensor, float]:
    """r [N, 2]: rewards of each pair, the better first -> (mean -log sigmoid(r_better - r_worse), share ordered)."""
    return torch.nn.functional.softplus(r[:, 1] - r[:, 0]).mean(), (r[:, 0] > r[:, 1]).float().mean().item()


def loss(model, tok, batch: Batch, rank_weight: float = 1.0, head: torch.nn.Module | None = None,
         layout_weight: float = 0.0, shift_weight: float = 0.0, counts_head: torch.nn.Module | None = None,
         detector_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Cross-entropy of each image over its candidate captions (its own first) plus of each caption over
    its pair's two images; logits = exp(logit_scale) * cos, as the reward scores. With ranked samples,
    plus rank_weight * mean softplus(r(worse) - r(better)) (Bradley-Terry on the reward r of each pair); with
    captioned samples, plus rank_weight * mean softplus(r(x, worse caption) - r(x, better caption)); with
    layout targets and a head, plus layout_weight * `layout_loss`; with moved images, plus shift_weight * mean
    (r(moved image, caption) - r(image, caption))^2 over their own captions, exp(logit_scale) held; with detected
    bank samples and counts_head, plus detector_weight * the squared error of the counts it reads from their
    embeddings (summed over the counts, averaged over the samples)."""
    texts = sorted({c for cs in batch.candidates for c in cs})
    index = {t: i for i, t in enumerate(texts)}
    img, txt = embed(model, tok, batch.pixels, texts)
    scale = model.logit_scale.exp().clamp(max=100)
    width = max(len(c) for c in batch.candidates)
    ids = torch.tensor([[index[c] for c in cs] + [index[cs[0]]] * (width - len(cs)) for cs in batch.candidates])
    mask = torch.tensor([[True] * len(cs) + [False] * (width - len(cs)) for cs in batch.candidates])
    logits = scale * (img[:, None, :] * txt[ids]).sum(-1)  # [B, width]
    logits = logits.masked_fill(~mask, float("-inf"))
    zero = torch.zeros(len(img), dtype=torch.long)
    l_img = torch.nn.functional.cross_entropy(logits, zero)
    # caption i over the images of its pair: i's own image (at i) against its partner (at i ^ 1)
    own = torch.arange(len(img))
    other = own ^ 1
    cap = torch.tensor([index[c] for c in batch.captions])
    pair_logits = scale * torch.stack([(img[own] * txt[cap]).sum(-1), (img[other] * txt[cap]).sum(-1)], 1)
    l_txt = torch.nn.functional.cross_entropy(pair_logits, zero)
    acc = (logits.argmax(1) == 0).float().mean().item()
    total, info = l_img + l_txt, {}
    if batch.layout is not None and head is not None:
        l_layout = layout_loss(head, img, batch.layout)
        total, info["layout_loss"] = total + layout_weight * l_layout, l_layout.item()
    if batch.detected is not None and counts_head is not None:
        l_det = ((counts_head(embed_images(model, batch.detected)) - batch.counts) ** 2).sum(-1).mean()
        total, info["detector_loss"] = total + detector_weight * l_det, l_det.item()
    if batch.moved is not None:
        k = len(batch.moved)
        gap = scale.detach() * ((embed_images(model, batch.moved) - img[:k]) * txt[cap[:k]]).sum(-1)  # [K]
        total, info["shift_gap"] = total + shift_weight * (gap ** 2).mean(), gap.abs().mean().item()
    if batch.ranked is not None:
        # the better sample of each pair above the worse for their prompt
        ranked, cap_txt = embed(model, tok, batch.ranked, batch.ranked_captions)
        r = scale * (ranked.view(len(cap_txt), 2, -1) * cap_txt[:, None, :]).sum(-1)  # [S, 2]
        l_rank, info["rank_acc"] = _bradley_terry(r)
        total = total + rank_weight * l_rank
    if batch.captioned is not None:
        # each sample's better caption above its worse
        sample, two = embed(model, tok, batch.captioned, [c for pair in batch.caption_pairs for c in pair])
        r = scale * (sample[:, None, :] * two.view(len(sample), 2, -1)).sum(-1)  # [C, 2]
        l_cap, info["caption_rank_acc"] = _bradley_terry(r)
        total = total + rank_weight * l_cap
    return total, {"loss": total.item(), "caption_acc": acc, **info, "scale": scale.item()}


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def lr_at(r: Recipe, step: int) -> float:
    """Linear warm-up, then cosine to 0 at `steps`."""
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    return r.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - r.warmup) / max(1, r.steps - r.warmup))))


def _save_model(model, processor, folder: Path) -> None:
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        os.chmod(tmp, 0o777 & ~layout.umask())  # mkdtemp's 0700 and the writers' 0600 would hide it from others
        for f in tmp.iterdir():
            os.chmod(f, layout.file_mode())
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _options(recipe: dict) -> dict:
    """A recipe's fields with the architecture's among them, so a refusal names "width 192 (now 128)"."""
    return {**{k: v for k, v in recipe.items() if k != "arch"}, **recipe["arch"]}


def train(out: Path, recipe: Recipe | None = None, max_minutes: float | None = None, progress: bool = True,
          workers: int = 1) -> Path:
    """Train the preference model into `out/model/` (resumable: `out/state.pt` holds the model, the optimizer,
    the random state and the step; rerun the same command to continue). Returns the model folder.
    workers: processes making the batches ahead (0: inline); the batches do not depend on it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    r = (recipe or Recipe()).validate()
    if max_minutes is not None and not (math.isfinite(max_minutes) and max_minutes >= 0):
        raise InputError(f"--max-minutes {max_minutes} must be a number of minutes >= 0", "e.g. --max-minutes 30")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder", "pass a folder for --out")
    out.mkdir(parents=True, exist_ok=True)
    state_path, model_dir = out / "state.pt", out / "model"

    # 1. The model, or where the last run stopped (the same recipe only).
    model, processor = build(r.arch, r.seed, WHERE_WORDS if r.absolute_pairs else ())
    tok = processor.tokenizer
    # training-only heads, built after the model: the model's init stays the same
    head = layout_head(r.arch) if r.layout_aux else None
    counts_head = detector_head(r.arch) if r.detector_aux else None
    params = [p for m in (model, head, counts_head) if m is not None for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=r.lr, weight_decay=r.weight_decay)
    step, history, minutes = 0, [], 0.0  # minutes: time spent on steps, over every resumed part of the run
    if state_path.is_file():
        # a truncated or foreign file, or one whose modules changed shape since (the layout head did once), is
        # refused by name: its own traceback would not say which file to move aside
        unusable = lambda why: InputError(f"{state_path} cannot be resumed: {why}",  # noqa: E731
                                          "pass a new --out, or delete state.pt to start this run again")
        try:
            st = torch.load(state_path, weights_only=False)
            saved = _options({**asdict(Recipe()), **st["recipe"]})  # options added since take their defaults
        except Exception as e:  # pickle, zip and key errors alike: the file is not a state this command wrote
            raise unusable(f"not a training state ({type(e).__name__})") from e
        mine = _options(asdict(r))
        if saved != mine:
            differ = ", ".join(f"{k} {saved[k]} (now {mine[k]})" for k in mine if saved[k] != mine[k])
            raise InputError(f"{out} holds a run of another recipe: {differ}", "pass the same options, or a new --out")
        try:
            model.load_state_dict(st["model"])
            if head is not None:
                head.load_state_dict(st["layout_head"])
            if counts_head is not None:
                counts_head.load_state_dict(st["detector_head"])
            opt.load_state_dict(st["optimizer"])
            step, history, minutes = st["step"], st["history"], st.get("minutes", 0.0)
        except (KeyError, RuntimeError, ValueError) as e:
            raise unusable(f"written by another version of this command ({str(e).splitlines()[0][:120]})") from e
    if step >= r.steps and model_dir.is_dir():
        console.print(f"{out}: already trained ({step} steps)")
        return model_dir

    def checkpoint() -> None:
        tmp = state_path.with_name(state_path.name + ".tmp")
        torch.save({"recipe": asdict(r), "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "history": history, "minutes": elapsed(),
                    **({"layout_head": head.state_dict()} if head is not None else {}),
                    **({"detector_head": counts_head.state_dict()} if counts_head is not None else {})}, tmp)
        os.replace(tmp, state_path)

    # 2. The sample bank (drawn once; its minutes count towards --max-minutes).
    t_start = time.monotonic()
    bank = None
    if r.sample_pairs or r.caption_pairs or r.detector_aux:
        bank_path = out / BANK
        if bank_path.is_file() and bank_settings(bank_path) != _bank_settings(r):
            raise InputError(f"{bank_path} holds samples of another recipe ({bank_settings(bank_path)})",
                             "pass the same options, or a new --out")
        if not bank_path.is_file():
            sample_bank(bank_path, r, progress=progress)
        bank = str(bank_path)
        if r.caption_pairs:  # here, once, and not in a worker at step rank_start with the progress bar stalled
            console.print(f"detecting the bank's samples for --caption-pairs (once: kept in {VERDICTS})")
            _caption_verdicts(bank)
        if r.detector_aux:
            console.print(f"detecting the bank's samples for --detector-aux (once: kept in {COUNTS})")
            _bank_counts(bank)

    # 3. Steps, checkpointed every few minutes and when stopped; the history keeps the minutes at each entry, so a
    # rate that changes along a run shows (one 5000-step run went from about 95 steps a minute to 48).
    last = t_steps = time.monotonic()
    elapsed = lambda: minutes + (time.monotonic() - t_steps) / 60  # noqa: E731
    model.train()
    columns = (TextColumn("[bold]reward model"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    data = Prefetch(r, step, workers, bank=bank)
    threads = torch.get_num_threads()
    if workers:
        torch.set_num_threads(max(1, threads - workers))  # a core each: oversubscribed threads spin
    with Progress(*columns, console=console, disable=not progress) as bar, contextlib.ExitStack() as stack:
        stack.callback(data.close)
        stack.callback(torch.set_num_threads, threads)
        task = bar.add_task("steps", total=r.steps, completed=step, info="")
        smooth = None
        while step < r.steps:
            if max_minutes is not None and time.monotonic() - t_start > 60 * max_minutes:
                checkpoint()
                console.print(f"stopped at step {step}/{r.steps} (--max-minutes); rerun the same command to continue")
                return model_dir
            batch = data.get(step)
            for g in opt.param_groups:
                g["lr"] = lr_at(r, step)
            value, info = loss(model, tok, batch, r.rank_weight, head, r.layout_aux, r.shift_consistency, counts_head,
                               r.detector_aux)
            opt.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            smooth = info if smooth is None else {k: 0.98 * smooth.get(k, v) + 0.02 * v for k, v in info.items()}
            if step % 50 == 0:
                history.append({"step": step, "minutes": round(elapsed(), 2), **{k: round(v, 4) for k, v in smooth.items()}})
            bar.update(task, completed=step, info=f"loss {smooth['loss']:.3f} caption acc {smooth['caption_acc']:.2f}"
                       + (f" rank acc {smooth['rank_acc']:.2f}" if "rank_acc" in smooth else "")
                       + (f" caption rank acc {smooth['caption_rank_acc']:.2f}" if "caption_rank_acc" in smooth else "")
                       + (f" detector loss {smooth['detector_loss']:.2f}" if "detector_loss" in smooth else ""))
            if time.monotonic() - last > 60 * r.checkpoint_minutes:
                checkpoint()
                last = time.monotonic()
    checkpoint()

    # 4. The model, in the layout `from_pretrained` loads.
    model.eval()
    _save_model(model, processor, model_dir)
    console.print(f"[green]done[/]: {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters)")
    return model_dir


# --------------------------------------------------------------------------------------------
# Quality
# --------------------------------------------------------------------------------------------


def pairwise_accuracy(score, split: str = "test", per_task: int = 200, seed: int = 1234, blur: float = 0.0) -> dict:
    """How often the matching caption scores above a one-detail-wrong caption, per GenEval task, on fresh
    rendered scenes of `split`'s prompts (negatives from both splits, each checked false for the scene).
    score(images: list[PIL.Image], prompts: list[str]) -> list[float] (a reward). blur: Gaussian sigma
    applied to every render (0: crisp). Returns {"overall": mean of the tasks, task: accuracy, "relation": the
    position scenes against their relation flipped (left of <-> right of, above <-> below; same shapes), which
    a model blind to where things are gets right half of the time, however well it tells the shapes apart,
    "relation_flipped_train" / "relation_flipped_test": the same over the scenes whose flipped caption is a
    train / test prompt (None where there are none): a model that learned each trained caption's arrangement,
    and not the relation, tells a scene from its mirror only where the mirror's caption was trained}."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    acc = {}
    for tag in shapes.TAGS:
        cands = _prompts(tag, split)
        images, own, wrong, flipped, flipped_trained = [], [], [], [], []
        for i in range(per_task):
            meta = cands[i % len(cands)]
            scene = shapes.scene_for(meta, rng)
            neg = negatives(meta, scene, rng, 1, split=None)
            boxes = shapes.visible_boxes(scene.objects)
            one = [m for m in one_detail_wrong(meta) if not shapes.satisfied(m, scene.objects, boxes)]
            neg = [one[int(rng.integers(len(one)))]["prompt"]] if one else neg
            a = shapes.render(scene, SIZE)
            if blur > 0:
                a = np.clip(shapes.blur(a, blur), 0, 255).astype(np.uint8)
            images.append(Image.fromarray(a))
            own.append(meta["prompt"])
            wrong.append(neg[0])
            if tag == "position":  # the scene satisfies its relation, so never the opposite one
                q = flipped_relation(meta)
                flipped.append(q["prompt"])
                flipped_trained.append(_in_split(q, "train"))
        s_own, s_wrong = np.asarray(score(images, own)), np.asarray(score(images, wrong))
        acc[tag] = float(np.mean(s_own > s_wrong))
        if flipped:
            right = s_own > np.asarray(score(images, flipped))
            trained = np.asarray(flipped_trained)
            relation = {"relation": float(np.mean(right)),
                        **{f"relation_flipped_{name}": float(np.mean(right[trained == t])) if np.any(trained == t) else None
                           for name, t in (("train", True), ("test", False))}}
    return {"overall": float(np.mean(list(acc.values()))), **acc, **relation}


def where_accuracy(score, per_axis: int = 200, seed: int = 1234) -> dict:
    """How often a single shape's caption of where it is ("a photo of a circle on the left") scores above the
    other half's ("... on the right"), on fresh scenes of `_absolute_pair` and their mirrors: {"x": left / right,
    "y": top / bottom}. Only for a model trained with absolute_pairs: another tokenizer spells the words out.
    score: as in `pairwise_accuracy`."""
    from PIL import Image

    rng, acc = np.random.default_rng(seed), {}
    for axis in WHERE:
        right = []
        for _ in range(per_axis):  # a scene and its mirror each
            scenes_, captions, _ = _absolute_pair(rng, "test", 0, axis)
            images = [Image.fromarray(shapes.render(s, SIZE)) for s in scenes_]
            own, other = np.asarray(score(images, captions)), np.asarray(score(images, captions[::-1]))
            right += list(own > other)
        acc[axis] = float(np.mean(right))
    return acc
