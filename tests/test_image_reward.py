"""ImageReward on transformers' BLIP modules against an independent plain-torch forward written from
the original architecture (BLIP's ViT and med BERT, ImageReward's MLP and normalisation), on a small
random checkpoint in the official key layout; key mapping, preprocessing, and failing fast."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tpkit.rewards import image_reward as ir
from tpkit.errors import ModelError

V_WIDTH, V_DEPTH, V_HEADS, PATCH, SIZE = 32, 2, 2, 8, 32
T_WIDTH, T_DEPTH, T_HEADS, T_INTER, MAX_POS = 48, 2, 3, 96, 40
WORDS = ["a", "red", "blue", "cube", "on", "the", "table", "photo", "of", "cat", "dog", "##s", "big"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert-tok")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    return ir.load_tokenizer(str(folder))


def random_checkpoint(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict with ImageReward.pt's keys (blip.visual_encoder.*, blip.text_encoder.*, mlp.layers.*,
    plus the projections the score does not use), random values at sizes that make differences show."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    def ln(prefix, n):
        return {f"{prefix}.weight": 1 + r(n, scale=0.1), f"{prefix}.bias": r(n, scale=0.1)}

    def lin(prefix, out, inp):
        return {f"{prefix}.weight": r(out, inp, scale=1 / math.sqrt(inp)), f"{prefix}.bias": r(out, scale=0.1)}

    sd = {"blip.visual_encoder.cls_token": r(1, 1, V_WIDTH), "blip.visual_encoder.pos_embed": r(1, (SIZE // PATCH) ** 2 + 1, V_WIDTH),
          "blip.visual_encoder.patch_embed.proj.weight": r(V_WIDTH, 3, PATCH, PATCH, scale=0.05),
          "blip.visual_encoder.patch_embed.proj.bias": r(V_WIDTH, scale=0.1)}
    for i in range(V_DEPTH):
        b = f"blip.visual_encoder.blocks.{i}"
        sd |= ln(f"{b}.norm1", V_WIDTH) | lin(f"{b}.attn.qkv", 3 * V_WIDTH, V_WIDTH) | lin(f"{b}.attn.proj", V_WIDTH, V_WIDTH)
        sd |= ln(f"{b}.norm2", V_WIDTH) | lin(f"{b}.mlp.fc1", 4 * V_WIDTH, V_WIDTH) | lin(f"{b}.mlp.fc2", V_WIDTH, 4 * V_WIDTH)
    sd |= ln("blip.visual_encoder.norm", V_WIDTH)
    t = "blip.text_encoder"
    sd |= {f"{t}.embeddings.word_embeddings.weight": r(vocab, T_WIDTH, scale=1.0),
           f"{t}.embeddings.position_embeddings.weight": r(MAX_POS, T_WIDTH, scale=0.5),
           f"{t}.embeddings.position_ids": torch.arange(MAX_POS)[None]}
    sd |= ln(f"{t}.embeddings.LayerNorm", T_WIDTH)
    for i in range(T_DEPTH):
        b = f"{t}.encoder.layer.{i}"
        for att, kv in (("attention", T_WIDTH), ("crossattention", V_WIDTH)):
            sd |= lin(f"{b}.{att}.self.query", T_WIDTH, T_WIDTH) | lin(f"{b}.{att}.self.key", T_WIDTH, kv)
            sd |= lin(f"{b}.{att}.self.value", T_WIDTH, kv) | lin(f"{b}.{att}.output.dense", T_WIDTH, T_WIDTH)
            sd |= ln(f"{b}.{att}.output.LayerNorm", T_WIDTH)
        sd |= lin(f"{b}.intermediate.dense", T_INTER, T_WIDTH) | lin(f"{b}.output.dense", T_WIDTH, T_INTER)
        sd |= ln(f"{b}.output.LayerNorm", T_WIDTH)
    sd |= lin("blip.vision_proj", 16, V_WIDTH) | lin("blip.text_proj", 16, T_WIDTH)
    for i, (o, n) in zip((0, 2, 4, 6, 7), ((1024, T_WIDTH), (128, 1024), (64, 128), (16, 64), (1, 16))):
        sd |= lin(f"mlp.layers.{i}", o, n)
    return sd


# ---------------------------------------------------------------------------------------------
# The reference: BLIP's VisionTransformer and med BertModel as the original code computes them


def _attention(q, k, v, heads, mask=None):
    b, n, c = q.shape
    split = lambda x: x.reshape(b, x.shape[1], heads, c // heads).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(-1, -2) / math.sqrt(c // heads)
    if mask is not None:
        scores = scores + (1.0 - mask[:, None, None, :].float()) * -10000.0  # med.py's extended mask
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)


def reference_vit(sd, x):
    p = "blip.visual_encoder."
    w = lambda name: sd[p + name]  # noqa: E731
    x = F.conv2d(x, w("patch_embed.proj.weight"), w("patch_embed.proj.bias"), stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([w("cls_token").expand(x.shape[0], -1, -1), x], 1) + w("pos_embed")
    for i in range(V_DEPTH):
        b = f"blocks.{i}."
        h = F.layer_norm(x, (V_WIDTH,), w(b + "norm1.weight"), w(b + "norm1.bias"), 1e-6)
        qkv = F.linear(h, w(b + "attn.qkv.weight"), w(b + "attn.qkv.bias")).reshape(x.shape[0], x.shape[1], 3, V_HEADS, -1)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # timm's layout: [3, B, heads, N, head_dim]
        att = (qkv[0] @ qkv[1].transpose(-2, -1) * (V_WIDTH // V_HEADS) ** -0.5).softmax(-1)
        h = (att @ qkv[2]).transpose(1, 2).reshape(x.shape)
        x = x + F.linear(h, w(b + "attn.proj.weight"), w(b + "attn.proj.bias"))
        h = F.layer_norm(x, (V_WIDTH,), w(b + "norm2.weight"), w(b + "norm2.bias"), 1e-6)
        h = F.linear(F.gelu(F.linear(h, w(b + "mlp.fc1.weight"), w(b + "mlp.fc1.bias"))), w(b + "mlp.fc2.weight"), w(b + "mlp.fc2.bias"))
        x = x + h
    return F.layer_norm(x, (V_WIDTH,), w("norm.weight"), w("norm.bias"), 1e-6)


def reference_bert(sd, ids, mask, image_embeds):
    p = "blip.text_encoder."
    w = lambda name: sd[p + name]  # noqa: E731
    lin = lambda x, name: F.linear(x, w(name + ".weight"), w(name + ".bias"))  # noqa: E731
    norm = lambda x, name: F.layer_norm(x, (T_WIDTH,), w(name + ".weight"), w(name + ".bias"), 1e-12)  # noqa: E731
    x = w("embeddings.word_embeddings.weight")[ids] + w("embeddings.position_embeddings.weight")[: ids.shape[1]]
    x = norm(x, "embeddings.LayerNorm")
    ones = torch.ones(image_embeds.shape[:2])
    for i in range(T_DEPTH):
        b = f"encoder.layer.{i}."
        for att, kv, m in (("attention", x, mask), ("crossattention", image_embeds, ones)):
            h = _attention(lin(x, b + att + ".self.query"), lin(kv, b + att + ".self.key"), lin(kv, b + att + ".self.value"),
                           T_HEADS, m)
            x = norm(lin(h, b + att + ".output.dense") + x, b + att + ".output.LayerNorm")
        h = F.gelu(lin(x, b + "intermediate.dense"))
        x = norm(lin(h, b + "output.dense") + x, b + "output.LayerNorm")
    return x


def reference_score(sd, tokenizer, images, prompts):
    pixels = torch.from_numpy(np.stack([ir.preprocess(im, SIZE) for im in images]))
    tok = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    feats = reference_bert(sd, tok["input_ids"], tok["attention_mask"], reference_vit(sd, pixels))[:, 0]
    for i in (0, 2, 4, 6, 7):  # Linear layers only; the dropouts are off at inference
        feats = F.linear(feats, sd[f"mlp.layers.{i}.weight"], sd[f"mlp.layers.{i}.bias"])
    return ((feats.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072).tolist()


def images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = [(32, 32), (48, 40), (40, 64), (100, 70)]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % 4][::-1], 3), dtype=np.uint8)) for i in range(n)]


PROMPTS = ["a photo of a red cube", "a big dog on the table", "cats", "a blue cat on a red table of the dogs"]


# ---------------------------------------------------------------------------------------------


def test_converted_model_matches_the_original_architecture(tokenizer):
    sd = random_checkpoint(len(tokenizer))
    model = ir.ImageReward(sd, tokenizer, batch_size=3, vision_heads=V_HEADS, text_heads=T_HEADS)
    ims = images(4)
    got = model(ims, PROMPTS)
    want = reference_score(sd, tokenizer, ims, PROMPTS)
    assert np.allclose(got, want, atol=1e-5, rtol=1e-5), (got, want)
    assert np.std(got) > 1e-2  # the scores differ per image and prompt: a real comparison
    other = model(ims, PROMPTS[::-1])
    assert not np.allclose(got, other)  # the text matters


def test_sizes_come_from_the_checkpoint(tokenizer):
    model = ir.ImageReward(random_checkpoint(len(tokenizer)), tokenizer, vision_heads=V_HEADS, text_heads=T_HEADS)
    v, t = model.vision.config, model.text.config
    assert (v.hidden_size, v.num_hidden_layers, v.patch_size, v.image_size) == (V_WIDTH, V_DEPTH, PATCH, SIZE)
    assert (t.hidden_size, t.num_hidden_layers, t.intermediate_size, t.encoder_hidden_size) == (T_WIDTH, T_DEPTH, T_INTER, V_WIDTH)
    assert (v.num_attention_heads, t.num_attention_heads) == (V_HEADS, T_HEADS)
    vision, text, _ = ir.build(random_checkpoint(len(tokenizer)))  # default: width / 64 heads, at least 1
    assert (vision.config.num_attention_heads, text.config.num_attention_heads) == (1, 1)


def test_preprocess_is_imagereward_transform():
    # A 224 x 224 image is not resized: the values are the CLIP-normalised pixels themselves.
    rng = np.random.default_rng(1)
    px = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    x = ir.preprocess(Image.fromarray(px))
    want = (px / 255.0 - np.array(ir.CLIP_MEAN)) / np.array(ir.CLIP_STD)
    assert x.shape == (3, 224, 224) and np.allclose(x, want.transpose(2, 0, 1), atol=1e-6)
    # A wide image: shorter side to 224, then the centre: columns [56, 280) of a 336-wide resize.
    wide = Image.fromarray(rng.integers(0, 256, (200, 300, 3), dtype=np.uint8))
    resized = np.asarray(wide.resize((336, 224), Image.BICUBIC), dtype=np.float32)[:, 56:280] / 255.0
    want = ((resized - np.array(ir.CLIP_MEAN, np.float32)) / np.array(ir.CLIP_STD, np.float32)).transpose(2, 0, 1)
    assert np.allclose(ir.preprocess(wide), want, atol=1e-5)


def test_unknown_or_missing_keys_are_refused(tokenizer):
    sd = random_checkpoint(len(tokenizer))
    with pytest.raises(ModelError, match="unknown keys"):
        ir.split_checkpoint({**sd, "something.else": torch.zeros(1)})
    broken = {k: v for k, v in sd.items() if "blocks.1.attn.proj" not in k}
    with pytest.raises(ModelError, match="does not fit"):
        ir.build(broken, V_HEADS, T_HEADS)
    with pytest.raises(ModelError, match="not an ImageReward checkpoint"):
        ir.split_checkpoint({k: v for k, v in sd.items() if not k.startswith("mlp.")})


def test_reward_loads_a_local_checkpoint_and_scores(tokenizer, tmp_path):
    from tpkit.rewards.registry import load_rewards, score_images

    path = tmp_path / "ImageReward.pt"
    torch.save(random_checkpoint(len(tokenizer)), path)
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    rewards = load_rewards({"imagereward": 1.0}, {"imagereward": {"checkpoint": str(path), "tokenizer": str(tok_dir)}})
    scores = score_images(rewards, images(3), PROMPTS[:3], [{}] * 3)
    assert len(scores["reward_imagereward"]) == 3 and np.isfinite(scores["reward_imagereward"]).all()


def test_missing_model_fails_fast_offline(monkeypatch, tmp_path, tok_folder):
    from tpkit.rewards.registry import load_rewards

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ModelError) as e:
        load_rewards({"imagereward": 1.0}, {})
    assert "bert-base-uncased" in str(e.value) and "hf download google-bert/bert-base-uncased" in e.value.fix
    with pytest.raises(ModelError, match="ImageReward checkpoint"):  # the tokenizer is there, the weights are not
        load_rewards({"imagereward": 1.0}, {"imagereward": {"tokenizer": str(tmp_path / "tok")}})


@pytest.fixture
def tok_folder(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_a_tokenizer_that_does_not_fit_the_checkpoint_is_refused(tokenizer):
    sd = random_checkpoint(len(tokenizer) + 1)
    with pytest.raises(ModelError, match="tokenizer has"):
        ir.ImageReward(sd, tokenizer, vision_heads=V_HEADS, text_heads=T_HEADS)


def test_a_tokenizer_without_vocabulary_is_refused(tmp_path):
    # transformers 5 builds an empty BertTokenizer from a folder without vocab.txt instead of failing
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer"}')
    with pytest.raises(ModelError, match="has no vocabulary"):
        ir.load_tokenizer(str(tmp_path / "tok"))
