"""Shared fixtures: one tiny-sd3 build and one small rollout/score per test session."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
# GenEval's own prompt metadata (553 prompts, MIT), which tpkit does not ship: tests that compare against
# it read $GENEVAL_METADATA, else a workspace copy next to the checkout, and are skipped without either.
OFFICIAL_GENEVAL = Path(os.environ.get("GENEVAL_METADATA")
                        or ROOT.parent / "shared" / "data" / "geneval" / "evaluation_metadata.jsonl")


@pytest.fixture(scope="session", autouse=True)
def tpkit_home(tmp_path_factory) -> Path:
    """Every test builds/loads tiny-sd3 under a private $TPKIT_HOME (never the user's cache)."""
    home = tmp_path_factory.mktemp("tpkit-home")
    old = os.environ.get("TPKIT_HOME")
    os.environ["TPKIT_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("TPKIT_HOME", None)
    else:
        os.environ["TPKIT_HOME"] = old


@pytest.fixture(scope="session")
def two_prompts(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "two.txt"
    p.write_text("a red cube on a wooden table\na small boat on a calm lake at dawn\n")
    return p


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, two_prompts) -> Path:
    """rollout -> score -> advantages on tiny-sd3: 2 prompts x 4 members, T = 10, K = 9."""
    from tpkit import advantages, rollout, score
    from tpkit.config import AdvantagesConfig, RolloutConfig, ScoreConfig

    run = tmp_path_factory.mktemp("tiny-run")
    rollout.run(RolloutConfig(prompts=str(two_prompts), out=str(run / "rollout"), group_size=4, prompts_per_shard=1))
    score.run(ScoreConfig(rollout=str(run / "rollout"), out=str(run / "score")))
    advantages.run(AdvantagesConfig(scores=str(run / "score"), out=str(run / "advantages")))
    return run


def build_tiny_clip(path: Path, layers: int = 1, seed: int = 0) -> Path:
    """A random CLIPModel (hidden 32, projection 16, 32 px images, patch 8) with its processor
    (tiny-sd3's byte-level tokenizer, the PIL image processor), saved to `path`."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    from tpkit.models.base import tiny_tokenizer

    tok = tiny_tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=2, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2, image_size=32,
                  patch_size=8)
    torch.manual_seed(seed)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(path)
    CLIPProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                  tokenizer=tok).save_pretrained(path)
    return path


def cli(*argv) -> int:
    """The `tpkit` command line run in this process (same code as the console script); its exit code."""
    from tpkit.cli import main

    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def as_written(table_file: Path) -> None:
    """Record a table edited inside a finished stage folder in that folder's manifest (its sha256), as if
    the stage had written it: for tests of what a faulty stage could write, which the digest check
    (`layout.check_files`) would otherwise refuse first as an edit after the fact."""
    import json

    from tpkit import layout

    path = Path(table_file).parent / layout.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files_sha256"][Path(table_file).name] = layout.file_digest(Path(table_file))
    path.write_text(json.dumps(manifest))


def branch_0_by_hand(run: Path, model, resolution: int = 64) -> tuple[float, float]:
    """(the brightness score recorded for branch 0 of a run's first trajectory, that of its ODE sample
    recomputed here from the rollout's noise with `model`): branch 0 is the ODE completion from s_0."""
    import torch
    from PIL import Image

    from tpkit import formulas, layout
    from tpkit.rewards.registry import brightness

    prompts, trajs = layout.read_shard(layout.list_shards(run / "rollout")[0])
    t = trajs[0]
    s = t.meta["sigmas"]
    x = torch.randn(model.latent_shape(resolution), generator=torch.Generator().manual_seed(t.meta["seed"]))[None]
    with torch.no_grad():
        for j in range(len(s) - 1):
            v = model.velocity(x, torch.tensor([s[j]]), prompts[t.meta["prompt_id"]].embeds, t.meta["guidance"])
            x = formulas.ode_step(x, v, s[j], s[j + 1])
    ours = brightness({})([Image.fromarray(model.decode(x)[0])], [], [])[0]
    row = next(r for r in layout.read_parquet_tables(run / "score", "score").to_pylist()
               if r["trajectory_id"] == t.trajectory_id and r["branch"] == 0)
    return row["reward"], ours


def launch_env() -> dict:
    """This environment ($TPKIT_HOME included) for a launcher's subprocesses, without any launcher's rank
    variables, one thread per process (2 cores, up to 3 processes), and no GPU: the CPU/gloo tests."""
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
              "ACCELERATE_USE_CPU", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def torchrun(*args, script: Path | None = None) -> list[str]:
    """2 local processes of tpkit (or of `script`); --standalone picks a free rendezvous port (other runs
    may be going on)."""
    launcher = [shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc_per_node", "2", *([str(script)] if script else ["-m", "tpkit"]),
            *map(str, args)]
