"""The `ocr` reward: does the image spell the text the prompt asks for?

As Flow-GRPO's OCR reward, with its PaddleOCR swapped for `rapidocr` on `onnxruntime` (the PP-OCR
weights ship inside the rapidocr wheel, so it runs fully offline, on the CPU) and the GPL
`Levenshtein` package for the MIT `rapidfuzz`:

    target     = the text between the first pair of double quotes in the prompt
    recognised = the text of every detected line (confidence >= min_confidence), joined
    both with all whitespace removed and lower-cased, then
    reward     = 1                                              if target is a substring of recognised
               = 1 - min(levenshtein(recognised, target), len(target)) / len(target)   otherwise

so it lies in [0, 1]: 1 for the exact text (anywhere in the image), 0 when nothing is read (the
distance is then len(target)), and in between for near misses. Quirks kept from Flow-GRPO:

- the distance is to *everything* read, so extra text elsewhere in the image costs reward unless the
  target appears verbatim in it (then it is a substring and scores 1);
- lines are joined with nothing between them (in the engine's top-to-bottom, left-to-right order), so a
  target broken over two lines still matches;
- the distance is clipped at len(target): a long wrong text scores 0, never below;
- only the first quoted span counts; `A "red" sign that says "OPEN"` targets "red";
- boxes read with confidence below 0.5 are dropped (PaddleOCR's default `drop_score`, which Flow-GRPO
  inherited; here the `min_confidence` option).

Where this differs, on purpose:

- curly quotes “...” are accepted when the prompt has no straight pair (straight quotes win when both
  occur, so any prompt Flow-GRPO handles gives the same target);
- all whitespace is removed, not just ASCII spaces;
- a prompt with no quoted text, or an empty one (`""`), raises RewardError (Flow-GRPO crashes with an
  IndexError / ZeroDivisionError): it is a bug in the prompt file, better seen at once;
- engine failures are not swallowed into a 0 reward (Flow-GRPO printed them and scored 0);
- images are handed to the engine in the right channel order (Flow-GRPO passed RGB arrays to an engine
  expecting BGR); no text-direction classifier, as Flow-GRPO (`cls=False`).

The engine (text detector + recogniser) is built once, by the factory; it reads one image per call
(the recogniser batches the lines of an image), about 0.5 s for a 512 px image on two CPU cores.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from tpkit.errors import ModelError, RewardError
from tpkit.rewards.options import RewardFn, take_options

DEFAULTS = {
    # recognised lines with a lower confidence are dropped (PaddleOCR's drop_score; 0 keeps all)
    "min_confidence": 0.5,
    # onnxruntime threads per inference; 0 = onnxruntime's choice (all physical cores)
    "threads": 0,
}

_STRAIGHT = re.compile(r'"([^"]*)"')
_CURLY = re.compile(r"“([^”]*)”")


def quoted_text(prompt: str) -> str | None:
    """The text between the first pair of straight double quotes, else of curly ones “ ”; None if neither."""
    m = _STRAIGHT.search(prompt) or _CURLY.search(prompt)
    return m.group(1) if m else None


def normalise(text: str) -> str:
    """All whitespace removed, lower-cased: how both sides are compared."""
    return "".join(text.split()).lower()


def ocr_reward_value(recognised: str, target: str) -> float:
    """The reward of already-normalised texts (target non-empty); see the module docstring."""
    from rapidfuzz.distance import Levenshtein

    if target in recognised:
        return 1.0
    dist = min(Levenshtein.distance(recognised, target), len(target))
    return 1.0 - dist / len(target)


def check_inputs(prompts: list[str], metadata: list) -> None:
    """Every prompt quotes the text to render: checked by the score stage and `tpkit run` before any image
    is made, and by the reward itself on every call."""
    _targets(prompts)


def _targets(prompts: list[str]) -> list[str]:
    out = []
    for prompt in prompts:
        text = quoted_text(prompt)
        if text is None:
            raise RewardError(f"ocr: prompt {prompt!r} has no quoted text",
                              'the ocr reward needs the text to render in double quotes, e.g. A sign that says "OPEN"')
        target = normalise(text)
        if not target:
            raise RewardError(f"ocr: prompt {prompt!r} quotes an empty text",
                              "put the text the image should show between the quotes")
        out.append(target)
    return out


def _wheel_models(rapidocr_mod) -> tuple[Path, Path]:
    """The detector and recogniser .onnx files inside the rapidocr wheel (never downloaded)."""
    models = Path(rapidocr_mod.__file__).resolve().parent / "models"
    fix = "reinstall the engine with its bundled weights: pip install --force-reinstall 'tpkit[ocr]'"
    found = {}
    for task in ("det", "rec"):
        # the file rapidocr's own default config names, if this version exposes how it picks it ...
        path = None
        try:
            from rapidocr.inference_engine.base import FileInfo, InferSession
            from rapidocr.main import DEFAULT_CFG_PATH
            from rapidocr.utils.parse_parameters import ParseParams

            section = ParseParams.load(DEFAULT_CFG_PATH)[task.capitalize()]
            info = InferSession.get_model_url(FileInfo(section.engine_type, section.ocr_version, section.task_type,
                                                       section.lang_type, section.model_type))
            path = models / Path(str(info["model_dir"])).name
        except Exception:
            path = None
        # ... else the one such file shipped
        if path is None or not path.is_file():
            candidates = sorted(p for p in models.glob("*.onnx") if f"_{task}" in p.name.lower())
            path = candidates[0] if len(candidates) == 1 else None
        if path is None:
            raise ModelError(f"ocr: no single text-{task} model (.onnx) in the rapidocr wheel ({models})", fix)
        found[task] = path
    return found["det"], found["rec"]


def ocr_files(options: dict) -> list[tuple]:
    """What ocr loads (see registry.REQUIREMENTS): the PP-OCR models in the rapidocr wheel (no option moves them)."""
    import rapidocr

    det, rec = _wheel_models(rapidocr)
    return [("text detector", str(det), "file", None), ("text recogniser", str(rec), "file", None)]


def ocr(options: dict) -> RewardFn:
    opts = take_options("ocr", options, DEFAULTS)
    try:
        min_conf = float(opts["min_confidence"])
        threads = int(opts["threads"])
    except (TypeError, ValueError):
        raise RewardError(f"ocr: bad option values {opts}", "min_confidence is a number in [0, 1], threads an integer >= 0") from None
    if not 0.0 <= min_conf <= 1.0:
        raise RewardError(f"ocr: min_confidence {min_conf} is outside [0, 1]", "use e.g. --reward-opt ocr.min_confidence=0.5")
    if threads < 0:
        raise RewardError(f"ocr: threads {threads} is negative", "use 0 (onnxruntime's choice) or a positive count")

    try:
        import onnxruntime  # noqa: F401
        import rapidfuzz  # noqa: F401
        import rapidocr
    except ImportError as e:
        raise ModelError(f"the ocr reward needs rapidocr, onnxruntime and rapidfuzz ({e})", "pip install 'tpkit[ocr]'") from None

    det, rec = _wheel_models(rapidocr)
    params = {
        "Global.use_cls": False,            # no 180-degree classifier, as Flow-GRPO (cls=False)
        "Global.text_score": 0.0,           # min_confidence is applied below, on the raw scores
        "Global.log_level": "error",        # not a line per image ("Using ...", "detection result is empty")
        "Det.engine_type": rapidocr.EngineType.ONNXRUNTIME,
        "Rec.engine_type": rapidocr.EngineType.ONNXRUNTIME,
        "Det.model_path": str(det),         # explicit paths: rapidocr then never looks for a download
        "Rec.model_path": str(rec),
        "EngineConfig.onnxruntime.use_cuda": False,
        "EngineConfig.onnxruntime.use_dml": False,
        "EngineConfig.onnxruntime.use_cann": False,
        "EngineConfig.onnxruntime.use_coreml": False,
        "EngineConfig.onnxruntime.intra_op_num_threads": threads or -1,
    }
    try:
        engine = rapidocr.RapidOCR(params=params)
        # rapidocr loads its models on first use; load them now, so a broken install fails at start-up
        for load in ("_load_det_model", "_load_rec_model"):
            if hasattr(engine, load):
                getattr(engine, load)()
    except Exception as e:
        raise ModelError(f"ocr: cannot load the rapidocr engine from {det.parent}: {type(e).__name__}: {e}",
                         "pip install --force-reinstall 'tpkit[ocr]'") from None

    lock = threading.Lock()  # one image at a time through the shared engine (it is not documented thread-safe)

    def read(image) -> str:
        """The normalised text the engine reads in one PIL image ('' when none)."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        with lock:
            result = engine(image)
        txts = getattr(result, "txts", None) or ()
        scores = getattr(result, "scores", None) or ()
        return normalise("".join(t for t, s in zip(txts, scores) if s >= min_conf))

    def score(images, prompts, metadata):
        targets = _targets(list(prompts))  # a bad prompt fails before any OCR work
        return [ocr_reward_value(read(im), target) for im, target in zip(images, targets)]

    score.read = read  # the recognised text, for tests and debugging
    return score
