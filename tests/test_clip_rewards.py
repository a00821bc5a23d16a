"""PickScore, CLIPScore and the aesthetic predictor with tiny random CLIP models, offline.

Every score is checked against a direct computation with transformers' CLIPModel forward
(written here, independently of tpkit.rewards.clip), on the same images and prompts.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import build_tiny_clip
from tpkit.errors import ModelError

PROMPTS = ["a red cube on a wooden table", "a cat", "a small boat on a calm lake at dawn, oil painting, "
           "highly detailed, warm colours, soft light, in the style of an old master", "x", "two dogs", "blue sky"]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    # seed 5: its cosines on `images` have both signs (exercises CLIPScore's clamp)
    return build_tiny_clip(tmp_path_factory.mktemp("tiny-clip"), layers=2, seed=5)


@pytest.fixture(scope="module")
def images():
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(40, 56), (64, 64), (33, 80), (48, 32), (64, 64), (20, 20)]
    out = []
    for i, (h, w) in enumerate(sizes):
        base = rng.integers(0, 256, size=3)  # distinct colours, plus noise
        arr = np.clip(base + rng.normal(0, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
        out.append(Image.fromarray(arr))
    return out


def _direct(folder: Path, images, prompts):
    """(logit_scale.exp(), cos(image_i, prompt_i)) straight from CLIPModel's forward."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(folder).eval()
    processor = CLIPProcessor.from_pretrained(folder)
    inputs = processor(text=prompts, images=images, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    scale = model.logit_scale.exp()
    return out, scale, torch.diagonal(out.logits_per_image) / scale


class PublishedMLP(nn.Module):
    """The layout of improved-aesthetic-predictor's simple_inference.py MLP (what its .pth was saved from)."""

    def __init__(self, input_size):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, x):
        return self.layers(x)


@pytest.fixture(scope="module")
def head_file(tmp_path_factory) -> tuple[Path, PublishedMLP]:
    torch.manual_seed(5)
    mlp = PublishedMLP(16).eval()
    path = tmp_path_factory.mktemp("head") / "tiny-aesthetic.pth"
    torch.save(mlp.state_dict(), path)
    return path, mlp


# --------------------------------------------------------------------------------------------- scores


def test_pickscore_equals_direct_computation(tiny_clip, images):
    from tpkit.rewards.clip import pickscore

    fn = pickscore({"model": str(tiny_clip), "processor": str(tiny_clip)})
    got = fn(images, PROMPTS, [{}] * len(images))
    out, _, _ = _direct(tiny_clip, images, PROMPTS)
    expected = torch.diagonal(out.logits_per_image)
    assert len(got) == len(images) and all(isinstance(x, float) for x in got)
    assert np.allclose(got, expected.numpy(), atol=1e-4)
    assert len(set(np.round(got, 5))) > 1  # not a constant


def test_pickscore_scale_multiplies(tiny_clip, images):
    from tpkit.rewards.clip import pickscore

    base = pickscore({"model": str(tiny_clip), "processor": str(tiny_clip)})(images, PROMPTS, [{}] * 6)
    for scale, factor in ((0.5, 0.5), ("1/26", 1 / 26)):
        got = pickscore({"model": str(tiny_clip), "processor": str(tiny_clip), "scale": scale})(images, PROMPTS, [{}] * 6)
        assert np.allclose(got, np.array(base) * factor, atol=1e-5)


def test_clipscore_equals_direct_computation(tiny_clip, images):
    from tpkit.rewards.clip import clipscore

    out, _, _ = _direct(tiny_clip, images, PROMPTS)
    cos = (out.image_embeds * out.text_embeds).sum(-1)  # forward's embeds are L2-normalised
    got = clipscore({"model": str(tiny_clip)})(images, PROMPTS, [{}] * 6)
    assert np.allclose(got, (2.5 * cos.clamp(min=0)).numpy(), atol=1e-5)
    got = clipscore({"model": str(tiny_clip), "weight": 100})(images, PROMPTS, [{}] * 6)
    assert np.allclose(got, (100 * cos.clamp(min=0)).numpy(), atol=1e-3)
    assert (cos > 0).any() and (cos < 0).any()  # both sides of the clamp are exercised


def test_aesthetic_equals_direct_mlp(tiny_clip, images, head_file):
    from safetensors.torch import save_file

    from tpkit.rewards.clip import aesthetic

    path, mlp = head_file
    out, _, _ = _direct(tiny_clip, images, PROMPTS)
    with torch.no_grad():
        expected = mlp(out.image_embeds).squeeze(-1).numpy()
    got = aesthetic({"model": str(tiny_clip), "head": str(path)})(images, PROMPTS, [{}] * 6)
    assert np.allclose(got, expected, atol=1e-5)
    st = path.with_suffix(".safetensors")
    save_file({k: v.contiguous() for k, v in mlp.state_dict().items()}, st)
    assert np.allclose(aesthetic({"model": str(tiny_clip), "head": str(st)})(images, PROMPTS, [{}] * 6), expected, atol=1e-5)


def test_aesthetic_head_keys_match_the_published_layout():
    from tpkit.rewards.clip import AestheticHead

    keys = {f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")}
    assert set(AestheticHead(768).state_dict()) == keys == set(PublishedMLP(768).state_dict())
    shapes = {k: tuple(v.shape) for k, v in AestheticHead(768).state_dict().items() if k.endswith("weight")}
    assert shapes == {"layers.0.weight": (1024, 768), "layers.2.weight": (128, 1024), "layers.4.weight": (64, 128),
                      "layers.6.weight": (16, 64), "layers.7.weight": (1, 16)}


def test_batching_does_not_change_scores(tiny_clip, images, head_file):
    from tpkit.rewards.clip import aesthetic, clipscore, pickscore

    def both(factory, **opts):
        return [factory({**opts, "batch_size": b})(images, PROMPTS, [{}] * 6) for b in (1, 4)]

    for one, four in (both(pickscore, model=str(tiny_clip), processor=str(tiny_clip)),
                      both(clipscore, model=str(tiny_clip)),
                      both(aesthetic, model=str(tiny_clip), head=str(head_file[0]))):
        assert np.allclose(one, four, atol=1e-5)


# --------------------------------------------------------------------------------------------- loading


def test_missing_local_folder_fails_at_factory_time(tiny_clip, tmp_path, head_file):
    from tpkit.rewards.clip import aesthetic, clipscore, pickscore

    missing = str(tmp_path / "no-such-model")
    cases = [(pickscore, {"model": missing, "processor": str(tiny_clip)}, "pickscore.model"),
             (pickscore, {"model": str(tiny_clip), "processor": missing}, "pickscore.processor"),
             (clipscore, {"model": missing}, "clipscore.model"),
             (aesthetic, {"model": missing, "head": str(head_file[0])}, "aesthetic.model"),
             (aesthetic, {"model": str(tiny_clip), "head": missing + ".pth"}, "aesthetic.head")]
    for factory, opts, option in cases:
        with pytest.raises(ModelError) as e:
            factory(opts)
        assert option in str(e.value), str(e.value)


def test_bad_options_are_rejected(tiny_clip):
    from tpkit.rewards.clip import pickscore
    from tpkit.errors import RewardError

    for opts in ({"nope": 1}, {"scale": "big"}, {"batch_size": 0}):
        with pytest.raises(RewardError):
            pickscore({"model": str(tiny_clip), "processor": str(tiny_clip), **opts})


def test_aesthetic_head_of_the_wrong_width_is_a_clear_error(tiny_clip, tmp_path):
    from tpkit.rewards.clip import aesthetic

    path = tmp_path / "l14.pth"
    torch.save(PublishedMLP(768).state_dict(), path)
    with pytest.raises(ModelError, match="768-dim"):
        aesthetic({"model": str(tiny_clip), "head": str(path)})


def _cached(repo: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, filename), str)


def test_real_ids_offline_fail_fast_naming_the_model(monkeypatch, tiny_clip):
    import tpkit.hub
    from tpkit.rewards.clip import aesthetic, clipscore, pickscore

    if any(_cached(r, f) for r, f in (("yuvalkirstain/PickScore_v1", "config.json"),
                                      ("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "config.json"),
                                      ("openai/clip-vit-large-patch14", "config.json"),
                                      ("camenduru/improved-aesthetic-predictor", "sac+logos+ava1-l14-linearMSE.pth"))):
        pytest.skip("a real reward model is in the local HF cache")
    monkeypatch.setattr(tpkit.hub, "hub_reachable", lambda timeout=2.0: False)
    cases = [(pickscore, {}, "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"),
             (pickscore, {"processor": str(tiny_clip)}, "yuvalkirstain/PickScore_v1"),
             (clipscore, {}, "openai/clip-vit-large-patch14"),
             (aesthetic, {}, "camenduru/improved-aesthetic-predictor"),
             (aesthetic, {"head": "camenduru/improved-aesthetic-predictor:sac+logos+ava1-l14-linearMSE.pth",
                          "model": "openai/clip-vit-large-patch14"}, "camenduru/improved-aesthetic-predictor")]
    for factory, opts, name in cases:
        t0 = time.perf_counter()
        with pytest.raises(ModelError) as e:
            factory(opts)
        assert time.perf_counter() - t0 < 5
        assert name in str(e.value) and "cannot be reached" in str(e.value), str(e.value)


# --------------------------------------------------------------------------------------------- tpkit score


def _final_images(rollout: Path):
    from PIL import Image

    from tpkit import layout

    out = {}
    for shard in layout.list_shards(rollout):
        _, trajs = layout.read_shard(shard, load_tensors=False)
        for t in trajs:
            out[t.trajectory_id] = (Image.open(io.BytesIO(t.final_png)).convert("RGB"), t.meta["prompt"])
    return out


def test_tpkit_score_end_to_end(tiny_run, tiny_clip, tmp_path):
    from tpkit import layout, score
    from tpkit.config import ScoreConfig

    opts = {"pickscore": {"model": str(tiny_clip), "processor": str(tiny_clip), "batch_size": 3}}
    score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(tmp_path / "ps"), rewards={"pickscore": 1.0},
                          reward_options=opts, branches="final"))
    rows = layout.read_parquet_tables(tmp_path / "ps", "score").to_pylist()
    finals = _final_images(tiny_run / "rollout")
    assert len(rows) == len(finals) == 8
    ids = sorted(finals)
    out, _, _ = _direct(tiny_clip, [finals[i][0] for i in ids], [finals[i][1] for i in ids])
    expected = dict(zip(ids, torch.diagonal(out.logits_per_image).tolist()))
    for r in rows:
        assert r["reward_pickscore"] == pytest.approx(expected[r["trajectory_id"]], abs=1e-4)
        assert r["reward"] == pytest.approx(r["reward_pickscore"])

    # A mix: reward = the weighted sum of its component columns.
    score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(tmp_path / "mix"),
                          rewards={"pickscore": 1.0, "jpeg-compressibility": 0.5}, reward_options=opts,
                          branches="final"))
    mix = layout.read_parquet_tables(tmp_path / "mix", "score").to_pylist()
    assert len(mix) == 8
    for r in mix:
        assert r["reward_pickscore"] == pytest.approx(expected[r["trajectory_id"]], abs=1e-4)
        assert r["reward_jpeg_compressibility"] < 0
        assert r["reward"] == pytest.approx(r["reward_pickscore"] + 0.5 * r["reward_jpeg_compressibility"], rel=1e-9)


def test_a_model_whose_tokenizer_has_no_vocabulary_is_refused(tmp_path):
    """transformers 5 builds an empty tokenizer, without an error, from a folder that lacks its vocabulary
    files; every prompt would encode to unknown tokens and rewards would be silently wrong."""
    from transformers import CLIPTokenizer

    from tpkit import hub
    from tpkit.errors import ModelError

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"tokenizer_class": "CLIPTokenizer"}')
    with pytest.raises(ModelError, match="has no vocabulary"):
        hub.load(CLIPTokenizer.from_pretrained, str(tmp_path / "tok"), "CLIP tokenizer", "--reward-opt x.model=PATH")
