"""Out of accelerator memory: each stage that batches work on the accelerator turns torch's
OutOfMemoryError into one line naming the batch-size option to lower (with a value to try), exits 2
without a traceback, keeps what it had written, and does not retry behind the user's back.

The error is injected where the stage's batched work runs (CPU torch raises the same exception
class as CUDA's allocator), on tiny-sd3.
"""

from __future__ import annotations

import pytest
import torch
from conftest import cli

from tpkit import evaluate, rollout, score, train

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total capacity)")


def _raise(*args, **kwargs):
    raise OOM


@pytest.mark.parametrize("stage, patch, option", [
    ("rollout", (rollout, "write_shard"), "rollout.batch_size = 8 (e.g. 4)"),
    ("score", (score.BranchScorer, "score_shard"), "score.batch_size = 16 (e.g. 8) or score.decode_batch_size = 8 (e.g. 4)"),
    ("train", (train, "_train"), "train.micro_batch_size = 8 (e.g. 4)"),
    ("eval", (evaluate, "generate"), "eval.batch_size = 8 (e.g. 4)"),
])
def test_out_of_memory_names_the_option_to_lower(stage, patch, option, tiny_run, two_prompts, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(*patch, _raise)
    out = tmp_path / stage
    argv = {
        "rollout": ["rollout", "--prompts", two_prompts, "--out", out, "--group-size", "2", "--batch-size", "8"],
        "score": ["score", tiny_run / "rollout", "--out", out],
        "train": ["train", "--rollout", tiny_run / "rollout", "--advantages", tiny_run / "advantages", "--out", out],
        "eval": ["eval", "reward", "--prompts", two_prompts, "--out", out, "--reward", "jpeg-compressibility",
                 "--images-per-prompt", "1"],
    }[stage]
    assert cli(*argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{stage} ran out of accelerator memory: CUDA out of memory. Tried to allocate 2.00 GiB" in err
    assert f"lower {option}" in err and "rerun to continue" in err
    assert "Traceback" not in err
    if stage == "train":  # the train batches were the rollout's (micro_batch_size 0), so checkpointing is named too
        assert "train.gradient_checkpointing = true" in err
