"""The `tpkit` command: a thin Typer layer over the stage libraries.

Each command parses options, builds a config, calls `tpkit.<stage>.run(cfg)` and renders a Rich
summary. Stage modules (and torch) are imported inside the commands so `tpkit --help` is fast.
Errors: tpkit's own print in one or two lines (exit 2), usage errors too (the flag, the value, the
expected type or the nearest flag; typer's own copy of click is caught, not only click's); anything
else in one line (exit 1); `--debug` anywhere on the command line shows the traceback instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from tpkit.config import TINY_MODEL, TrainConfig
from tpkit.errors import TpkitError

app = typer.Typer(
    name="tpkit", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="TP-GRPO and Flow-GRPO for flow-matching text-to-image models, as a staged offline pipeline.\n\n"
         "rollout -> score -> advantages -> train, or `tpkit run RECIPE.toml` for rounds of all four. "
         "Add --debug anywhere for tracebacks, --threads N to cap this process's CPU threads.",
)

_RANK = typer.Option(None, help="This process's rank (default: $RANK or 0).")
_WORLD = typer.Option(None, help="Number of processes (default: $WORLD_SIZE or 1).")
_DEVICE = typer.Option("auto", help="cuda, cpu, cuda:1 ... (auto: cuda if available).")
_DTYPE = typer.Option("auto", help="Model dtype: auto (bf16 on CUDA, float32 on CPU), float32, bf16, fp16.")
_TEXT_LENGTH = typer.Option(None, help="T5 tokens per prompt (default: the model's; 128 for SD3.5, as the release).")
_GUIDANCE = typer.Option(None, help="Guidance scale (default: the model's, as the release: CFG 4.5 for SD3.5, "
                                     "distilled guidance 3.5 for FLUX.1-dev).")
_FAMILY = typer.Option(None, help="Model family, sd3 or flux (default: from the model: its model_index.json, else its name).")
_MODEL = "Hub id, local folder, or a built-in model: tiny-sd3, tiny-flux (random, built locally), tiny-shapes (pretrained, shipped)."


@app.command()
def rollout(
    prompts: Path = typer.Option(..., "--prompts", help=".txt (one prompt a line) or .jsonl (objects with \"prompt\")."),
    out: Path = typer.Option(..., "--out", help="Output folder for shards and manifest.json."),
    model: str = typer.Option(TINY_MODEL, help=_MODEL),
    family: Optional[str] = _FAMILY,
    group_size: int = typer.Option(24, help="Trajectories per prompt (the GRPO group)."),
    steps: int = typer.Option(10, help="Sampling steps T."),
    guidance: Optional[float] = _GUIDANCE,
    resolution: Optional[int] = typer.Option(None, help="Image size in pixels (default: the model's; 512, 64 for the tiny ones)."),
    sampler: str = typer.Option("cps", help="sde (Flow-GRPO) or cps (coefficients-preserving; the paper's)."),
    noise_level: float = typer.Option(0.7, help="Noise level a of the stochastic sampler."),
    window_size: int = typer.Option(9, help="K: number of consecutive stochastic steps."),
    window_range: tuple[int, int] = typer.Option((0, 9), help="LO HI: the window start is drawn from [LO, HI - K]."),
    seed: int = typer.Option(0, help="Base seed; each trajectory's seed derives from (seed, prompt, member)."),
    lora: Optional[Path] = typer.Option(None, help="LoRA adapter folder from `tpkit train` (the current policy)."),
    prompts_per_shard: int = typer.Option(4, help="Prompt groups per shard (groups never split)."),
    batch_size: int = typer.Option(8, help="Trajectories per transformer batch (CFG doubles it)."),
    max_sequence_length: Optional[int] = _TEXT_LENGTH,
    overwrite: bool = typer.Option(False, help="Clear the output folder first and redo the stage."),
    device: str = _DEVICE, dtype: str = _DTYPE, rank: Optional[int] = _RANK, world_size: Optional[int] = _WORLD,
) -> None:
    """Sample SDE trajectories and cache their window states (WebDataset shards)."""
    from tpkit import rollout as stage
    from tpkit.config import RolloutConfig
    from tpkit.show import manifest_summary

    cfg = RolloutConfig(
        model=model, family=family, prompts=str(prompts), out=str(out), group_size=group_size, steps=steps, guidance=guidance,
        resolution=resolution, sampler=sampler, noise_level=noise_level, window_size=window_size,
        window_range=window_range, seed=seed, lora=str(lora) if lora else None, prompts_per_shard=prompts_per_shard,
        batch_size=batch_size, max_sequence_length=max_sequence_length, dtype=dtype, device=device, rank=rank,
        world_size=world_size, overwrite=overwrite,
    )
    manifest = stage.run(cfg)
    _finished(manifest, out, manifest_summary)


@app.command()
def score(
    rollout_dir: Path = typer.Argument(..., metavar="ROLLOUT_DIR", help="Folder written by `tpkit rollout`."),
    out: Path = typer.Option(..., "--out", help="Output folder for scores Parquet and manifest.json."),
    reward: List[str] = typer.Option(["jpeg-compressibility"], help="NAME[=WEIGHT], repeatable; or module:function."),
    reward_opt: List[str] = typer.Option([], help="NAME.OPTION=VALUE for a reward's model paths etc. (repeatable)."),
    branches: str = typer.Option("all", help="all: R_0..R_K (TP-GRPO); final: only R_K (Flow-GRPO)."),
    batch_size: int = typer.Option(16, help="Branches per transformer batch (CFG doubles it)."),
    decode_batch_size: int = typer.Option(8, help="Images per VAE decode and reward call."),
    reward_workers: int = typer.Option(1, help="Threads scoring images while the transformer runs (0: inline)."),
    branch_steps: int = typer.Option(0, help="0: exact branches; N: at most N ODE steps per branch (faster, approximate)."),
    on_nan: str = typer.Option("stop", help="A NaN/infinite reward: stop (list the trajectories) or drop them."),
    overwrite: bool = typer.Option(False, help="Clear the output folder first and redo the stage."),
    device: str = _DEVICE, dtype: str = _DTYPE, rank: Optional[int] = _RANK, world_size: Optional[int] = _WORLD,
) -> None:
    """Reward of the ODE completion from every cached window state (Parquet)."""
    from tpkit import score as stage
    from tpkit.config import ScoreConfig, parse_reward_options, parse_reward_specs
    from tpkit.show import manifest_summary, scores_view

    cfg = ScoreConfig(rollout=str(rollout_dir), out=str(out), rewards=parse_reward_specs(reward),
                      reward_options=parse_reward_options(reward_opt), branches=branches,
                      batch_size=batch_size, decode_batch_size=decode_batch_size, reward_workers=reward_workers,
                      branch_steps=branch_steps, on_nan=on_nan, overwrite=overwrite, device=device, dtype=dtype,
                      rank=rank, world_size=world_size)
    manifest = stage.run(cfg)

    def show(m: dict) -> None:
        from tpkit.layout import read_parquet_tables

        scores_view(read_parquet_tables(out, "score"))
        manifest_summary(m)

    _finished(manifest, out, show)


@app.command()
def advantages(
    scores: Path = typer.Argument(..., metavar="SCORES", help="Folder of scores Parquet files, or one file."),
    out: Path = typer.Option(..., "--out", help="Output folder for advantages.parquet and manifest.json."),
    method: str = typer.Option("tp-grpo", help="tp-grpo (turning points) or flow-grpo (r_k = R_K)."),
    balance: str = typer.Option("all", help="all: balance positive/negative turning points; none: keep all."),
    std: str = typer.Option("group", help="group: per-prompt std; global: std over all trajectories per step."),
    overwrite: bool = typer.Option(False, help="Clear the output folder first and redo the stage."),
) -> None:
    """Step rewards, turning points and advantages (Parquet)."""
    from tpkit import advantages as stage
    from tpkit.config import AdvantagesConfig
    from tpkit.show import advantages_view

    manifest = stage.run(AdvantagesConfig(scores=str(scores), out=str(out), method=method, balance=balance, std=std,
                                            overwrite=overwrite))
    advantages_view(manifest["summary"])
    _done(out)


@app.command()
def train(
    rollout_dir: Path = typer.Option(..., "--rollout", help="Folder written by `tpkit rollout`."),
    advantages_dir: Path = typer.Option(..., "--advantages", help="Folder written by `tpkit advantages`, or its advantages.parquet."),
    out: Path = typer.Option(..., "--out", help="Output folder: adapter/, state/, metrics.jsonl, manifest.json."),
    init_lora: Optional[Path] = typer.Option(None, help="adapter/ of a previous round (its state/ is continued too)."),
    lora_rank: int = typer.Option(32, help="LoRA rank r."),
    lora_alpha: int = typer.Option(64, help="LoRA alpha."),
    lora_target: Optional[List[str]] = typer.Option(
        None, help="Modules to adapt (repeatable; default: the model family's, as the release: SD3's joint-attention "
                   "projections, FLUX's attention and double-block feed-forward layers; SD3.5's second attention "
                   "(attn2.to_q ...) and FLUX's single-block proj_mlp/proj_out are opt-in)."),
    learning_rate: float = typer.Option(3e-4, help="AdamW learning rate."),
    adam_beta1: float = typer.Option(0.9), adam_beta2: float = typer.Option(0.999),
    adam_weight_decay: float = typer.Option(1e-4), adam_epsilon: float = typer.Option(1e-8),
    clip_range: float = typer.Option(1e-5, help="PPO clip range eps of the ratio."),
    adv_clip: float = typer.Option(5.0, help="Advantages are clamped to [-x, x]."),
    beta: float = typer.Option(1e-4, help="KL weight; 0 skips the reference pass."),
    kl: str = typer.Option(TrainConfig.kl, help="release: the KL on the release's scale (sde: without its dt, so "
                                                 "published weights mean the same); exact: the Gaussian KL."),
    drop_zero_advantage: bool = typer.Option(TrainConfig.drop_zero_advantage,
                                             help="Leave trajectories whose advantage is 0 at every step out of the loss (as the release)."),
    optimizer_steps: int = typer.Option(2, help="Optimizer steps per round (transitions split evenly)."),
    micro_batch_size: int = typer.Option(0, help="0: replay the rollout's batches (first ratio exactly 1); N: split them."),
    max_grad_norm: float = typer.Option(1.0, help="Gradient-norm clip."),
    mixed_precision: str = typer.Option("no", help="no, fp16 or bf16 (accelerate autocast)."),
    ema: bool = typer.Option(TrainConfig.ema, help="Keep an EMA of the LoRA: adapter/ is then the EMA, adapter-raw/ the trained weights."),
    ema_decay: float = typer.Option(TrainConfig.ema_decay, help="EMA decay (after the release's warm-up)."),
    ema_every: int = typer.Option(TrainConfig.ema_every, help="Update the EMA every N optimizer steps."),
    gradient_checkpointing: bool = typer.Option(False, help="Trade compute for activation memory."),
    max_bad_steps: int = typer.Option(3, help="Stop after this many non-finite steps in a row."),
    allow_no_op: bool = typer.Option(TrainConfig.allow_no_op,
                                     help="Accept a round with nothing to learn (every advantage 0, or every step "
                                          "non-finite): save the adapter unchanged instead of failing."),
    seed: int = typer.Option(0, help="Seed of the micro-batch order."),
    checkpoint_every: int = typer.Option(1, help="Save a resumable checkpoint every N optimizer steps (0: never)."),
    overwrite: bool = typer.Option(False, help="Clear the output folder first and redo the stage."),
    log_with: str = typer.Option("none", help="Track the metrics of every optimizer step: none, tensorboard "
                                             "(OUT/tensorboard/) or wandb (OUT/wandb/; offline without network)."),
    device: str = _DEVICE, dtype: str = _DTYPE,
) -> None:
    """GRPO updates of a LoRA on the cached transitions (accelerate; multi-GPU with `accelerate launch`)."""
    from tpkit import train as stage
    from tpkit.config import TrainConfig
    from tpkit.show import train_view

    cfg = TrainConfig(
        rollout=str(rollout_dir), advantages=str(advantages_dir), out=str(out), init_lora=str(init_lora) if init_lora else None,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=list(lora_target) if lora_target else None, learning_rate=learning_rate,
        adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_weight_decay=adam_weight_decay, adam_epsilon=adam_epsilon,
        clip_range=clip_range, adv_clip=adv_clip, beta=beta, kl=kl, drop_zero_advantage=drop_zero_advantage,
        optimizer_steps=optimizer_steps, ema_every=ema_every,
        micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm, mixed_precision=mixed_precision, ema=ema,
        ema_decay=ema_decay, gradient_checkpointing=gradient_checkpointing, max_bad_steps=max_bad_steps,
        allow_no_op=allow_no_op, seed=seed,
        checkpoint_every=checkpoint_every, overwrite=overwrite, log_with=log_with, device=device, dtype=dtype,
    )
    manifest = stage.run(cfg)
    if manifest:  # only the main process has one under accelerate launch
        train_view(out)
        _done(out)


@app.command("run")
def run_recipe(
    recipe: Path = typer.Argument(..., help="A TOML recipe, e.g. pipelines/tiny-cpu.toml."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default: the recipe's out, else runs/NAME)."),
    rounds: Optional[int] = typer.Option(None, help="Number of rounds (overrides the recipe)."),
    set_: List[str] = typer.Option([], "--set", help="Override a recipe key: --set train.learning_rate=1e-3 (repeatable)."),
    overwrite: bool = typer.Option(False, help="Clear the run folder first and start the run again."),
    log_with: Optional[str] = typer.Option(None, help="none, tensorboard (RUN/tensorboard/) or wandb (RUN/wandb/; "
                                                     "offline without network); default: the recipe's log_with."),
) -> None:
    """Rounds of rollout -> score -> advantages -> train from one recipe; rerun to continue."""
    from tpkit import run as stage
    from tpkit.config import load_recipe
    from tpkit.show import rounds_view

    r = load_recipe(recipe, set_, rounds=rounds, out=str(out) if out else None, log_with=log_with)
    lines = stage.run(r, overwrite=overwrite)
    if lines:  # the main process reports; the others return nothing
        rounds_view(lines, stage.base_eval(Path(r.out)))
        _done(Path(r.out))


eval_app = typer.Typer(help="Evaluate a model (+ LoRA) on held-out prompts.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")


def _eval(kind: str, model: str, lora: Optional[Path], prompts: Optional[Path], out: Path, images: Optional[Path],
          reward: list[str], reward_opt: list[str], images_per_prompt: int, steps: int, guidance: Optional[float],
          resolution: Optional[int], seed: int, batch_size: int, max_sequence_length: Optional[int], device: str,
          dtype: str, rank, world_size) -> None:
    from tpkit import evaluate
    from tpkit.config import parse_reward_options, parse_reward_specs
    from tpkit.show import eval_view

    cfg = evaluate.EvalConfig(
        kind=kind, model=model, lora=str(lora) if lora else None, prompts=str(prompts) if prompts else "", out=str(out),
        images=str(images) if images else None, rewards=parse_reward_specs(reward) if reward else {},
        reward_options=parse_reward_options(reward_opt), images_per_prompt=images_per_prompt, steps=steps,
        guidance=guidance, resolution=resolution, seed=seed, batch_size=batch_size,
        max_sequence_length=max_sequence_length, device=device, dtype=dtype, rank=rank, world_size=world_size)
    _finished(evaluate.run(cfg), out, eval_view)


@eval_app.command("reward")
def eval_reward(
    prompts: Path = typer.Option(..., "--prompts", help="Test prompts: .txt or .jsonl."),
    out: Path = typer.Option(..., "--out", help="Output folder: images/, results.jsonl, summary.json, grid.png."),
    reward: List[str] = typer.Option(..., help="NAME[=WEIGHT], repeatable; or module:function."),
    reward_opt: List[str] = typer.Option([], help="NAME.OPTION=VALUE (repeatable)."),
    model: str = typer.Option(TINY_MODEL, help=_MODEL),
    lora: Optional[Path] = typer.Option(None, help="LoRA adapter folder (e.g. runs/NAME/round-NNNN/train/adapter)."),
    images: Optional[Path] = typer.Option(None, help="Score this folder of images (GenEval layout) instead of generating."),
    images_per_prompt: int = typer.Option(4), steps: int = typer.Option(40, help="ODE steps."),
    guidance: Optional[float] = _GUIDANCE, resolution: Optional[int] = typer.Option(None), seed: int = typer.Option(0),
    batch_size: int = typer.Option(8), max_sequence_length: Optional[int] = _TEXT_LENGTH, device: str = _DEVICE,
    dtype: str = _DTYPE, rank: Optional[int] = _RANK, world_size: Optional[int] = _WORLD,
) -> None:
    """Mean ± std (overall and per prompt) of any reward over a test set, with an image grid."""
    _eval("reward", model, lora, prompts, out, images, reward, reward_opt, images_per_prompt, steps, guidance,
          resolution, seed, batch_size, max_sequence_length, device, dtype, rank, world_size)


@eval_app.command("geneval")
def eval_geneval(
    out: Path = typer.Option(..., "--out", help="Output folder: images/, results.jsonl, summary.json, grid-<task>.png."),
    metadata: Optional[Path] = typer.Option(None, help="GenEval evaluation_metadata.jsonl (default: GenEval's 553 prompts, regenerated)."),
    detector: Optional[str] = typer.Option(None, help="Detector id or folder (default Mask2Former Swin-S COCO)."),
    clip: Optional[str] = typer.Option(None, help="CLIP for colours (default openai/clip-vit-large-patch14)."),
    model: str = typer.Option(TINY_MODEL, help=_MODEL),
    lora: Optional[Path] = typer.Option(None, help="LoRA adapter folder."),
    images: Optional[Path] = typer.Option(None, help="Judge this folder of images (GenEval layout) instead of generating."),
    images_per_prompt: int = typer.Option(4), steps: int = typer.Option(40, help="ODE steps."),
    guidance: Optional[float] = _GUIDANCE, resolution: Optional[int] = typer.Option(None), seed: int = typer.Option(0),
    batch_size: int = typer.Option(8), max_sequence_length: Optional[int] = _TEXT_LENGTH, device: str = _DEVICE,
    dtype: str = _DTYPE, rank: Optional[int] = _RANK, world_size: Optional[int] = _WORLD,
) -> None:
    """The GenEval protocol: accuracy per task and overall (unweighted mean of the 6 tasks)."""
    opts = [f"geneval.{k}={v}" for k, v in (("detector", detector), ("clip", clip)) if v]
    _eval("geneval", model, lora, metadata, out, images, [], opts, images_per_prompt, steps, guidance,
          resolution, seed, batch_size, max_sequence_length, device, dtype, rank, world_size)


@eval_app.command("compare")
def eval_compare(
    entry: List[str] = typer.Option(..., help="NAME=MODEL or NAME=MODEL+LORA_FOLDER, repeatable: one column each, "
                                             "the first is the base the others are compared with."),
    out: Path = typer.Option(..., "--out", help="Output folder: entries/, compare.md|csv|json, grid.png."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Test prompts: .txt or .jsonl (GenEval metadata "
                                                                   "for --geneval; default there: GenEval's 553)."),
    reward: List[str] = typer.Option([], help="NAME (repeatable): a reward as a metric, e.g. pickscore, imagereward."),
    reward_opt: List[str] = typer.Option([], help="NAME.OPTION=VALUE (repeatable)."),
    geneval: bool = typer.Option(False, help="Also GenEval's accuracy (overall and per task) on the same images."),
    detector: Optional[str] = typer.Option(None, help="GenEval detector id or folder (shapes: the tiny-shapes one)."),
    images_per_prompt: int = typer.Option(4), steps: int = typer.Option(40, help="ODE steps."),
    guidance: Optional[float] = _GUIDANCE, resolution: Optional[int] = typer.Option(None), seed: int = typer.Option(0),
    batch_size: int = typer.Option(8), max_sequence_length: Optional[int] = _TEXT_LENGTH, device: str = _DEVICE,
    dtype: str = _DTYPE, rank: Optional[int] = _RANK, world_size: Optional[int] = _WORLD,
    overwrite: bool = typer.Option(False, help="Redo every entry's evaluation from scratch (other options, same --out)."),
) -> None:
    """Models/adapters x metrics on the same prompts and seeds: one table (mean ± s.e. over prompts, paired
    differences from the first entry) in Markdown, CSV and JSON, and a grid of each prompt across entries."""
    from tpkit import compare
    from tpkit.config import CompareConfig, EvalConfig, parse_reward_options, parse_reward_specs

    protocol = EvalConfig(
        prompts=str(prompts) if prompts else "", rewards={r: 1.0 for r in parse_reward_specs(reward)} if reward else {},
        reward_options=parse_reward_options(reward_opt), images_per_prompt=images_per_prompt, steps=steps,
        guidance=guidance, resolution=resolution, seed=seed, batch_size=batch_size, max_sequence_length=max_sequence_length, device=device, dtype=dtype,
        rank=rank, world_size=world_size, overwrite=overwrite)
    manifest = compare.run(CompareConfig(entries=list(entry), protocol=protocol, out=str(out), geneval=geneval,
                                         geneval_options={"detector": detector} if detector else {}))
    if manifest:
        from tpkit.ui import console

        console.print((out / "compare.md").read_text())
        _done(out)


prompts_app = typer.Typer(help="List the prompt sets tpkit ships; write the generated ones.", no_args_is_help=True)
app.add_typer(prompts_app, name="prompts")


@prompts_app.command("list")
def prompts_list() -> None:
    """Every prompt set in data/: how many prompts, what it is, where it comes from."""
    from rich.table import Table

    from tpkit.prompt_sets import DATA, SHIPPED
    from tpkit.ui import console

    table = Table(title=f"prompt sets in {DATA}")
    for col in ("file", "prompts", "what", "source"):
        table.add_column(col, overflow="fold")
    for s in SHIPPED:
        table.add_row(s.file if (DATA / s.file).is_file() else f"{s.file} [red](missing)[/]", str(s.prompts), s.what, s.how)
    console.print(table)
    if not DATA.is_dir():
        console.print("[yellow]data/ is not here[/]: the sets ship with the source checkout; "
                      "`tpkit prompts geneval|shapes` write the generated ones")


@prompts_app.command("geneval")
def prompts_geneval(
    out: Path = typer.Option(..., "--out", help="Output .jsonl: GenEval metadata, one object a line."),
    split: str = typer.Option("test", help="test: GenEval's procedure (seed 43, n 100 gives the official 553 "
                                            "prompts); train: prompts none of which is in the official test set."),
    seed: Optional[int] = typer.Option(None, help="Default: 43 for test, 0 for train."),
    n: Optional[int] = typer.Option(None, help="Per tag: draws for test (default 100), prompts for train (default 1000)."),
    overwrite: bool = typer.Option(False, help="Replace --out if it exists."),
) -> None:
    """GenEval-style train/test prompt sets (80 COCO classes, counts, colours, relations)."""
    from tpkit.geneval_prompts import run as write_prompts
    from tpkit.ui import console

    _new_file(out, overwrite)
    path = write_prompts(out, seed, split, n)
    lines = sum(1 for _ in path.open())
    console.print(f"[green]done[/]: {path} ({lines} prompts)")


@prompts_app.command("shapes")
def prompts_shapes(
    split: str = typer.Option(..., help="train or test: disjoint prompt sets of the shapes testbed (tpkit.shapes)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output .jsonl (default: data/shapes-SPLIT.jsonl)."),
    n: Optional[int] = typer.Option(None, help="Prompts per task (default 80 for train, 16 for test)."),
    seed: int = typer.Option(0, help="Order of the prompts within each task."),
    overwrite: bool = typer.Option(False, help="Replace --out if it exists."),
) -> None:
    """GenEval metadata for scenes of coloured shapes (the tiny-shapes testbed), six tasks."""
    from tpkit.shapes import write_prompts
    from tpkit.ui import console

    out = out or Path("data") / f"shapes-{split}.jsonl"
    _new_file(out, overwrite)
    path = write_prompts(out, split, n, seed)
    lines = sum(1 for _ in path.open())
    console.print(f"[green]done[/]: {path} ({lines} prompts)")


@app.command()
def doctor(
    recipe: Optional[Path] = typer.Argument(None, metavar="[RECIPE]",
                                            help="Recipe to check (its model, rewards, prompts and disk needs)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default: the recipe's out, else here)."),
    model: Optional[str] = typer.Option(None, help="Hub id, local folder or tiny-sd3 (replaces the recipe's)."),
    reward: List[str] = typer.Option([], help="NAME[=WEIGHT] of a reward to check, repeatable (besides the recipe's)."),
    reward_opt: List[str] = typer.Option([], help="NAME.OPTION=VALUE, e.g. pickscore.model=/models/PickScore_v1."),
) -> None:
    """Check the environment before a long run: torch/CUDA, libraries, disk, models and reward weights (offline)."""
    from tpkit import doctor as checks_

    checks = checks_.run(str(recipe) if recipe else None, out=str(out) if out else None, model=model,
                         rewards=list(reward), reward_opts=list(reward_opt))
    checks_.render(checks)
    raise typer.Exit(checks_.exit_code(checks))


@app.command()
def inspect(path: Path = typer.Argument(..., help="A stage folder, a .tar shard or a .parquet file.")) -> None:
    """Readable summary of a stage folder, a shard or a Parquet file."""
    from tpkit.show import inspect as show_inspect

    show_inspect(path)


@app.command()
def rewards() -> None:
    """List the built-in rewards and what each needs."""
    from rich.table import Table

    from tpkit.rewards import BUILTIN
    from tpkit.ui import out as console

    t = Table(title="built-in rewards (or module:function for your own)", title_justify="left")
    t.add_column("name", style="bold")
    t.add_column("needs")
    for name, (_, needs) in BUILTIN.items():
        t.add_row(name, needs)
    console.print(t)


@app.command("pretrain-shapes")
def pretrain_shapes(
    out: Path = typer.Option(..., "--out", help="Run folder: state.pt, data/, snapshots/, pipeline/ (the model)."),
    max_minutes: Optional[float] = typer.Option(None, help="Stop (checkpointed) after this many minutes; rerun to continue."),
    flow_steps: Optional[int] = typer.Option(None, help="Transformer steps (default: the recipe's)."),
) -> None:
    """Pretrain the `tiny-shapes` model from scratch (fixed seed; resumable: rerun the same command)."""
    from tpkit import shapes_model

    recipe = shapes_model.Recipe()
    if flow_steps is not None:
        recipe.flow_steps = flow_steps
    shapes_model.train(out, recipe, max_minutes=max_minutes)


def _new_file(out: Path, overwrite: bool) -> None:
    """A command writing one file never replaces an existing one (a shipped prompt set ...) unasked."""
    from tpkit.errors import InputError

    if out.exists() and not overwrite:
        raise InputError(f"{out} already exists", "pass another --out, or --overwrite to replace it")


def _finished(manifest: dict | None, out: Path, show) -> None:
    from tpkit.ui import console

    if manifest is None:
        console.print(f"[yellow]this rank's part is done[/]; {out} gets its manifest when every rank has finished")
        return
    show(manifest)
    _done(out)


def _done(out: Path) -> None:
    from tpkit.ui import console

    console.print(f"[green]done[/]: {out}")


def _click_exceptions() -> tuple:
    """Typer ships its own copy of click (typer._click): its usage errors are not click's classes."""
    import click

    import typer.exceptions

    mods = [click.exceptions, typer.exceptions]
    try:
        from typer._click import exceptions as typer_click

        mods.append(typer_click)
    except ImportError:
        pass
    return mods


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    argv = _take_threads(argv)
    mods = _click_exceptions()

    def classes(name: str) -> tuple:
        return tuple({getattr(m, name) for m in mods if isinstance(getattr(m, name, None), type)})

    help_shown, usage, clicked = classes("NoArgsIsHelpError"), classes("UsageError"), classes("ClickException")
    exited, aborted = classes("Exit"), classes("Abort")

    try:
        code = app(args=argv, prog_name="tpkit", standalone_mode=False)  # typer.Exit(n) comes back as n
        if isinstance(code, int) and code:
            sys.exit(code)
    except TpkitError as e:
        if debug:
            raise
        _error(str(e))
        sys.exit(e.exit_code)
    except help_shown as e:  # bare `tpkit` or `tpkit eval`: the help (typer may have printed it already)
        text = e.format_message()
        if text.strip():
            print(text)
        sys.exit(0)
    except exited as e:
        sys.exit(e.exit_code)
    except usage as e:
        if debug:
            raise
        _error(_usage_message(e, argv))
        sys.exit(2)
    except clicked as e:
        if debug:
            raise
        _error(e.format_message())
        sys.exit(e.exit_code or 1)
    except (*aborted, KeyboardInterrupt):
        _error("interrupted; rerun the same command to finish (finished files are kept)")
        sys.exit(130)
    except Exception as e:
        if debug:
            raise
        _error(f"{type(e).__name__}: {e}".splitlines()[0][:300] + "\n  (rerun with --debug for the traceback)")
        sys.exit(1)


def _usage_message(e, argv: list[str]) -> str:
    """A usage error in tpkit's voice: what was wrong with which flag, the expected value, the fix."""
    import difflib

    ctx = getattr(e, "ctx", None)
    command = ctx.command_path if ctx is not None else \
        "tpkit" + (f" {argv[0]}" if argv and not argv[0].startswith("-") else "")
    fix = f"  fix: see `{command} --help`"
    param = getattr(e, "param", None)
    kind = type(e).__name__
    if kind == "NoSuchOption":
        name = getattr(e, "option_name", "") or ""
        known = [o for p in (ctx.command.params if ctx is not None else []) for o in getattr(p, "opts", [])
                 if o.startswith("-")] + ["--help"]
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        return f"no such option {name}" + (f" (did you mean {near[0]}?)" if near else "") + "\n" + fix
    if kind == "MissingParameter":
        what = "option" if param is not None and getattr(param, "param_type_name", "") == "option" else "argument"
        names = "/".join(param.opts) if param is not None else ""
        if what == "argument" and param is not None:
            names = (getattr(param, "metavar", None) or param.name.upper())
        return f"missing {what} {names}\n" + fix
    if param is not None and getattr(param, "opts", None):
        flag = param.opts[0]
        given = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in param.opts), None)
        default = getattr(param, "default", None)
        example = f"e.g. {flag} {' '.join(map(str, default)) if isinstance(default, (tuple, list)) else default}" \
            if default not in (None, "", [], ()) and not isinstance(default, bool) else ""
        msg = getattr(e, "message", str(e))
        return (f"{flag}{f' {given!r}' if given is not None else ''}: {msg[:1].lower() + msg[1:]}\n"
                f"  fix: {example + ' (' if example else ''}see `{command} --help`{')' if example else ''}")
    text = e.format_message() if hasattr(e, "format_message") else str(e)
    return f"{text[:1].lower() + text[1:]}\n" + fix


def _take_threads(argv: list[str]) -> list[str]:
    """`--threads N` anywhere on the command line: CPU threads of this process (TPKIT_THREADS), e.g.
    1 each for two runs side by side on 2 cores. Default: the cores divided by the local processes."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--threads" or a.startswith("--threads="):
            value = a.partition("=")[2] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            if not value.isdigit() or int(value) < 1:
                _error(f"--threads {value!r} is not a positive integer\n  fix: e.g. --threads 1 for each of two runs on 2 cores")
                sys.exit(2)
            import os

            os.environ["TPKIT_THREADS"] = value
            continue
        out.append(a)
        i += 1
    return out


def _error(text: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(text)}", highlight=False)


if __name__ == "__main__":
    main()
