"""tiny-shapes: the builder, the training loop (loss, resume) and the shipped weights."""

from __future__ import annotations

import dataclasses

import pytest

import numpy as np
import torch

from tpkit.shapes import model as sm

TINY = sm.Arch(vae_channels=(8, 8, 8), latent_channels=4, vae_groups=4, layers=1, heads=2, head_dim=8,
               clip_hidden=16, clip_layers=1, clip_heads=2)


def tiny_recipe(**kw) -> sm.Recipe:
    r = sm.Recipe(vae_steps=1, vae_batch=2, vae_crop=16, vae_stats_scenes=8, data_scenes=8, data_chunk=4,
                  flow_steps=2, flow_batch=4, warmup=1, snapshot_every=1, arch=TINY)
    return dataclasses.replace(r, **kw)


def test_every_caption_word_is_one_token():
    from tpkit.shapes import scenes as shapes

    tok = sm.word_tokenizer(sm.caption_words())
    for m in shapes.prompts("train")[::7] + shapes.prompts("test")[::7]:
        ids = tok(m["prompt"]).input_ids
        assert len(ids) == len(m["prompt"].split()) + 2 <= sm.CLIP_LENGTH
        assert tok.unk_token_id not in ids[1:-1]
    assert tok("", padding="max_length", max_length=sm.CLIP_LENGTH).input_ids[:2] == [tok.bos_token_id, tok.eos_token_id]


def test_builder_makes_a_pipeline_that_round_trips(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    pipe = sm.build_pipeline(TINY)
    assert pipe.tokenizer.model_max_length == sm.CLIP_LENGTH
    sm.save_pipeline(pipe, tmp_path / "p")
    again = StableDiffusion3Pipeline.from_pretrained(tmp_path / "p")
    torch.manual_seed(0)
    image = again(prompt="a photo of a red circle", num_inference_steps=2, guidance_scale=4.5,
                  max_sequence_length=sm.TEXT_LENGTH, output_type="np").images
    assert image.shape == (1, sm.RESOLUTION, sm.RESOLUTION, 3)


def test_a_training_step_lowers_the_loss():
    pipe = sm.build_pipeline(TINY)
    lat = torch.randn(8, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    captions = ["a photo of a red circle", "a photo of two squares"] * 4
    params = [p for m in sm._Trainer.FLOW_MODULES for p in getattr(pipe, m).parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)

    def loss():
        return sm.flow_loss(pipe, lat, captions, torch.Generator().manual_seed(1), 0.25)

    before = loss()
    before.backward()
    opt.step()
    with torch.no_grad():
        assert float(loss()) < float(before)


def test_interrupted_training_resumes_to_the_same_model(tmp_path):
    r = tiny_recipe()
    whole = sm.train(tmp_path / "whole", r, progress=False, tune_threads=False)
    calls = 0
    while (done := sm.train(tmp_path / "parts", r, max_minutes=0, progress=False, tune_threads=False)) is None:  # one step per call
        calls += 1
        assert calls < 20
    assert calls >= r.vae_steps + 2 + r.flow_steps - 1  # it really stopped in every phase
    from safetensors.torch import load_file

    for part in ("transformer", "text_encoder", "vae"):
        a = load_file(next((whole / part).glob("*.safetensors")))
        b = load_file(next((done / part).glob("*.safetensors")))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert (tmp_path / "whole" / "snapshots" / "step-00001" / "model_index.json").is_file()


def test_a_run_is_lengthened_only_before_its_cooldown(tmp_path):
    """Lengthening continues at the rate the steps so far had; into the cooldown it would restart the
    decayed rate from the stable one, so it is refused (the folder is left as it was)."""
    from tpkit.errors import ConfigError

    r = tiny_recipe(flow_steps=4, cooldown=0.5)  # step 3 (of 0-3) trains at half the rate
    assert sm.train(tmp_path / "early", r, max_minutes=0, progress=False, tune_threads=False) is None
    while sm.train(tmp_path / "early", r, max_minutes=0, progress=False, tune_threads=False) is None:
        st = torch.load(tmp_path / "early" / "state.pt", weights_only=False)
        if st["phase"] == "flow" and st["step"] >= 1:
            break
    longer = dataclasses.replace(r, flow_steps=8)
    assert sm.train(tmp_path / "early", longer, progress=False, tune_threads=False) is not None  # 1 step in: fine

    done = sm.train(tmp_path / "done", r, progress=False, tune_threads=False)
    before = (tmp_path / "done" / "state.pt").read_bytes()
    with pytest.raises(ConfigError, match="cooldown") as e:
        sm.train(tmp_path / "done", longer, progress=False, tune_threads=False)
    assert "--flow-steps 4" in e.value.fix
    assert (tmp_path / "done" / "state.pt").read_bytes() == before
    assert sm.train(tmp_path / "done", r, progress=False, tune_threads=False) == done  # its own length: finished


def test_tiny_shapes_ships_with_the_package_and_generates(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tpkit import formulas, models
    from tpkit.models import base, sd3

    folder = sm.weights_dir()
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size <= 30e6 and list(folder.rglob("*.safetensors"))
    model = models.load("tiny-shapes", device="cpu")
    assert sd3.resolve("tiny-shapes") == str(folder)
    emb = model.encode(["a photo of a blue square"], sm.TEXT_LENGTH)
    sigmas = model.sigmas(4, sm.RESOLUTION)
    x = torch.randn(1, *model.latent_shape(sm.RESOLUTION), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in range(4):
            x = formulas.ode_step(x, model.velocity(x, torch.full((1,), sigmas[t]), emb, sm.GUIDANCE), sigmas[t], sigmas[t + 1])
    image = model.decode(x)
    assert image.shape == (1, sm.RESOLUTION, sm.RESOLUTION, 3) and image.dtype == np.uint8
    assert image.std() > 5  # not a blank canvas
    base.release()


def test_the_shipped_tiny_shapes_draws_what_it_is_asked():
    """A regression floor for the shipped weights, on train prompts with the model's own sampler
    settings (guidance 2.0): colours come out right in most images (0.84 held out, 40 steps)."""
    from tpkit.shapes import scenes as shapes

    meta = [m for m in shapes.prompts("train", n=8) if m["tag"] == "colors"]
    acc = sm.accuracy("tiny-shapes", meta, images_per_prompt=2, steps=20, seed=3)
    assert acc["colors"] >= 0.5, acc


def test_flow_learning_rate_warms_up_holds_then_cools_down_to_zero():
    r = sm.Recipe(flow_steps=1000, warmup=100, cooldown=0.2, flow_lr=1e-3)
    lr = [sm.flow_lr(r, s) for s in range(r.flow_steps)]
    assert lr[0] == 1e-5 and lr[99] == 1e-3  # linear warmup over 100 steps
    assert all(v == 1e-3 for v in lr[100:801])  # stable until the last 200 steps
    assert lr[800] > lr[801] > lr[999] > 0 and abs(lr[999] - 1e-3 / 200) < 1e-12  # linear to 0
    assert sm.flow_lr(dataclasses.replace(r, cooldown=0.0), 999) == 1e-3


def test_task_weights_set_the_flow_data_mix():
    from tpkit.shapes import scenes as shapes

    only = tuple(1.0 if t == "counting" else 0.0 for t in shapes.TAGS)
    scenes = sm.random_scenes(np.random.default_rng(0), 40, only)
    assert {s.metadata["tag"] for s in scenes} == {"counting"}
    w = tuple(3.0 if t == "position" else 1.0 for t in shapes.TAGS)  # position 3/8 of the scenes
    tags = [s.metadata["tag"] for s in sm.random_scenes(np.random.default_rng(1), 800, w)]
    assert abs(tags.count("position") / 800 - 3 / 8) < 0.06 and set(tags) == set(shapes.TAGS)
    # no weights: the uniform draw the shipped weights were trained with, scene for scene
    a = sm.random_scenes(np.random.default_rng(2), 5)
    b = [shapes.sample_scene(np.random.default_rng(2), size=sm.RESOLUTION)]
    assert a[0].prompt == b[0].prompt and a[0].objects == b[0].objects


@pytest.mark.parametrize("arg, says", [("counting=x", "TAG=W"), ("count=1", "TAG=W"), ("counting=-1", "TAG=W"),
                                       ("counting=nan", "TAG=W")])
def test_pretrain_shapes_refuses_a_bad_task_weight(tmp_path, capsys, arg, says):
    from tpkit import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["pretrain-shapes", "--out", str(tmp_path / "p"), "--task-weight", arg])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and says in err and "counting=1.5" in err and "Traceback" not in err
    assert not (tmp_path / "p").exists()


def test_a_run_refuses_to_continue_with_another_task_mix(tmp_path):
    from tpkit.shapes import scenes as shapes
    from tpkit.errors import ConfigError

    r = tiny_recipe()
    assert sm.train(tmp_path / "p", r, max_minutes=0, progress=False, tune_threads=False) is None
    before = (tmp_path / "p" / "state.pt").read_bytes()
    weighted = dataclasses.replace(r, task_weights=tuple(2.0 if t == "counting" else 1.0 for t in shapes.TAGS))
    with pytest.raises(ConfigError, match=r"task_weights None \(now \(1.0, 1.0, 2.0") as e:
        sm.train(tmp_path / "p", weighted, progress=False, tune_threads=False)
    assert "--task-weight" in e.value.fix and (tmp_path / "p" / "state.pt").read_bytes() == before


def test_pretraining_refuses_a_folder_that_is_not_a_pretraining_run(tmp_path):
    """An RL run folder (or a file) given as --out by mistake is left as it was."""
    from tpkit.errors import InputError

    run = tmp_path / "runs" / "shapes-tpgrpo"
    run.mkdir(parents=True)
    (run / "rounds.jsonl").write_text("{}\n")
    with pytest.raises(InputError, match="not a pretraining run") as e:
        sm.train(run, tiny_recipe(), max_minutes=0, progress=False, tune_threads=False)
    assert "new or empty --out" in e.value.fix and sorted(p.name for p in run.iterdir()) == ["rounds.jsonl"]
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        sm.train(tmp_path / "f", tiny_recipe(), max_minutes=0, progress=False, tune_threads=False)
    # an empty folder, or one whose first checkpoint was cut short, is a run to start
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "state.pt.tmp").write_bytes(b"")
    assert sm.train(tmp_path / "cut", tiny_recipe(), max_minutes=0, progress=False, tune_threads=False) is None
    assert (tmp_path / "cut" / "state.pt").is_file()
