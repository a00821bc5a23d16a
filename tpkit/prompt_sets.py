"""The prompt sets tpkit ships in the checkout's `data/` folder, declared once (`tpkit prompts list`).

A test holds this table and the folder together: every file in data/ is listed here with its number
of prompts, and every listed file exists. The sets are plain files, not package data: recipes name them by
path (`prompts = "../data/pickscore-sfw-train.txt"`), and the generated ones can be rewritten from an
installed tpkit with the command in `how`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"  # the checkout's data/ (absent in a wheel install)

_RELEASE = "the TP-GRPO release (YunzeTong/TurningPoint-GRPO @ 994d26a, MIT, data/LICENSE-tpgrpo-prompts)"


@dataclass(frozen=True)
class PromptSet:
    file: str  # in data/
    prompts: int  # non-empty lines
    what: str
    how: str  # where it comes from, or the command that writes it


SHIPPED: tuple[PromptSet, ...] = (
    PromptSet("pickscore-sfw-train.txt", 15486,
              "Pick-a-Pic v1 captions, SFW-filtered (CarperAI), unique, >= 6 words: the PickScore task's training prompts",
              f"copied unchanged from {_RELEASE}: dataset/pickscore_sfw/train.txt"),
    PromptSet("pickscore-sfw-test.txt", 1024, "the held-out split of the same captions: PickScore evaluation",
              f"copied unchanged from {_RELEASE}: dataset/pickscore_sfw/test.txt"),
    PromptSet("ocr-test.txt", 1018, "the OCR task's evaluation prompts (text to render in double quotes)",
              f"copied unchanged from {_RELEASE}: dataset/ocr/test.txt"),
    PromptSet("ocr-prompts.txt", 48,
              "OCR training prompts written for tpkit (the release does not distribute its OCR training set)",
              "hand-written; none is in ocr-test.txt"),
    PromptSet("geneval-train.jsonl", 960, "GenEval-style metadata, none of it in GenEval's 553 test prompts",
              "tpkit prompts geneval --split train --n 200 --out data/geneval-train.jsonl"),
    PromptSet("geneval-style.jsonl", 60, "60 prompts of GenEval's format (10 per task) for tests and demos",
              "written for tpkit; overlaps GenEval's test set, never train on it"),
    PromptSet("shapes-train.jsonl", 480, "tiny-shapes testbed, RL training prompts (6 tasks x 80)",
              "tpkit prompts shapes --split train"),
    PromptSet("shapes-test.jsonl", 96, "tiny-shapes testbed, held-out prompts (6 tasks x 16), disjoint from train",
              "tpkit prompts shapes --split test"),
    PromptSet("tiny-prompts.txt", 8, "eight prompts for the tiny-cpu demo and tests", "hand-written"),
)
