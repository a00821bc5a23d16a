"""The `tpkit` command: a thin Typer layer over the stage libraries.

Each command parses options, builds a config, calls `tpkit.<stage>.run(cfg)` and renders a Rich
summary. An option that sets a config field takes its default and help from the field (`opt`): each
is declared once, in `tpkit.config`. Stage modules (and torch) are imported inside the commands so
`tpkit --help` is fast.
How errors are reported (one or two lines, an exit code, `--debug` for tracebacks): `tpkit.cli_errors`.
"""

from __future__ import annotations

import dataclasses
import inspect as pyinspect  # not `inspect`: the `tpkit inspect` command below takes that name
import sys
import typing
from pathlib import Path
from typing import List, Optional

import typer

from tpkit import config
from tpkit.config import AdvantagesConfig, CompareConfig, EvalConfig, RolloutConfig, ScoreConfig, TrainConfig, field_help
from tpkit import cli_errors
from tpkit.errors import InputError

app = typer.Typer(
    name="tpkit", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="TP-GRPO and Flow-GRPO for flow-matching text-to-image models, as a staged offline pipeline.\n\n"
         "rollout -> score -> advantages -> train, or `tpkit run RECIPE.toml` for rounds of all four. "
         "Add --debug anywhere for tracebacks, --threads N to cap this process's CPU threads.",
)


def opt(cls: type, name: str, *decls: str, required: bool = False, **extra):
    """The option for field `name` of config dataclass `cls`: the field's default (none if `required`) and
    help; `decls` and `extra` (a command's own help ...) go to typer.Option as they are."""
    extra.setdefault("help", field_help(cls, name))
    return typer.Option(... if required else config.default(cls, name), *decls, **extra)


# The evaluation sampler's options, shared by `tpkit eval reward|geneval|compare` (`eval_options`).
SAMPLER_OPTIONS = ("images_per_prompt", "steps", "guidance", "resolution", "seed", "batch_size", "max_sequence_length",
                   "grid_prompts", "device", "dtype", "rank", "world_size")


def eval_options(*names: str):
    """Give a command EvalConfig's options `names` after its own ones (type, default and help from the
    fields, as `opt` does), passed to it in its `**options`: declared once for the three eval commands."""
    hints = typing.get_type_hints(EvalConfig)

    def add(fn):
        sig = pyinspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not pyinspect.Parameter.VAR_KEYWORD]
        added = [pyinspect.Parameter(n, pyinspect.Parameter.KEYWORD_ONLY, default=opt(EvalConfig, n), annotation=hints[n])
                 for n in names]
        fn.__signature__ = sig.replace(parameters=own + added)
        return fn
    return add


def _reward_specs(weights: dict[str, float]) -> list[str]:
    """{'pickscore': 1.0, 'ocr': 0.5} -> ['pickscore', 'ocr=0.5']: a config's rewards as --reward values."""
    return [name if w == 1 else f"{name}={w}" for name, w in weights.items()]


def _str(path: Optional[Path]) -> Optional[str]:
    return str(path) if path else None


@app.command()
def rollout(
    prompts: Path = opt(RolloutConfig, "prompts", "--prompts", required=True),
    out: Path = opt(RolloutConfig, "out", "--out", required=True),
    model: str = opt(RolloutConfig, "model"),
    family: Optional[str] = opt(RolloutConfig, "family"),
    group_size: int = opt(RolloutConfig, "group_size"),
    steps: int = opt(RolloutConfig, "steps"),
    guidance: Optional[float] = opt(RolloutConfig, "guidance"),
    resolution: Optional[int] = opt(RolloutConfig, "resolution"),
    sampler: str = opt(RolloutConfig, "sampler"),
    noise_level: float = opt(RolloutConfig, "noise_level"),
    window_size: int = opt(RolloutConfig, "window_size"),
    window_range: tuple[int, int] = opt(RolloutConfig, "window_range"),
    seed: int = opt(RolloutConfig, "seed"),
    lora: Optional[Path] = opt(RolloutConfig, "lora"),
    prompts_per_round: int = opt(RolloutConfig, "prompts_per_round"),
    prompts_per_shard: int = opt(RolloutConfig, "prompts_per_shard"),
    batch_size: int = opt(RolloutConfig, "batch_size"),
    max_sequence_length: Optional[int] = opt(RolloutConfig, "max_sequence_length"),
    overwrite: bool = opt(RolloutConfig, "overwrite"),
    device: str = opt(RolloutConfig, "device"), dtype: str = opt(RolloutConfig, "dtype"),
    rank: Optional[int] = opt(RolloutConfig, "rank"), world_size: Optional[int] = opt(RolloutConfig, "world_size"),
) -> None:
    """Sample SDE trajectories and cache their window states (WebDataset shards)."""
    from tpkit import rollout as stage
    from tpkit.show import manifest_summary

    cfg = RolloutConfig(
        model=model, family=family, prompts=str(prompts), out=str(out), group_size=group_size, steps=steps, guidance=guidance,
        resolution=resolution, sampler=sampler, noise_level=noise_level, window_size=window_size,
        window_range=window_range, seed=seed, lora=_str(lora), prompts_per_round=prompts_per_round,
        prompts_per_shard=prompts_per_shard, batch_size=batch_size, max_sequence_length=max_sequence_length, dtype=dtype,
        device=device, rank=rank, world_size=world_size, overwrite=overwrite,
    )
    manifest = stage.run(cfg)
    _finished(manifest, out, manifest_summary)


@app.command()
def score(
    rollout_dir: Path = typer.Argument(..., metavar="ROLLOUT_DIR", help=field_help(ScoreConfig, "rollout")),
    out: Path = opt(ScoreConfig, "out", "--out", required=True),
    reward: List[str] = typer.Option(_reward_specs(config.default(ScoreConfig, "rewards")),
                                     help="NAME[=WEIGHT], repeatable; or module:function."),
    reward_opt: List[str] = typer.Option([], help="NAME.OPTION=VALUE for a reward's model paths etc. (repeatable)."),
    branches: str = opt(ScoreConfig, "branches"),
    batch_size: int = opt(ScoreConfig, "batch_size"),
    decode_batch_size: int = opt(ScoreConfig, "decode_batch_size"),
    reward_workers: int = opt(ScoreConfig, "reward_workers"),
    branch_steps: int = opt(ScoreConfig, "branch_steps"),
    branch_solver: str = opt(ScoreConfig, "branch_solver"),
    on_nan: str = opt(ScoreConfig, "on_nan"),
    overwrite: bool = opt(ScoreConfig, "overwrite"),
    device: str = opt(ScoreConfig, "device"), dtype: str = opt(ScoreConfig, "dtype"),
    rank: Optional[int] = opt(ScoreConfig, "rank"), world_size: Optional[int] = opt(ScoreConfig, "world_size"),
) -> None:
    """Reward of the ODE completion from every cached window state (Parquet)."""
    from tpkit import score as stage
    from tpkit.config import parse_reward_options, parse_reward_specs
    from tpkit.show import manifest_summary, scores_view

    cfg = ScoreConfig(rollout=str(rollout_dir), out=str(out), rewards=parse_reward_specs(reward),
                      reward_options=parse_reward_options(reward_opt), branches=branches,
                      batch_size=batch_size, decode_batch_size=decode_batch_size, reward_workers=reward_workers,
                      branch_steps=branch_steps, branch_solver=branch_solver, on_nan=on_nan, overwrite=overwrite, device=device, dtype=dtype,
                      rank=rank, world_size=world_size)
    manifest = stage.run(cfg)

    def show(m: dict) -> None:
        from tpkit.layout import read_parquet_tables

        scores_view(read_parquet_tables(out, "score"))
        manifest_summary(m)

    _finished(manifest, out, show)


@app.command()
def advantages(
    scores: Path = typer.Argument(..., metavar="SCORES", help=field_help(AdvantagesConfig, "scores")),
    out: Path = opt(AdvantagesConfig, "out", "--out", required=True),
    method: str = opt(AdvantagesConfig, "method"),
    balance: str = opt(AdvantagesConfig, "balance"),
    std: str = opt(AdvantagesConfig, "std"),
    overwrite: bool = opt(AdvantagesConfig, "overwrite"),
) -> None:
    """Step rewards, turning points and advantages (Parquet)."""
    from tpkit import advantages as stage
    from tpkit.show import advantages_view

    manifest = stage.run(AdvantagesConfig(scores=str(scores), out=str(out), method=method, balance=balance, std=std,
                                            overwrite=overwrite))
    advantages_view(manifest["summary"])
    _done(out)


@app.command()
def train(
    rollout_dir: Path = opt(TrainConfig, "rollout", "--rollout", required=True),
    advantages_dir: Path = opt(TrainConfig, "advantages", "--advantages", required=True),
    out: Path = opt(TrainConfig, "out", "--out", required=True),
    finetune: str = opt(TrainConfig, "finetune"),
    init_lora: Optional[Path] = opt(TrainConfig, "init_lora"),
    init_state: Optional[Path] = opt(TrainConfig, "init_state"),
    lora_rank: int = opt(TrainConfig, "lora_rank"),
    lora_alpha: int = opt(TrainConfig, "lora_alpha"),
    lora_target: Optional[List[str]] = opt(TrainConfig, "lora_targets", "--lora-target"),
    optimizer: str = opt(TrainConfig, "optimizer"),
    learning_rate: float = opt(TrainConfig, "learning_rate"),
    adam_beta1: float = opt(TrainConfig, "adam_beta1"), adam_beta2: float = opt(TrainConfig, "adam_beta2"),
    adam_weight_decay: float = opt(TrainConfig, "adam_weight_decay"),
    adam_epsilon: float = opt(TrainConfig, "adam_epsilon"),
    clip_range: float = opt(TrainConfig, "clip_range"),
    adv_clip: float = opt(TrainConfig, "adv_clip"),
    beta: float = opt(TrainConfig, "beta"),
    kl: str = opt(TrainConfig, "kl"),
    drop_zero_advantage: bool = opt(TrainConfig, "drop_zero_advantage"),
    optimizer_steps: int = opt(TrainConfig, "optimizer_steps"),
    micro_batch_size: int = opt(TrainConfig, "micro_batch_size"),
    max_grad_norm: float = opt(TrainConfig, "max_grad_norm"),
    mixed_precision: str = opt(TrainConfig, "mixed_precision"),
    ema: bool = opt(TrainConfig, "ema"),
    ema_decay: float = opt(TrainConfig, "ema_decay"),
    ema_every: int = opt(TrainConfig, "ema_every"),
    gradient_checkpointing: bool = opt(TrainConfig, "gradient_checkpointing"),
    fsdp: bool = opt(TrainConfig, "fsdp"),
    max_bad_steps: int = opt(TrainConfig, "max_bad_steps"),
    allow_no_op: bool = opt(TrainConfig, "allow_no_op"),
    seed: int = opt(TrainConfig, "seed"),
    checkpoint_every: int = opt(TrainConfig, "checkpoint_every"),
    overwrite: bool = opt(TrainConfig, "overwrite"),
    log_with: str = opt(TrainConfig, "log_with"),
    device: str = opt(TrainConfig, "device"), dtype: str = opt(TrainConfig, "dtype"),
) -> None:
    """GRPO updates of a LoRA (or, --finetune full, of every weight) on the cached transitions (accelerate;
    multi-GPU with `accelerate launch`)."""
    from tpkit import train as stage
    from tpkit.show import train_view

    cfg = TrainConfig(
        rollout=str(rollout_dir), advantages=str(advantages_dir), out=str(out), finetune=finetune, init_lora=_str(init_lora),
        init_state=_str(init_state), lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=list(lora_target) if lora_target else None, optimizer=optimizer, learning_rate=learning_rate,
        adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_weight_decay=adam_weight_decay, adam_epsilon=adam_epsilon,
        clip_range=clip_range, adv_clip=adv_clip, beta=beta, kl=kl, drop_zero_advantage=drop_zero_advantage,
        optimizer_steps=optimizer_steps, ema_every=ema_every,
        micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm, mixed_precision=mixed_precision, ema=ema,
        ema_decay=ema_decay, gradient_checkpointing=gradient_checkpointing, fsdp=fsdp, max_bad_steps=max_bad_steps,
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
    from tpkit import evaluate
    from tpkit import run as stage
    from tpkit.config import load_recipe
    from tpkit.show import rounds_view

    r = load_recipe(recipe, set_, rounds=rounds, out=str(out) if out else None, log_with=log_with)
    lines = stage.run(r, overwrite=overwrite)
    if lines:  # the main process reports; the others return nothing
        rounds_view(lines, evaluate.base_eval(Path(r.out)), evaluate.heldout_change(Path(r.out), lines))
        _done(Path(r.out))


eval_app = typer.Typer(help="Evaluate a model (+ LoRA) on held-out prompts.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")


def _eval(kind: str, out: Path, prompts: Optional[Path], lora: Optional[Path], images: Optional[Path],
          reward: list[str], reward_opt: list[str], **same) -> None:
    """`same`: options named as their EvalConfig fields, passed as they are."""
    from tpkit import evaluate
    from tpkit.config import parse_reward_options, parse_reward_specs
    from tpkit.show import eval_view

    cfg = EvalConfig(kind=kind, out=str(out), prompts=str(prompts) if prompts else "", lora=_str(lora),
                     images=_str(images), rewards=parse_reward_specs(reward) if reward else {},
                     reward_options=parse_reward_options(reward_opt), **same)
    _finished(evaluate.run(cfg), out, eval_view)


@eval_app.command("reward")
@eval_options(*SAMPLER_OPTIONS, "overwrite")
def eval_reward(
    prompts: Path = opt(EvalConfig, "prompts", "--prompts", required=True),
    out: Path = opt(EvalConfig, "out", "--out", required=True),
    reward: List[str] = typer.Option(..., help="NAME[=WEIGHT], repeatable; or module:function."),
    reward_opt: List[str] = typer.Option([], help="NAME.OPTION=VALUE (repeatable)."),
    model: str = opt(EvalConfig, "model"),
    family: Optional[str] = opt(EvalConfig, "family"),
    lora: Optional[Path] = opt(EvalConfig, "lora"),
    images: Optional[Path] = opt(EvalConfig, "images"),
    **options,
) -> None:
    """Mean ± std (overall and per prompt) of any reward over a test set, with an image grid."""
    _eval("reward", out, prompts, lora, images, reward, reward_opt, model=model, family=family, **options)


@eval_app.command("geneval")
@eval_options(*SAMPLER_OPTIONS, "overwrite")
def eval_geneval(
    out: Path = opt(EvalConfig, "out", "--out", required=True),
    metadata: Optional[Path] = typer.Option(None, help="GenEval evaluation_metadata.jsonl (default: GenEval's 553 prompts, regenerated)."),
    detector: Optional[str] = typer.Option(None, help="Detector id or folder (default Mask2Former Swin-S COCO)."),
    clip: Optional[str] = typer.Option(None, help="CLIP for colours (default openai/clip-vit-large-patch14)."),
    model: str = opt(EvalConfig, "model"),
    family: Optional[str] = opt(EvalConfig, "family"),
    lora: Optional[Path] = opt(EvalConfig, "lora"),
    images: Optional[Path] = opt(EvalConfig, "images"),
    **options,
) -> None:
    """The GenEval protocol: accuracy per task and overall (unweighted mean of the 6 tasks)."""
    opts = [f"geneval.{k}={v}" for k, v in (("detector", detector), ("clip", clip)) if v]
    _eval("geneval", out, metadata, lora, images, [], opts, model=model, family=family, **options)


@eval_app.command("compare")
@eval_options(*SAMPLER_OPTIONS)
def eval_compare(
    entry: List[str] = opt(CompareConfig, "entries", "--entry", required=True),
    out: Path = opt(CompareConfig, "out", "--out", required=True),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Test prompts: .txt or .jsonl (GenEval metadata "
                                                                   "for --geneval; default there: GenEval's 553)."),
    reward: List[str] = typer.Option([], help="NAME (repeatable): a reward as a metric, e.g. pickscore, imagereward."),
    reward_opt: List[str] = typer.Option([], help="NAME.OPTION=VALUE (repeatable)."),
    geneval: bool = opt(CompareConfig, "geneval"),
    detector: Optional[str] = typer.Option(None, help="GenEval detector id or folder (shapes: the tiny-shapes one)."),
    clip: Optional[str] = typer.Option(None, help="GenEval's CLIP for colours (default openai/clip-vit-large-patch14)."),
    overwrite: bool = opt(EvalConfig, "overwrite", help="Redo every entry's evaluation from scratch (other options, same --out)."),
    **sampler,
) -> None:
    """Models/adapters x metrics on the same prompts and seeds: one table (mean ± s.e. over prompts, paired
    differences from the first entry) in Markdown, CSV and JSON, and a grid of each prompt across entries."""
    from tpkit import compare
    from tpkit.config import parse_reward_options, parse_reward_specs

    protocol = EvalConfig(
        prompts=str(prompts) if prompts else "", rewards={r: 1.0 for r in parse_reward_specs(reward)} if reward else {},
        reward_options=parse_reward_options(reward_opt), overwrite=overwrite, **sampler)
    geneval_options = {k: v for k, v in (("detector", detector), ("clip", clip)) if v}
    manifest = compare.run(CompareConfig(entries=list(entry), protocol=protocol, out=str(out), geneval=geneval,
                                         geneval_options=geneval_options))
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
    from tpkit.geneval.prompts import run as write_prompts
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
    from tpkit.shapes.scenes import write_prompts
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
    set_: List[str] = typer.Option([], "--set", help="KEY=VALUE overriding the recipe, as for `tpkit run`."),
    processes: int = typer.Option(1, min=1, help="Processes the run will start (train's memory per process with "
                                                "train.fsdp = true is 1/N of the weights and optimizer state)."),
) -> None:
    """Check the environment before a long run: torch/CUDA, libraries, disk, models and reward weights (offline)."""
    from tpkit import doctor as checks_

    checks = checks_.run(str(recipe) if recipe else None, out=str(out) if out else None, model=model,
                         rewards=list(reward), reward_opts=list(reward_opt), overrides=list(set_), processes=processes)
    checks_.render(checks)
    raise typer.Exit(checks_.exit_code(checks))


@app.command()
def inspect(path: Path = typer.Argument(..., help="A stage folder, a .tar shard or a .parquet file.")) -> None:
    """Readable summary of a stage folder, a shard or a Parquet file."""
    from tpkit.show import inspect as show_inspect

    show_inspect(path)


@app.command()
def trajectory(
    round_dir: Optional[Path] = typer.Argument(None, metavar="[ROUND]",
                                               help="A round folder of `tpkit run` (its rollout/, score/, advantages/)."),
    rollout: Optional[Path] = typer.Option(None, help="Rollout folder (default: ROUND/rollout)."),
    scores: Optional[Path] = typer.Option(None, help="Scores folder of that rollout, every branch (default: ROUND/score)."),
    advantages: Optional[Path] = typer.Option(None, help="Advantages folder or file (default: ROUND/advantages, if any)."),
    id: Optional[str] = typer.Option(None, "--id", help="Trajectory id (default: the one with the most turning points)."),
    out: Optional[Path] = typer.Option(None, "--out", help="PNG to write (default: ./trajectory-ID.png)."),
    overwrite: bool = typer.Option(False, help="Replace an existing --out file."),
    device: str = opt(ScoreConfig, "device"), dtype: str = opt(ScoreConfig, "dtype"),
) -> None:
    """One trajectory step by step: each window state's ODE-branch image (recomputed, checked against
    the stored R_k), step rewards, turning points and advantages, as a PNG and a table."""
    from tpkit import trajectory as stage
    from tpkit.show import trajectory_view

    if round_dir is None and (rollout is None or scores is None):
        raise InputError("no trajectory to show", "pass a round folder of `tpkit run`, or --rollout and --scores")
    base = Path(round_dir) if round_dir else None
    if base and not (rollout and scores) and not (base / "rollout").is_dir():
        raise InputError(f"{base} is not a round folder of `tpkit run` (no rollout/ in it)",
                         "pass a round folder (runs/NAME/round-0003), or --rollout and --scores")
    adv = advantages or (base / "advantages" if base and (base / "advantages").is_dir() else None)
    result = stage.run(rollout or base / "rollout", scores or base / "score", adv, id, out, device, dtype,
                       overwrite=overwrite)
    trajectory_view(result)


@app.command()
def rewards() -> None:
    """List the built-in rewards and what each needs."""
    from rich.table import Table

    from tpkit.rewards.registry import BUILTIN
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
    task_weight: List[str] = typer.Option([], help="TAG=W: relative share of a GenEval task's scenes in the "
                                          "flow data (repeatable; unnamed tasks weigh 1; default: the recipe's)."),
) -> None:
    """Pretrain the `tiny-shapes` model from scratch (fixed seed; resumable: rerun the same command)."""
    from tpkit.shapes import model

    _positive_minutes(max_minutes)
    recipe = model.Recipe()
    if flow_steps is not None:
        recipe.flow_steps = flow_steps
    if task_weight:
        recipe.task_weights = model.task_weights(task_weight, recipe.task_weights)
    model.train(out, recipe, max_minutes=max_minutes)


@app.command("pretrain-shapes-reward")
def pretrain_shapes_reward(
    out: Path = typer.Option(..., "--out", help="Run folder: state.pt (resumable) and model/ (CLIPModel + processor)."),
    max_minutes: Optional[float] = typer.Option(None, help="Stop (checkpointed) after this many minutes; rerun to continue."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps (default: the recipe's)."),
    seed: Optional[int] = typer.Option(None, help="Seed of the initialisation, the batches and the sample bank's noise "
                                       "(default: the recipe's, 0): another seed measures what a rerun could move."),
    workers: int = typer.Option(1, help="Processes rendering the batches ahead (0: inline); the result does not depend on it."),
    sample_pairs: Optional[int] = typer.Option(None, help="Ranked pairs of tiny-shapes samples per batch (0: rendered scenes only)."),
    samples_per_prompt: Optional[int] = typer.Option(None, help="tiny-shapes samples (with --bank branches: SDE "
                                                     "trajectories) drawn per train prompt for the ranking."),
    bank: Optional[str] = typer.Option(None, help="What the ranked samples are: samples (ODE samples, ranked within a "
                                       "prompt) or branches (ODE completions from every state of an SDE trajectory, "
                                       "as the score stage judges them, ranked within a trajectory)."),
    graded_pairs: Optional[int] = typer.Option(None, help="Ranked pairs of rendered near misses per batch, ordered by "
                                               "their dense score (0: none)."),
    graded_by: Optional[str] = typer.Option(None, help="How graded pairs are graded: truth (crisp renders, true boxes) "
                                            "or detector (blurred, saturated renders through the shapes detector)."),
    caption_pairs: Optional[int] = typer.Option(None, help="tiny-shapes samples per batch ranked under two captions "
                                                "by the shapes detector's verdict on them (0: none)."),
    task_weight: List[str] = typer.Option([], help="TAG=W: relative share of a GenEval task's scene pairs "
                                          "(repeatable; unnamed tasks weigh 1; default: every task alike)."),
    layout_aux: Optional[float] = typer.Option(None, help="Weight of a training-only head that regresses where each "
                                               "shape class is from the image embedding (0: none)."),
    mirror_pairs: Optional[float] = typer.Option(None, help="Share of position pairs whose partner is the same scene "
                                                 "mirrored, captioned with the relation flipped (0: none)."),
    shift_consistency: Optional[float] = typer.Option(None, help="Weight of a training-only term: a render moved by "
                                                      "a few pixels keeps the reward it had (0: none)."),
    detector_aux: Optional[float] = typer.Option(None, help="Weight of a training-only head that regresses, from the "
                                                 "image embedding, what the shapes detector finds in the generator's "
                                                 "samples: objects of each colour and class (0: none)."),
    absolute_pairs: Optional[int] = typer.Option(None, help="Pairs of a batch that are one shape and its mirror, "
                                                 "captioned where it is ('a photo of a circle on the left'; 0: none)."),
    relation_start: Optional[int] = typer.Option(None, help="Position prompts from this step on (0: from the first): "
                                                 "with --absolute-pairs, a curriculum from places to relations."),
    width: Optional[int] = typer.Option(None, help="Both towers' hidden size, in heads of 32 (default: the recipe's, "
                                        "128; the package's limit of 10 MB holds about 160 in float32)."),
    patch: Optional[int] = typer.Option(None, help="The vision tower's patch side in px (default: the recipe's, 8; "
                                        "4 sees the 64 px image as 256 patches, at about 3.5x the step time)."),
) -> None:
    """Pretrain `tiny-shapes-pickscore`, the testbed's CLIP preference model, on train-split prompts (fixed seed;
    resumable: rerun the same command)."""
    from tpkit.shapes import model, preference

    _positive_minutes(max_minutes)
    recipe = preference.Recipe()
    for name, value in (("seed", seed), ("steps", steps), ("sample_pairs", sample_pairs),
                        ("samples_per_prompt", samples_per_prompt), ("bank", bank), ("graded_pairs", graded_pairs),
                        ("graded_by", graded_by), ("caption_pairs", caption_pairs),
                        ("layout_aux", layout_aux), ("mirror_pairs", mirror_pairs),
                        ("shift_consistency", shift_consistency), ("detector_aux", detector_aux),
                        ("absolute_pairs", absolute_pairs),
                        ("relation_start", relation_start)):
        if value is not None:
            setattr(recipe, name, value)
    if task_weight:
        recipe.task_weights = model.task_weights(task_weight, recipe.task_weights)
    if width is not None:  # a wider model has more heads of the same size (validated with the recipe)
        recipe.arch = preference.Arch(width=width, heads=width // preference.HEAD_DIM)
    if patch is not None:
        recipe.arch = dataclasses.replace(recipe.arch, patch=patch)
    if workers < 0:
        raise InputError(f"--workers {workers} must be >= 0", "e.g. --workers 1 (one core renders, one trains)")
    preference.train(out, recipe, max_minutes=max_minutes, workers=workers)


def _positive_minutes(max_minutes: float | None) -> None:
    """--max-minutes 0 would stop before the first step and exit 0 having trained nothing."""
    if max_minutes is not None and not max_minutes > 0:
        raise InputError(f"--max-minutes {max_minutes} must be a positive number of minutes",
                         "e.g. --max-minutes 30 (rerun the same command to continue), or leave it out")


def _new_file(out: Path, overwrite: bool) -> None:
    """A command writing one file never replaces an existing one (a shipped prompt set ...) unasked."""

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


def _version(value: bool) -> None:
    if value:
        from tpkit import __version__

        print(f"tpkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print tpkit's version and exit.")) -> None:
    pass  # the app's help is the Typer(help=...) above; this callback only adds --version


def main(argv: list[str] | None = None) -> None:
    """The `tpkit` entry point: `app` with tpkit's errors, usage errors and crashes in one or two lines
    (`--debug` anywhere: the traceback instead) and `--threads N` taken first."""
    cli_errors.run(app, sys.argv[1:] if argv is None else argv)  # exits unless the command succeeded
    from tpkit import runtime

    runtime.close_distributed()


if __name__ == "__main__":
    main()
