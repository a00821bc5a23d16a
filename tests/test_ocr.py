"""The `ocr` reward with its real PP-OCR weights (shipped in the rapidocr wheel): fully offline, CPU.

Images are rendered here with PIL (DejaVu Sans where installed), clean and slightly blurred.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFilter, ImageFont

pytest.importorskip("rapidocr", reason="needs the ocr extra: pip install 'tpkit[ocr]'")
pytest.importorskip("onnxruntime", reason="needs the ocr extra: pip install 'tpkit[ocr]'")
pytest.importorskip("rapidfuzz", reason="needs the ocr extra: pip install 'tpkit[ocr]'")

from rapidfuzz.distance import Levenshtein  # noqa: E402

from tpkit.errors import ModelError, RewardError  # noqa: E402
from tpkit.rewards.ocr import normalise, ocr, quoted_text  # noqa: E402
from tpkit.rewards.registry import load_rewards, score_images  # noqa: E402

DEJAVU = Path("/usr/share/fonts/truetype/dejavu")


def font(size: int, name: str = "DejaVuSans.ttf"):
    path = DEJAVU / name
    return ImageFont.truetype(str(path), size) if path.is_file() else ImageFont.load_default(size)


def render(lines: list[str], size: int = 512, px: int = 56, blur: bool = False, name: str = "DejaVuSans.ttf") -> Image.Image:
    """Dark text lines, centred, on a light 512 x 512 background."""
    im = Image.new("RGB", (size, size), (245, 240, 228))
    draw = ImageDraw.Draw(im)
    f = font(px, name)
    gap = int(px * 1.4)
    top = (size - gap * len(lines)) // 2
    for i, line in enumerate(lines):
        x0, y0, x1, y1 = draw.textbbox((0, 0), line, font=f)
        draw.text(((size - (x1 - x0)) // 2 - x0, top + i * gap), line, fill=(25, 25, 35), font=f)
    return im.filter(ImageFilter.GaussianBlur(1)) if blur else im


@pytest.fixture(scope="module")
def reward():
    return ocr({})


@pytest.fixture(scope="module")
def hello():
    return render(["Hello World"])


def one(fn, image, prompt) -> float:
    return fn([image], [prompt], [{}])[0]


# --- the reward on real images -------------------------------------------------------------------

@pytest.mark.parametrize("blur", [False, True], ids=["clean", "blurred"])
@pytest.mark.parametrize("text,name", [("Hello World", "DejaVuSans.ttf"),
                                        ("OPEN 24 HOURS", "DejaVuSans-Bold.ttf"),
                                        ("Fresh Coffee", "DejaVuSerif.ttf")])
def test_rendered_text_scores_one_against_its_own_text(reward, text, name, blur):
    assert one(reward, render([text], blur=blur, name=name), f'A sign that says "{text}"') == 1.0


@pytest.mark.parametrize("asked", ["Hello Wordl", "Hello Worlds", "Hallo Welt"])
def test_partial_match_is_in_between_and_follows_the_formula(reward, hello, asked):
    value = one(reward, hello, f'A sign that says "{asked}"')
    read = reward.read(hello)
    target = normalise(asked)
    assert read and target not in read
    assert 0.0 < value < 1.0
    expected = 1 - min(Levenshtein.distance(read, target), len(target)) / len(target)
    assert value == pytest.approx(expected)
    if read == "helloworld" and asked == "Hello Wordl":
        assert value == pytest.approx(0.8)  # two substitutions in ten letters


def test_blank_image_scores_zero(reward):
    blank = Image.new("RGB", (512, 512), (245, 240, 228))
    assert reward.read(blank) == ""
    assert one(reward, blank, 'A sign that says "Hello World"') == 0.0


def test_case_and_spaces_are_ignored(reward, hello):
    assert one(reward, hello, 'a sign that says "hELLO   wORLD"') == 1.0
    assert one(reward, hello, 'a sign that says "HelloWorld"') == 1.0


def test_target_as_a_substring_and_over_two_lines(reward):
    assert one(reward, render(["Welcome to Paris"], px=44), 'a banner with "Paris"') == 1.0
    assert one(reward, render(["Hello", "World"]), 'a sign that says "Hello World"') == 1.0


def test_curly_quotes(reward, hello):
    assert one(reward, hello, "A sign that says “Hello World”") == 1.0


def test_a_batch_through_load_rewards_and_score_images(hello):
    rewards = load_rewards({"ocr": 2.0})
    blank = Image.new("RGB", (512, 512), "white")
    prompts = ['a sign that says "Hello World"', 'a sign that says "Hello World"']
    cols = score_images(rewards, [hello, blank], prompts, [{}, {}])
    assert cols["reward_ocr"] == [1.0, 0.0]
    assert cols["reward"] == [2.0, 0.0]


def test_a_prompt_without_quotes_is_an_error(reward, hello):
    with pytest.raises(RewardError, match="no quoted text") as e:
        one(reward, hello, "a sign that says Hello World")
    assert "a sign that says Hello World" in str(e.value)
    with pytest.raises(RewardError, match="no quoted text"):  # through score_images too, not wrapped
        score_images(load_rewards({"ocr": 1.0}), [hello], ['one "quote only'], [{}])
    with pytest.raises(RewardError, match="empty"):
        one(reward, hello, 'a sign that says ""')


def test_never_touches_the_network(monkeypatch, hello):
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] or kwargs)
        raise OSError("network access attempted by the ocr reward")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    fn = ocr({"threads": 1})
    assert one(fn, render(["Hello World"], blur=True), 'a sign that says "Hello World"') == 1.0
    assert one(fn, Image.new("RGB", (256, 256), "white"), 'a sign that says "Hello World"') == 0.0
    assert attempts == []


# --- no engine needed ----------------------------------------------------------------------------

def test_quoted_text():
    assert quoted_text('A sign that says "Hello World" in neon') == "Hello World"
    assert quoted_text('A "red" sign that says "OPEN"') == "red"  # the first pair, as Flow-GRPO
    assert quoted_text("A sign that says “Hello”") == "Hello"
    assert quoted_text('A “fancy” sign that says "OPEN"') == "OPEN"  # straight quotes win, as Flow-GRPO
    assert quoted_text("no quotes") is None
    assert quoted_text('one " quote') is None
    assert normalise(" Hello\tWorld\u00a0! ") == "helloworld!"


def test_bad_options_fail_before_loading():
    with pytest.raises(RewardError, match="no option 'lang'"):
        ocr({"lang": "en"})
    with pytest.raises(RewardError, match="min_confidence"):
        ocr({"min_confidence": 1.5})
    with pytest.raises(RewardError, match="threads"):
        ocr({"threads": -2})


def test_missing_engine_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr", None)  # import rapidocr -> ImportError
    with pytest.raises(ModelError) as e:
        ocr({})
    assert "pip install 'tpkit[ocr]'" in str(e.value)
