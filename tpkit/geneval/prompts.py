"""GenEval-style prompt sets: `tpkit prompts geneval`.

GenEval (Ghosh et al., 2023) evaluates compositional text-to-image generation on 553 template prompts
built from the 80 COCO classes. Its `prompts/create_prompts.py` draws them with NumPy's
`default_rng(43)`; this module redoes that procedure draw for draw, in pure Python, so that

    generate(seed=43, n=100) == official_like_test_set()

is, line for line and byte for byte once written as JSON lines, GenEval's `evaluation_metadata.jsonl`
(checked by tests/test_geneval_prompts.py against the official file when it is present; the official
file is not shipped here and not needed).

The procedure (GenEval's, reproduced here):

- 6 tags, drawn in this order from one random stream: `single_object` (every class once, in a random
  order), then `n` each of `two_object`, `counting`, `colors`, `position`, `color_attr`;
- classes are the 80 COCO classes in COCO order, spelled as GenEval spells them (`tv`, `computer mouse`,
  `tv remote`, `computer keyboard`, `hair drier`, ...);
- `two_object`: 2 distinct classes; `counting`: 1 class and a count 2..4, with an `exclude` clause of
  count + 1 (so "exactly n"); `colors`: 1 class (never `person`) and 1 of 10 colours; `position`:
  2 distinct classes and 1 of 4 relations, the related object second in `include` with
  `"position": [relation, 0]` (0 = index of the reference clause); `color_attr`: 2 distinct classes
  (never `person`) and 2 distinct colours;
- "a"/"an" by the first letter only (a, e, i, o, u: "an umbrella", "an orange");
- naive plurals: "es" after a final "s", else "s" ("skises", "sheeps", "knifes", "benchs",
  "wine glasses", "buses") -- reproduced on purpose, they are GenEval's prompts;
- exact duplicates are removed, first occurrence kept (100 per tag gives 553 = 80 + 99 + 80 + 94 +
  100 + 100 for seed 43).

Random numbers: GenEval uses `numpy.random.default_rng(seed)` = PCG64 seeded through SeedSequence, and
`Generator.choice` / `Generator.integers`. `_NumpyPCG64` below re-implements exactly the parts used
(SeedSequence hashing, PCG64 XSL-RR output with its 32-bit half buffer, Lemire's bounded integers,
Floyd's sampling without replacement followed by a Fisher-Yates shuffle), so the module needs no NumPy
and gives NumPy's numbers for any non-negative integer seed (tested against NumPy when installed).

Training prompts (`train_set`): as Flow-GRPO, which drew its GenEval training prompts with the same
GenEval script and removed every prompt of the test set, treating prompts that differ only in object
order ("a photo of A and B" / "a photo of B and A") as the same. Here the test of sameness is
`prompt_key`: order-free for `two_object` / `color_attr`, and `position` prompts also match their
mirror ("A left of B" == "B right of A", "A above B" == "B below A"). Since the test set holds all 80
`single_object` prompts, the training set has none; `counting` can give at most 240 - 80 = 160 and
`colors` 790 - 94 = 696 new prompts: larger requests are capped at what exists (`train_capacity`).

Only the standard library is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from tpkit.errors import ConfigError
from tpkit.layout import atomic_write

__all__ = [
    "CLASSES", "COLORS", "RELATIONS", "NUMBERS", "TAGS", "TEMPLATES", "GENEVAL_SEED", "GENEVAL_N",
    "DEFAULT_TRAIN_SEED", "DEFAULT_TRAIN_N", "with_article", "make_plural", "generate",
    "official_like_test_set", "train_set", "train_capacity", "prompt_key", "validate", "write_jsonl",
    "run",
]

# --------------------------------------------------------------------------------------------
# GenEval's vocabulary
# --------------------------------------------------------------------------------------------

#: The 80 COCO classes in COCO order, in GenEval's spelling (its `object_names.txt`). Order matters:
#: the random draws index into this tuple.
CLASSES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange",
    "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed",
    "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote", "computer keyboard",
    "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase",
    "scissors", "teddy bear", "hair drier", "toothbrush",
)

#: GenEval's 10 colours (also the colour classifier's labels).
COLORS: tuple[str, ...] = (
    "red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white",
)

#: GenEval's 4 relations; in a `position` clause `[relation, i]` reads "this object is <relation>
#: the objects of include[i]".
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")

#: Number words used by `counting` prompts (index = count).
NUMBERS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
)

#: The tags, in GenEval's drawing order.
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

#: Prompt templates per tag. Fields: {a} / {b} = class with its article ("an apple"), {obj} / {obj_b}
#: = bare class, {ca} / {cb} = colour with its article ("an orange"), {number} = number word,
#: {plural} = naive plural, {relation} = relation.
TEMPLATES: dict[str, str] = {
    "single_object": "a photo of {a}",
    "two_object": "a photo of {a} and {b}",
    "counting": "a photo of {number} {plural}",
    "colors": "a photo of {ca} {obj}",
    "position": "a photo of {a} {relation} {b}",
    "color_attr": "a photo of {ca} {obj} and {cb} {obj_b}",
}

GENEVAL_SEED = 43  #: create_prompts.py's default seed: it gives the official 553 prompts.
GENEVAL_N = 100  #: create_prompts.py's default number of draws per tag (single_object: all 80 classes).
MAX_COUNT = 4  #: counting prompts ask for 2..MAX_COUNT objects.
DEFAULT_TRAIN_SEED = 0
DEFAULT_TRAIN_N = 1000  #: per tag, capped at what exists outside the test set

_PERSON = CLASSES.index("person")
_INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def with_article(name: str) -> str:
    """GenEval's article rule: "an" before a, e, i, o, u (first letter only), else "a"."""
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def make_plural(name: str) -> str:
    """GenEval's naive plural: "es" after a final "s", else "s" ("skises", "sheeps", "knifes")."""
    return f"{name}es" if name.endswith("s") else f"{name}s"


# --------------------------------------------------------------------------------------------
# numpy.random.default_rng(seed), the parts GenEval uses, in pure Python
# --------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_M128 = (1 << 128) - 1
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645  # PCG's default 128-bit LCG multiplier


def _seed_sequence_state(seed: int, n_words64: int = 4) -> list[int]:
    """numpy.random.SeedSequence(seed).generate_state(n_words64, uint64) (pool size 4, no spawn key)."""
    entropy = []
    n = seed
    while True:  # little-endian 32-bit words; 0 -> [0]
        entropy.append(n & _M32)
        n >>= 32
        if n == 0:
            break
    hash_const = 0x43B0D7E5  # INIT_A

    def hashmix(value: int) -> int:
        nonlocal hash_const
        value ^= hash_const
        hash_const = (hash_const * 0x931E8875) & _M32  # MULT_A
        value = (value * hash_const) & _M32
        return value ^ (value >> 16)

    def mix(x: int, y: int) -> int:
        r = (0xCA01F9DD * x - 0x4973F715 * y) & _M32  # MIX_MULT_L, MIX_MULT_R
        return r ^ (r >> 16)

    pool = [hashmix(entropy[i] if i < len(entropy) else 0) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, len(entropy)):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))

    hash_b = 0x8B51F9DD  # INIT_B
    words32 = []
    for i in range(2 * n_words64):
        v = pool[i % 4] ^ hash_b
        hash_b = (hash_b * 0x58F38DED) & _M32  # MULT_B
        v = (v * hash_b) & _M32
        words32.append(v ^ (v >> 16))
    return [words32[2 * k] | (words32[2 * k + 1] << 32) for k in range(n_words64)]


class _NumpyPCG64:
    """numpy.random.default_rng(seed) for non-negative int seeds: PCG64 (XSL-RR 128/64), with the
    subset of Generator used by GenEval: `below(n)` = choice(n) = integers(0, n), `integers(lo, hi,
    endpoint)` (scalar int64), `sample(n, k)` = choice(n, size=k, replace=False) for n <= 10000."""

    def __init__(self, seed: int):
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        w = _seed_sequence_state(seed)
        initstate, initseq = (w[0] << 64) | w[1], (w[2] << 64) | w[3]
        self._inc = ((initseq << 1) | 1) & _M128
        self._state = 0
        self._step()
        self._state = (self._state + initstate) & _M128
        self._step()
        self._has32 = False
        self._buf32 = 0

    def _step(self) -> None:
        self._state = (self._state * _PCG_MULT + self._inc) & _M128

    def next64(self) -> int:
        self._step()
        s = self._state
        x = ((s >> 64) ^ s) & _M64
        rot = s >> 122
        return ((x >> rot) | (x << ((64 - rot) & 63))) & _M64

    def next32(self) -> int:
        if self._has32:  # the upper half of the previous 64-bit draw
            self._has32 = False
            return self._buf32
        v = self.next64()
        self._has32, self._buf32 = True, v >> 32
        return v & _M32

    def bounded(self, rng: int) -> int:
        """Uniform in [0, rng] (closed): NumPy's random_bounded_uint64, Lemire's rejection, unmasked."""
        if rng == 0:
            return 0
        if rng > _M32:  # never needed for GenEval's sizes
            raise NotImplementedError("ranges beyond 32 bits")
        if rng == _M32:
            return self.next32()
        excl = rng + 1
        m = self.next32() * excl
        leftover = m & _M32
        if leftover < excl:
            threshold = (_M32 - rng) % excl
            while leftover < threshold:
                m = self.next32() * excl
                leftover = m & _M32
        return m >> 32

    def below(self, n: int) -> int:
        """Generator.choice(n): uniform in [0, n)."""
        if n <= 0:
            raise ValueError("n must be positive")
        return self.bounded(n - 1)

    def integers(self, low: int, high: int, endpoint: bool = False) -> int:
        return low + self.bounded(high - low - (0 if endpoint else 1))

    def sample(self, n: int, k: int) -> list[int]:
        """Generator.choice(n, size=k, replace=False): Floyd's algorithm, then a shuffle."""
        if not 0 <= k <= n:
            raise ValueError("need 0 <= k <= n")
        if n > 10000:  # NumPy switches to a partial tail shuffle there; never needed here
            raise NotImplementedError("populations above 10000")
        out: list[int] = []
        seen: set[int] = set()
        for j in range(n - k, n):
            v = self.bounded(j)
            if v in seen:
                v = j
            seen.add(v)
            out.append(v)
        for i in range(k - 1, 0, -1):
            j = self.bounded(i)
            out[i], out[j] = out[j], out[i]
        return out


# --------------------------------------------------------------------------------------------
# One sample per tag, drawing exactly as GenEval does
# --------------------------------------------------------------------------------------------


def _single_object(i: int) -> dict[str, Any]:
    return {"tag": "single_object", "include": [{"class": CLASSES[i], "count": 1}],
            "prompt": TEMPLATES["single_object"].format(a=with_article(CLASSES[i]))}


def _two_object(rng: _NumpyPCG64) -> dict[str, Any]:
    a, b = rng.sample(len(CLASSES), 2)
    return {"tag": "two_object",
            "include": [{"class": CLASSES[a], "count": 1}, {"class": CLASSES[b], "count": 1}],
            "prompt": TEMPLATES["two_object"].format(a=with_article(CLASSES[a]), b=with_article(CLASSES[b]))}


def _counting(rng: _NumpyPCG64, max_count: int = MAX_COUNT) -> dict[str, Any]:
    i = rng.below(len(CLASSES))
    num = rng.integers(2, max_count, endpoint=True)
    return {"tag": "counting", "include": [{"class": CLASSES[i], "count": num}],
            "exclude": [{"class": CLASSES[i], "count": num + 1}],
            "prompt": TEMPLATES["counting"].format(number=NUMBERS[num], plural=make_plural(CLASSES[i]))}


def _not_person(rng_value: int) -> int:
    """GenEval's trick: draw in [1, 80) and offset from "person", so colour prompts never name one."""
    return (rng_value + 1 + _PERSON) % len(CLASSES)


def _colors(rng: _NumpyPCG64) -> dict[str, Any]:
    i = _not_person(rng.below(len(CLASSES) - 1))
    color = COLORS[rng.below(len(COLORS))]
    return {"tag": "colors", "include": [{"class": CLASSES[i], "count": 1, "color": color}],
            "prompt": TEMPLATES["colors"].format(ca=with_article(color), obj=CLASSES[i])}


def _position(rng: _NumpyPCG64) -> dict[str, Any]:
    a, b = rng.sample(len(CLASSES), 2)
    relation = RELATIONS[rng.below(len(RELATIONS))]
    return {"tag": "position",
            "include": [{"class": CLASSES[b], "count": 1},
                        {"class": CLASSES[a], "count": 1, "position": [relation, 0]}],
            "prompt": TEMPLATES["position"].format(a=with_article(CLASSES[a]), relation=relation,
                                                   b=with_article(CLASSES[b]))}


def _color_attr(rng: _NumpyPCG64) -> dict[str, Any]:
    a, b = (_not_person(v) for v in rng.sample(len(CLASSES) - 1, 2))
    ca, cb = (COLORS[v] for v in rng.sample(len(COLORS), 2))
    return {"tag": "color_attr",
            "include": [{"class": CLASSES[a], "count": 1, "color": ca},
                        {"class": CLASSES[b], "count": 1, "color": cb}],
            "prompt": TEMPLATES["color_attr"].format(ca=with_article(ca), obj=CLASSES[a],
                                                     cb=with_article(cb), obj_b=CLASSES[b])}


_DRAW = {"two_object": _two_object, "counting": _counting, "colors": _colors, "position": _position,
         "color_attr": _color_attr}


def _exact_key(item: Mapping[str, Any]) -> str:
    return json.dumps(item, sort_keys=True)


# --------------------------------------------------------------------------------------------
# Test set (GenEval's procedure) and training set (Flow-GRPO's: same procedure, test prompts removed)
# --------------------------------------------------------------------------------------------


def _check_counts(counts: Mapping[str, int]) -> None:
    for tag, k in counts.items():
        if tag not in TAGS:
            raise ConfigError(f"unknown GenEval tag {tag!r}", f"use one of {', '.join(TAGS)}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError(f"count for {tag} must be a non-negative integer, got {k!r}")


def generate(seed: int = GENEVAL_SEED, n: int = GENEVAL_N, *, counts: Mapping[str, int] | None = None,
             max_count: int = MAX_COUNT, dedupe: bool = True) -> list[dict[str, Any]]:
    """GenEval's create_prompts.py: `n` draws per tag (single_object: every class once, shuffled),
    tags drawn in `TAGS` order from `default_rng(seed)`, then exact duplicates dropped (first kept).

    `counts` overrides the number of draws per tag (e.g. {"single_object": 0, "position": 500});
    single_object is capped at the 80 classes. generate() with its defaults is the official set.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"n must be a non-negative integer, got {n!r}")
    if not 2 <= max_count < len(NUMBERS):
        raise ConfigError(f"max_count must be in 2..{len(NUMBERS) - 1}, got {max_count!r}")
    per_tag = {"single_object": len(CLASSES), **{t: n for t in TAGS[1:]}}
    if counts:
        _check_counts(counts)
        per_tag.update(counts)
    rng = _NumpyPCG64(seed)
    items = [_single_object(i) for i in rng.sample(len(CLASSES), min(per_tag["single_object"], len(CLASSES)))]
    for tag in TAGS[1:]:
        draw = _DRAW[tag]
        for _ in range(per_tag[tag]):
            items.append(draw(rng, max_count) if tag == "counting" else draw(rng))
    if not dedupe:
        return items
    seen: set[str] = set()
    unique = []
    for item in items:
        key = _exact_key(item)
        if key not in seen:
            seen.add(key)
            unique.append(item)
    return unique


def official_like_test_set() -> list[dict[str, Any]]:
    """GenEval's evaluation set, regenerated: the 553 prompts of its `evaluation_metadata.jsonl`, in
    its order (seed 43, 100 draws per tag)."""
    return generate(GENEVAL_SEED, GENEVAL_N)


def prompt_key(item: Mapping[str, Any]) -> tuple:
    """What makes two GenEval prompts the same, for keeping training prompts out of a test set: the
    tag and its clauses, ignoring clause order, with `position` prompts equal to their mirror image
    ("A left of B" == "B right of A")."""
    tag = item["tag"]
    include = item["include"]
    if tag == "position":
        ref, obj = include[0], include[1]
        relation, _ = obj["position"]
        a = (obj["class"], obj["count"], obj.get("color"))
        b = (ref["class"], ref["count"], ref.get("color"))
        return (tag, min((a, relation, b), (b, _INVERSE[relation], a)))
    clauses = tuple(sorted(_exact_key(c) for c in include))
    excl = tuple(sorted(_exact_key(c) for c in item.get("exclude", ())))
    return (tag, clauses, excl)


def train_capacity(tag: str, exclude: Iterable[Mapping[str, Any]] = (), max_count: int = MAX_COUNT) -> int:
    """How many distinct prompts (by `prompt_key`) GenEval's procedure can make for `tag`, minus
    those of `exclude`."""
    n_cls, n_col = len(CLASSES), len(COLORS)
    total = {
        "single_object": n_cls,
        "two_object": n_cls * (n_cls - 1) // 2,
        "counting": n_cls * (max_count - 1),
        "colors": (n_cls - 1) * n_col,
        "position": n_cls * (n_cls - 1) * len(RELATIONS) // 2,
        "color_attr": (n_cls - 1) * (n_cls - 2) * n_col * (n_col - 1) // 2,
    }[tag]
    taken = {prompt_key(it) for it in exclude if it["tag"] == tag}
    return total - len(taken)


def train_set(seed: int = DEFAULT_TRAIN_SEED, n_per_tag: int = DEFAULT_TRAIN_N, *,
              exclude: Iterable[Mapping[str, Any]] | None = None, tags: Iterable[str] = TAGS,
              max_count: int = MAX_COUNT) -> list[dict[str, Any]]:
    """Training prompts as Flow-GRPO made its GenEval ones: GenEval's samplers, one `default_rng(seed)`
    stream, tags in `TAGS` order, each draw kept only if no prompt with the same `prompt_key` is in
    `exclude` (default: the official test set) or already kept, until `n_per_tag` per tag -- capped at
    `train_capacity(tag, exclude)` (single_object: 0 against the official test set; counting: 160;
    colors: 696). single_object draws one class at a time here.
    """
    if not isinstance(n_per_tag, int) or isinstance(n_per_tag, bool) or n_per_tag < 0:
        raise ConfigError(f"n_per_tag must be a non-negative integer, got {n_per_tag!r}")
    tags = list(tags)
    _check_counts({t: 0 for t in tags})
    excluded = list(official_like_test_set() if exclude is None else exclude)
    taken = {prompt_key(it) for it in excluded}
    rng = _NumpyPCG64(seed)
    items: list[dict[str, Any]] = []
    for tag in TAGS:
        if tag not in tags:
            continue
        target = min(n_per_tag, train_capacity(tag, excluded, max_count))
        got = 0
        while got < target:
            if tag == "single_object":
                item = _single_object(rng.below(len(CLASSES)))
            elif tag == "counting":
                item = _counting(rng, max_count)
            else:
                item = _DRAW[tag](rng)
            key = prompt_key(item)
            if key in taken:
                continue
            taken.add(key)
            items.append(item)
            got += 1
    return items


# --------------------------------------------------------------------------------------------
# Validation and output
# --------------------------------------------------------------------------------------------


def validate(item: Mapping[str, Any]) -> None:
    """Raise ValueError unless `item` is a GenEval metadata object of the kind this module makes
    (and GenEval's evaluator reads): tag, include clauses with known classes / colours / relations,
    exclude for counting, a prompt matching the tag's template."""
    tag = item.get("tag")
    if tag not in TAGS:
        raise ValueError(f"unknown tag {tag!r}")
    include = item.get("include")
    if not isinstance(include, list) or not include:
        raise ValueError("include must be a non-empty list")
    for i, c in enumerate(include):
        if c.get("class") not in CLASSES:
            raise ValueError(f"unknown class {c.get('class')!r}")
        if not isinstance(c.get("count"), int) or c["count"] < 1:
            raise ValueError(f"bad count {c.get('count')!r}")
        if "color" in c and c["color"] not in COLORS:
            raise ValueError(f"unknown colour {c['color']!r}")
        if "position" in c:
            rel, group = c["position"]
            if rel not in RELATIONS or not isinstance(group, int) or not 0 <= group < len(include) or group == i:
                raise ValueError(f"bad position {c['position']!r}")
        if set(c) - {"class", "count", "color", "position"}:
            raise ValueError(f"unknown clause keys {sorted(set(c))}")
    expected_n = {"single_object": 1, "two_object": 2, "counting": 1, "colors": 1, "position": 2,
                  "color_attr": 2}[tag]
    if len(include) != expected_n:
        raise ValueError(f"{tag} needs {expected_n} include clause(s)")
    if tag == "counting":
        (c,) = include
        if item.get("exclude") != [{"class": c["class"], "count": c["count"] + 1}]:
            raise ValueError("counting needs exclude = [{class, count + 1}]")
    elif "exclude" in item:
        raise ValueError(f"{tag} has no exclude clause")
    if len({c["class"] for c in include}) != len(include):
        raise ValueError("classes must differ")
    if tag in ("colors", "color_attr"):
        if any("color" not in c or c["class"] == "person" for c in include):
            raise ValueError(f"{tag} clauses need a colour and no person")
        if len({c["color"] for c in include}) != len(include):
            raise ValueError("colours must differ")
    if tag == "position" and ("position" in include[0] or include[1].get("position", [None, None])[1] != 0):
        raise ValueError("position: the second clause is placed relative to group 0")
    a = include[0]
    fields: dict[str, Any] = {
        "single_object": lambda: dict(a=with_article(a["class"])),
        "two_object": lambda: dict(a=with_article(a["class"]), b=with_article(include[1]["class"])),
        "counting": lambda: dict(number=NUMBERS[a["count"]], plural=make_plural(a["class"])),
        "colors": lambda: dict(ca=with_article(a["color"]), obj=a["class"]),
        "position": lambda: dict(a=with_article(include[1]["class"]), relation=include[1]["position"][0],
                                 b=with_article(a["class"])),
        "color_attr": lambda: dict(ca=with_article(a["color"]), obj=a["class"],
                                   cb=with_article(include[1]["color"]), obj_b=include[1]["class"]),
    }
    if item.get("prompt") != TEMPLATES[tag].format(**fields[tag]()):
        raise ValueError(f"prompt {item.get('prompt')!r} does not match its metadata")


def write_jsonl(path: Path | str, items: Iterable[Mapping[str, Any]]) -> Path:
    """One JSON object a line (GenEval's format: `json.dumps` defaults), written atomically."""
    path = Path(path)
    atomic_write(path, "".join(json.dumps(dict(it)) + "\n" for it in items).encode())
    return path


def run(out: Path | str, seed: int | None = None, split: str = "test", n: int | None = None) -> Path:
    """`tpkit prompts geneval`: write a GenEval metadata .jsonl and return its path.

    split "test": GenEval's procedure with `n` draws per tag (default 100) and `seed` (default 43):
    the defaults give the official 553 prompts. split "train": `train_set(seed (default 0), n per tag
    (default 1000, capped))`, disjoint from the official test set.
    """
    if split not in ("test", "train"):
        raise ConfigError(f"unknown split {split!r}", "use --split train or --split test")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):  # 0 would write an empty file
        raise ConfigError(f"--n {n!r} must be a whole number >= 1", "e.g. --n 100 (or leave it out for the default)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"--seed {seed!r} must be a whole number >= 0", "e.g. --seed 0 (or leave it out for the default)")
    if split == "test":
        items = generate(GENEVAL_SEED if seed is None else seed, GENEVAL_N if n is None else n)
    else:
        items = train_set(DEFAULT_TRAIN_SEED if seed is None else seed, DEFAULT_TRAIN_N if n is None else n)
    return write_jsonl(out, items)
