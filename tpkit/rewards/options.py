"""What every built-in reward shares: its type, and its options checked against its defaults.

Reward models run on `tpkit.runtime.pick_device("auto")`: this process's GPU if there is one, else the CPU."""

from __future__ import annotations

from typing import Callable

from tpkit.errors import RewardError

# images (PIL RGB), prompts (str), metadata (the prompt-file objects) -> one float per image
RewardFn = Callable[[list, list, list], list]


def take_options(reward: str, options: dict, defaults: dict) -> dict:
    """The reward's options over its defaults; an unknown option is an error naming the valid ones."""
    unknown = set(options) - set(defaults)
    if unknown:
        raise RewardError(f"reward {reward!r} has no option {sorted(unknown)[0]!r}",
                          f"valid options: {', '.join(sorted(defaults)) or 'none'}")
    return {**defaults, **options}
