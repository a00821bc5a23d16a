"""Loading pretrained models by hub id or local folder, failing fast and clearly when offline.

`from_pretrained` of a hub id that is not cached retries the network for about a minute before
it gives up; on a cluster node without internet that is a minute per model, then a long
traceback. `load` tries the local folder or cache first, checks in a second whether the hub can
be reached at all, and otherwise raises a ModelError that says what to download.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from tpkit.errors import ModelError


def hub_reachable(timeout: float = 2.0) -> bool:
    """Can we open a TCP connection to the hub endpoint? False at once when offline mode is set."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def empty_tokenizers(obj: Any) -> list[str]:
    """The tokenizers of obj (itself, a processor's or a pipeline's) that hold no vocabulary: transformers 5
    builds such a tokenizer, without an error, when its vocabulary files are missing, and every prompt
    then encodes to unknown tokens."""
    empty = []
    for name in ("", "tokenizer", "tokenizer_2", "tokenizer_3"):
        tok = getattr(obj, name, None) if name else obj
        if tok is not None and hasattr(tok, "vocab_size") and hasattr(tok, "all_special_tokens"):
            if tok.vocab_size <= len(set(tok.all_special_tokens)):
                empty.append(name or type(tok).__name__)
    return empty


def load(loader: Callable[..., Any], id_or_path: str, what: str, fix: str, **kwargs) -> Any:
    """loader(id_or_path, **kwargs), e.g. CLIPModel.from_pretrained, with a clear error.

    what: e.g. "PickScore model"; fix: how to point tpkit at a local copy, e.g.
    "--reward-opt pickscore.model=PATH". A result whose tokenizer came out empty is refused.
    """
    download = f"download it with `hf download {id_or_path}` (or copy the folder here) and rerun, or {fix}"

    def checked(obj, hint: str = download):
        if empty := empty_tokenizers(obj):
            raise ModelError(f"{what} {id_or_path!r}: {', '.join(empty)} has no vocabulary (its vocabulary files are "
                             "missing)", hint)
        return obj

    if Path(id_or_path).exists():
        try:
            return checked(loader(id_or_path, **kwargs), f"copy the complete folder there, or {fix}")
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot load {what} from {id_or_path}: {_first_line(e)}", fix) from None
    try:
        found = loader(id_or_path, local_files_only=True, **kwargs)  # already in the HF cache
    except (OSError, ValueError):
        found = None
    if found is not None and not empty_tokenizers(found):
        return found
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", id_or_path):
        raise ModelError(f"{what} {id_or_path!r}: no such folder, and not a hub id (org/name)", fix)
    if not hub_reachable():
        raise ModelError(f"{what} {id_or_path!r} is not downloaded and the hub cannot be reached", download)
    try:
        return checked(loader(id_or_path, **kwargs))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load {what} {id_or_path!r}: {_first_line(e)}", download) from None


def file(spec: str, what: str, fix: str, source: str = "") -> Path:
    """A local file, or 'repo_id:filename' from the hub (cache first, failing fast offline).

    what: e.g. "aesthetic head"; fix: how to point tpkit at a local copy; source: where else the
    file can be had (appended to the download hint)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    repo, sep, filename = spec.partition(":")
    if not sep or not filename or "/" not in repo or path.exists():
        raise ModelError(f"{what} {spec!r}: not a file, and not repo_id:filename", fix)
    from huggingface_hub import hf_hub_download

    download = f"download it with `hf download {repo} {filename}` and rerun{source}, or {fix}"
    try:
        return Path(hf_hub_download(repo, filename, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError and friends)
        pass
    if not hub_reachable():
        raise ModelError(f"{what} {spec!r} is not downloaded and the hub cannot be reached", download)
    try:
        return Path(hf_hub_download(repo, filename))
    except Exception as e:
        raise ModelError(f"cannot download {what} {spec!r}: {_first_line(e)}", download) from None


def state_dict(path: Path, what: str, fix: str) -> dict:
    """The tensors of a .safetensors or torch file (never unpickling code; a {"state_dict": ...}
    wrapper is unwrapped), or a ModelError naming the file."""
    import torch

    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelError(f"cannot read {what} {path}: {type(e).__name__}: {str(e)[:200]}", fix) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ModelError(f"{what} {path} is not a state dict", fix)
    return state
