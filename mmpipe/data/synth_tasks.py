"""The synthetic tasks: shapes to look at, sounds to hear, and text puzzles of every length.

Every answer is predictable from the input (shape and colour words, pitch and sound words,
counting, copying, reversing and adding), so a tiny model visibly learns within a few dozen
steps. Each task takes a seeded `random.Random` and returns a `Draft`: the conversation and
its media. Pure functions of the rng: the same seed gives the same bytes.
"""

from __future__ import annotations

import io
import math
import random
import wave
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

SAMPLE_RATE = 8000
"""Audio is written at the tiny model's rate, 8-bit mono PCM."""

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 60, 220), "yellow": (240, 210, 30),
    "purple": (130, 50, 170), "orange": (245, 130, 20), "white": (245, 245, 245), "black": (20, 20, 20),
}
PLAIN_BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245), "black": (20, 20, 20), "grey": (128, 128, 128),
}
SHAPES = ("circle", "square", "triangle", "cross", "diamond", "star")
PITCHES: dict[str, float] = {"low": 220.0, "middle": 440.0, "high": 880.0, "very high": 1760.0}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
WORDS = (
    "apple river stone cloud tiger bread lamp chair garden window pencil mountain orange candle "
    "rabbit forest bottle engine ladder mirror basket castle dragon feather guitar hammer island "
    "jacket kettle lemon marble needle ocean pepper quilt rocket saddle tomato violin wagon yarn "
    "zebra anchor button cactus donkey eagle falcon ginger harbor igloo jungle koala lizard "
    "meadow nickel otter parrot quartz raven spider turtle umbrella valley walnut"
).split()


@dataclass(kw_only=True, slots=True)
class Draft:
    """A generated sample before tokenization."""

    task: str
    """Task name (counted in index.json)."""
    conversations: list[dict[str, str]]
    """LLaVA turns: {"from": "human"|"gpt", "value": ...}."""
    images: list[bytes] = field(default_factory=list)
    """PNG bytes, in placeholder order."""
    image_sizes: list[tuple[int, int]] = field(default_factory=list)
    """(height, width) of each image."""
    audio: list[bytes] = field(default_factory=list)
    """WAV bytes, in placeholder order."""
    audio_seconds: list[float] = field(default_factory=list)
    """Exact duration of each clip (samples / SAMPLE_RATE)."""
    videos: list[bytes] = field(default_factory=list)
    """MP4 bytes of each video clip, in placeholder order (mmpipe.data.synth_video)."""
    video_meta: list = field(default_factory=list)
    """Each clip's header figures (mmpipe.model.geometry.VideoMeta)."""


def _conv(*turns: str) -> list[dict[str, str]]:
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]


# ---------------------------------------------------------------- images

@dataclass(frozen=True, kw_only=True, slots=True)
class Picture:
    """One drawn shape."""

    shape: str
    colour: str
    background: str
    large: bool
    png: bytes
    size: tuple[int, int]

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.shape}"


def polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    pts = []  # a five-pointed star
    for k in range(10):
        rad = r if k % 2 == 0 else r * 0.45
        a = -math.pi / 2 + k * math.pi / 5
        pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return pts


def draw_picture(rng: random.Random, *, min_side: int = 16, max_side: int = 200) -> Picture:
    """A shape in a named colour on a plain or contrasting background, at a random size and aspect."""
    shape = rng.choice(SHAPES)
    colour = rng.choice(list(COLOURS))
    backs = {**PLAIN_BACKGROUNDS, **{c: v for c, v in COLOURS.items() if c not in PLAIN_BACKGROUNDS}}
    background = rng.choice([b for b in backs if b != colour])
    side = rng.randint(min_side, max_side)
    aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
    h = max(min_side, min(max_side, round(side / math.sqrt(aspect))))
    w = max(min_side, min(max_side, round(side * math.sqrt(aspect))))
    frac = rng.uniform(0.35, 0.9)
    r = frac * min(h, w) / 2
    cx = rng.uniform(r, w - r)
    cy = rng.uniform(r, h - r)
    img = Image.new("RGB", (w, h), backs[background])
    d = ImageDraw.Draw(img)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = r * 0.85
        d.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    elif shape == "cross":
        t = r * 0.3
        d.rectangle([cx - r, cy - t, cx + r, cy + t], fill=fill)
        d.rectangle([cx - t, cy - r, cx + t, cy + r], fill=fill)
    else:
        d.polygon(polygon(shape, cx, cy, r), fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return Picture(shape=shape, colour=colour, background=background, large=frac >= 0.65,
                   png=buf.getvalue(), size=(h, w))


def image_task(rng: random.Random) -> Draft:
    """One image and a question about its shape, colour, background or size."""
    p = draw_picture(rng)
    kind = rng.randrange(8)
    if kind == 0:
        conv = _conv("<image>\nWhat shape is in the image?", p.phrase)
    elif kind == 1:
        conv = _conv("<image>\nWhat colour is the shape?", p.colour)
    elif kind == 2:
        conv = _conv("<image>\nDescribe the image.", f"{p.phrase} on a {p.background} background")
    elif kind == 3:
        asked = rng.choice(SHAPES) if rng.random() < 0.5 else p.shape
        conv = _conv(f"<image>\nIs there a {asked} in the image?", "yes" if asked == p.shape else "no")
    elif kind == 4:
        conv = _conv("What colour is the background?\n<image>", p.background)
    elif kind == 5:
        conv = _conv("<image>\nIs the shape large or small?", "large" if p.large else "small")
    elif kind == 6:
        conv = _conv("<image>", f"{'a large' if p.large else 'a small'} {p.colour} {p.shape} "
                                f"on a {p.background} background")
    else:
        conv = _conv("<image>\nWhat shape is this?", f"a {p.shape}", "What colour is it?", p.colour)
    return Draft(task="image", conversations=conv, images=[p.png], image_sizes=[p.size])


def multi_image_task(rng: random.Random) -> Draft:
    """Two or three smaller images: list them, count a shape, or compare colours."""
    n = rng.choice((2, 2, 3))
    pics = [draw_picture(rng, max_side=120) for _ in range(n)]
    marks = "\n".join("<image>" for _ in pics)
    kind = rng.randrange(3)
    if kind == 0:
        conv = _conv(f"{marks}\nWhat shapes are shown, in order?", ", then ".join(p.phrase for p in pics))
    elif kind == 1:
        shape = rng.choice([p.shape for p in pics] + [rng.choice(SHAPES)])
        count = sum(p.shape == shape for p in pics)
        conv = _conv(f"{marks}\nHow many of the images show a {shape}?", NUMBER_WORDS[count])
    else:
        same = len({p.colour for p in pics}) == 1
        conv = _conv(f"{marks}\nDo all the shapes have the same colour?",
                     "yes" if same else "no, they are " + ", ".join(p.colour for p in pics))
    return Draft(task="multi-image", conversations=conv, images=[p.png for p in pics],
                 image_sizes=[p.size for p in pics])


# ---------------------------------------------------------------- audio

def _duration(rng: random.Random) -> float:
    # Mostly short clips (they keep data/ small), a tail up to 6 s for audio-heavy samples.
    return 0.3 + 5.7 * rng.random() ** 4


def wav_bytes(x: np.ndarray) -> bytes:
    """8-bit unsigned mono PCM WAV at SAMPLE_RATE of a waveform in [-1, 1]."""
    q = np.clip(np.round(x * 127.0) + 128.0, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(1)
        wf.setframerate(SAMPLE_RATE)
        wf.writeframes(q.tobytes())
    return buf.getvalue()


def _fade(x: np.ndarray) -> np.ndarray:
    n = min(len(x) // 4, int(0.01 * SAMPLE_RATE))
    if n:
        ramp = np.linspace(0.0, 1.0, n)
        x[:n] *= ramp
        x[-n:] *= ramp[::-1]
    return x


@dataclass(frozen=True, kw_only=True, slots=True)
class Sound:
    """One generated clip."""

    phrase: str
    """What it is, e.g. `a rising chirp`."""
    wav: bytes
    seconds: float
    kind: str
    """tone, chirp, noise, beeps or silence."""
    pitch: str = ""
    beeps: int = 0


def make_sound(rng: random.Random) -> Sound:
    """A pure tone at a named pitch, a chirp, white noise, a few beeps, or silence."""
    kind = rng.choices(("tone", "chirp", "noise", "beeps", "silence"), weights=(4, 3, 2, 2, 1))[0]
    seconds = _duration(rng)
    pitch, beeps = "", 0
    if kind == "beeps":
        beeps = rng.randint(2, 6)
        seconds = beeps * 0.3
    n = round(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    amp = rng.uniform(0.3, 0.7)
    if kind == "tone":
        pitch = rng.choice(list(PITCHES))
        x = amp * np.sin(2 * np.pi * PITCHES[pitch] * t)
        phrase = f"a {pitch} tone"
    elif kind == "chirp":
        up = rng.random() < 0.5
        f0, f1 = (200.0, 2000.0) if up else (2000.0, 200.0)
        dur = n / SAMPLE_RATE
        x = amp * np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * dur)))
        phrase = "a rising chirp" if up else "a falling chirp"
    elif kind == "noise":
        x = amp * np.random.default_rng(rng.getrandbits(32)).uniform(-1.0, 1.0, n)
        phrase = "white noise"
    elif kind == "beeps":
        on = (t % 0.3) < 0.15
        x = amp * np.sin(2 * np.pi * 1000.0 * t) * on
        phrase = f"{NUMBER_WORDS[beeps]} beeps"
    else:
        x = np.zeros(n)
        phrase = "silence"
    return Sound(phrase=phrase, wav=wav_bytes(_fade(x)), seconds=n / SAMPLE_RATE, kind=kind,
                 pitch=pitch, beeps=beeps)


def audio_task(rng: random.Random) -> Draft:
    """One clip and a question about what it is, its pitch, its length or its beeps."""
    s = make_sound(rng)
    kind = rng.randrange(4)
    if kind == 1 and s.kind == "tone":
        conv = _conv("<audio>\nIs the tone high or low?", s.pitch)
    elif kind == 1 and s.kind == "beeps":
        conv = _conv("<audio>\nHow many beeps do you hear?", NUMBER_WORDS[s.beeps])
    elif kind == 2:
        conv = _conv("<audio>\nIs the sound long or short?", "long" if s.seconds >= 2.0 else "short")
    elif kind == 3:
        conv = _conv("Listen.\n<audio>\nDescribe the sound.", s.phrase)
    else:
        conv = _conv("<audio>\nWhat do you hear?", s.phrase)
    return Draft(task="audio", conversations=conv, audio=[s.wav], audio_seconds=[s.seconds])


def image_audio_task(rng: random.Random) -> Draft:
    """A picture and a sound, described together."""
    p = draw_picture(rng, max_side=120)
    s = make_sound(rng)
    if rng.random() < 0.5:
        conv = _conv("<image>\n<audio>\nDescribe the picture and the sound.", f"{p.phrase} and {s.phrase}")
    else:
        conv = _conv("<audio>\n<image>\nWhat do you hear and what do you see?", f"{s.phrase} and {p.phrase}")
    return Draft(task="image+audio", conversations=conv, images=[p.png], image_sizes=[p.size],
                 audio=[s.wav], audio_seconds=[s.seconds])


# ---------------------------------------------------------------- text

def _length(rng: random.Random, lo: int, hi: int) -> int:
    # Skewed to short, with a long tail: LLM load varies from tens to hundreds of tokens.
    return lo + int((hi - lo) * rng.random() ** 2)


def text_task(rng: random.Random) -> Draft:
    """Counting, copying, reversing, sorting, adding: answers follow from the question."""
    kind = rng.randrange(7)
    if kind == 0:
        a = rng.randint(0, 120)
        b = a + _length(rng, 3, 200)
        task = "count"
        conv = _conv(f"Count from {a} to {b}.", " ".join(str(i) for i in range(a, b + 1)))
    elif kind == 1:
        k = rng.randint(2, 9)
        top = k * _length(rng, 3, 90)
        task = "multiples"
        conv = _conv(f"List the multiples of {k} up to {top}.", " ".join(str(i) for i in range(k, top + 1, k)))
    elif kind == 2:
        words = [rng.choice(WORDS) for _ in range(_length(rng, 3, 300))]
        task = "repeat"
        conv = _conv("Repeat these words: " + " ".join(words), " ".join(words))
    elif kind == 3:
        words = [rng.choice(WORDS) for _ in range(_length(rng, 3, 160))]
        task = "reverse"
        conv = _conv("Reverse these words: " + " ".join(words), " ".join(reversed(words)))
    elif kind == 4:
        nums = [rng.randint(0, 99) for _ in range(_length(rng, 3, 120))]
        task = "sort"
        conv = _conv("Sort these numbers: " + " ".join(map(str, nums)), " ".join(map(str, sorted(nums))))
    elif kind == 5:
        nums = [rng.randint(1, 9) for _ in range(_length(rng, 3, 110))]
        sums = np.cumsum(nums).tolist()
        task = "running-sum"
        conv = _conv("Add these numbers one by one: " + " + ".join(map(str, nums)), " ".join(map(str, sums)))
    else:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        c = rng.randint(0, 9)
        task = "arithmetic"
        conv = _conv(f"What is {a} plus {b}?", str(a + b), f"And minus {c}?", str(a + b - c))
        if rng.random() < 0.5:
            conv = conv[:2]
    return Draft(task=task, conversations=conv)
