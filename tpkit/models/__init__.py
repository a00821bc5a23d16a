"""Model families: one module each, behind one small interface, named in one plain dict.

A family module declares
  NAME, MODEL (its `base.Model` subclass: PIPELINE, TRANSFORMER and VAE class names), DEFAULTS (resolution, guidance, text_length, lora_targets,
  lora_targets_optional, sizes for doctor's estimates), BUILTIN (built-in model name -> overrides of
  DEFAULTS), PUBLISHED (hub id -> transformer and VAE configs, text encoders' parameters: memory
  estimates and benchmarks without the weights), location(model) -> a built-in model's folder or None,
  resolve(model) -> a folder or hub
  id (building a built-in one), load(model, **base.load options) -> a `base.Model`,
and MODEL implements sigmas(steps, resolution), encode(prompts, text_length),
velocity(x, sigma, embeds, guidance[, transformer]), forwards(guidance), channels() and
placeholder_embeds(...) (the shapes of `encode`'s dict); decoding (an AutoencoderKL's unless the family
overrides `decode_latents` and `vae_factor`), the reference context (adapters off), LoRA, packing and
the dynamic-shift schedule, and the one-pipeline cache are shared (`base`).
Stages take the family from the model name (`family_of`) once, at rollout, record it in shard
metadata and manifests, and read it back from there. Adding a family = one module + one line below.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

from tpkit import layout
from tpkit.errors import InputError, ModelError

FAMILIES = {"sd3": "tpkit.models.sd3", "flux": "tpkit.models.flux", "qwen-image": "tpkit.models.qwen_image"}


def family(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise ModelError(f"unknown model family {name!r}", f"use one of {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[name])


def _pipeline_class(model: str) -> str | None:
    """The `_class_name` of a folder's (or the hub cache's) model_index.json, if there is one."""
    index = Path(model).expanduser() / "model_index.json"
    if not index.is_file() and not Path(model).expanduser().exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "model_index.json")
            index = Path(cached) if isinstance(cached, str) else index
        except Exception:  # not a repo id, no cache: decide by name below
            pass
    try:
        return json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError):
        return None


def known_family(model: str) -> str | None:
    """The family a model certainly is: a built-in name's, else its folder's (or cached hub model's)
    pipeline class's; None where only the name can tell."""
    mods = {n: family(n) for n in FAMILIES}
    for n, m in mods.items():
        if model in m.BUILTIN:
            return n
    cls = _pipeline_class(model)
    if cls:
        for n, m in mods.items():
            if m.MODEL.PIPELINE == cls:
                return n
        raise ModelError(f"{model} is a {cls}; tpkit trains " + ", ".join(m.MODEL.PIPELINE for m in mods.values()),
                         "pass a Stable Diffusion 3 / 3.5, FLUX.1 or Qwen-Image model")
    return None


def family_of(model: str) -> str:
    """Which family a model is: `known_family`, else its name (FLUX and Qwen-Image ids say so), else sd3."""
    name = model.lower()
    return known_family(model) or ("flux" if "flux" in name else "qwen-image" if "qwen-image" in name else "sd3")


def default(model: str, key: str, family_name: str | None = None):
    """A default that depends on the model: its family's, with a built-in model's own overrides."""
    m = family(family_name or family_of(model))
    return {**m.DEFAULTS, **m.BUILTIN.get(model, {})}[key]


def load(model: str, family_name: str | None = None, **kwargs):
    """Load a model of its family (`base.load`'s options: device, dtype, text_encoders, lora, vae, reuse, fuse_lora)."""
    return family(family_name or family_of(model)).load(model, **kwargs)


def builtin_models() -> dict[str, str]:
    """Built-in model name -> family."""
    return {name: n for n in FAMILIES for name in family(n).BUILTIN}


def recorded(settings: dict) -> str:
    """The family a rollout's config or trajectory metadata records (sd3 where it records none: folders
    written before tpkit had a second family)."""
    return settings.get("family") or "sd3"


def content_id(model: str) -> str | None:
    """What identifies a local model folder's weights (`layout.sampled_digest`), so that a model retrained
    in place is a new input; None for built-in names (versioned by tpkit) and hub ids (by their revision)."""
    folder = Path(model).expanduser()
    if any(model in family(n).BUILTIN for n in FAMILIES) or not folder.is_dir():
        return None
    return layout.pruned_digest(folder) or layout.sampled_digest(folder)  # a pruned round's model: what it was


def check_unchanged(rollout_manifest: dict, rollout_dir: Path) -> None:
    """A stage that runs the rollout's model again (score's branches, train) must find the weights the
    rollout sampled with: a local model folder retrained since would mix two models in one round."""
    model = rollout_manifest["config"]["model"]
    recorded = rollout_manifest.get("identity", {}).get("inputs", {}).get("model_sha256")
    if recorded and content_id(model) != recorded:
        raise InputError(f"{model}: its weights changed since `tpkit rollout` sampled {rollout_dir} with them",
                         "rerun `tpkit rollout` (and the stages after it) with --overwrite, or put the old weights back")
