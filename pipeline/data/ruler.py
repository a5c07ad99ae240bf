"""A RULER-style long-context suite (Hsieh et al., 2024) generated on the spot: exact answers, set
length, no download, deterministic by seed.

Each sample's context is laid out as passages of at most `chunk_tokens` model tokens, so each
passage is exactly one chunk when kvf chunks the corpus with the same --chunk-tokens: the
generator knows which chunk holds which fact (recorded as `fact_chunks`). Filler passages come
from a fixed pool (per seed) shared by every sample: their stored KVs are computed once, and only
the chunks that carry a sample's facts are new. A sample of `length` tokens has
(length - 150) // chunk_tokens passages (about 150 tokens go to the chat template and question).

Tasks (`kvf data ruler --tasks`; KEPT_TASKS are the ones the embedded 135M model solves with full
prefill at 2K tokens, see results/ruler_calibration.md):
  niah_single      one needle "The special magic number for KEY is: N." (RULER niah_single)
  niah_multikey    two needles with different keys in two chunks; the question names one
  niah_multivalue  two needles with one key in two chunks; both numbers are needed (gold_mode all)
  vt               variable tracking: "The variable A is set to N." in one chunk, "The variable B is
                   set to the variable A." in a later one; the question asks for B (the chain crosses chunks)
  fwe              frequent-word extraction: word lists over every chunk in which one word is far more
                   frequent than the others (20x); which is it
  two_hop          "P lives in C." and "C lies in the country of K." in different chunks; where does P live
  boundary         (kvf) the needle is cut by a chunk boundary: one chunk ends "... magic number for
                   KEY is" and the next begins with the number; stored alone, the number never saw its key
  alias            (kvf) "KEY2 has the same special magic number as KEY1." in a chunk after KEY1's
                   needle; the question asks for KEY2's number, stated only relative to an earlier chunk
Scoring follows RULER: the fraction of the gold values present in the answer (eval/metrics.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from kvf.errors import KvfError, counted, did_you_mean
from kvf.pipeline.data.datasets import Passage, Question, write_prepared
from kvf.pipeline.data.synthetic import NameMaker, filler_sentence

TEMPLATE_TOKENS = 150  # chat template, system prompt and question: what a length leaves out of the passages
MIN_CHUNK_TOKENS = 64  # the smallest chunk the suite is made with
KEYS = ["apple", "river", "candle", "falcon", "garden", "harbor", "island", "jacket", "kettle", "lantern", "marble",
        "needle", "orchid", "pepper", "quartz", "rocket", "saddle", "tunnel", "velvet", "walnut", "anchor", "bamboo",
        "cactus", "dolphin", "engine", "feather", "glacier", "hammer", "iceberg", "jungle", "kayak", "lemon",
        "meadow", "nectar", "oyster", "pillow", "quiver", "raven", "spider", "tiger", "umbrella", "violin", "window",
        "yogurt", "zebra", "button", "copper", "desert", "ember", "forest", "guitar", "helmet", "ink", "jewel",
        "kernel", "ladder", "magnet", "nickel", "onion", "parrot", "rabbit", "silver", "tomato", "valley"]
CODED = ["zlorp", "quib", "fenk", "drask", "mulo", "tirv", "snabe", "grolt", "yemp", "vosh", "krell", "plim",
         "hask", "wubo", "jent", "cralt", "bloy", "nusk", "trovi", "gepp"]
COUNTRIES = ["Norland", "Ostravia", "Kelmar", "Dunhaven", "Praxia", "Velloria", "Turmand", "Zandor", "Quessia",
             "Borvia", "Ithmar", "Lunaris"]


@dataclass
class Sample:
    passages: list[str]                  # in prompt order, each at most chunk_tokens tokens
    question: str
    answers: list[str]
    gold_mode: str = "any"               # "all": every answer value is needed (RULER scoring)
    fact_chunks: list[int] = field(default_factory=list)   # which passages hold the facts


class Writer:
    """Builds passages of at most `budget` tokens from filler sentences and facts."""

    def __init__(self, tokenizer, chunk_tokens: int, rng: random.Random, names: NameMaker):
        self.tokenizer, self.rng, self.names = tokenizer, rng, names
        self.budget = chunk_tokens - 2  # room for a stray merge at the joins

    def tokens(self, text: str) -> int:
        # not memoised: nearly every text measured is new (a passage growing by a sentence or a word)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def filler(self) -> str:
        return filler_sentence(self.rng, self.names)[0]

    def passage(self, facts: list[str] = (), head: str = "", tail: str = "") -> str:
        """Filler sentences around `facts` (at random places), starting with `head`, ending with `tail`."""
        fixed = [s for s in (head, *facts, tail) if s]
        sentences: list[str] = []
        while True:
            candidate = self.filler()
            if self.tokens(" ".join([*fixed, *sentences, candidate])) > self.budget:
                break
            sentences.append(candidate)
        for fact in facts:
            sentences.insert(self.rng.randint(0, len(sentences)), fact)
        while True:  # joins can merge into a token more or less: drop filler until the whole fits
            text = " ".join(([head] if head else []) + sentences + ([tail] if tail else []))
            if self.tokens(text) <= self.budget:
                return text
            fillers = [i for i, s in enumerate(sentences) if s not in facts]
            if not fillers:
                raise KvfError(f"--chunk-tokens {self.budget + 2}: too small for a RULER passage; use 128 or more")
            sentences.pop(fillers[-1])


def number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def spread(rng: random.Random, k: int, n: int, ordered: bool = False) -> list[int]:
    """n distinct chunk positions out of k (increasing when ordered, so a chain runs forward)."""
    picks = rng.sample(range(k), n)
    return sorted(picks) if ordered else picks


def place(writer: Writer, pool: list[str], k: int, facts_at: dict[int, dict]) -> list[str]:
    """k passages: fact passages where asked, pool passages (distinct, in a random order) elsewhere."""
    fillers = iter(writer.rng.sample(pool, k - len(facts_at)))
    return [writer.passage(**facts_at[i]) if i in facts_at else next(fillers) for i in range(k)]


def needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is: {value}."


# ---- the tasks: each returns one Sample ----------------------------------------------------------
def niah_single(w: Writer, pool: list[str], k: int) -> Sample:
    key, value = w.rng.choice(KEYS), number(w.rng)
    at = w.rng.randrange(k)
    return Sample(place(w, pool, k, {at: {"facts": [needle(key, value)]}}),
                  f"What is the special magic number for {key}? Reply with the number only.", [value], fact_chunks=[at])


MULTIKEY_NEEDLES = 2
FWE_TOP_WEIGHT = 20.0


def niah_multikey(w: Writer, pool: list[str], k: int) -> Sample:
    keys = w.rng.sample(KEYS, MULTIKEY_NEEDLES)
    values = [number(w.rng) for _ in keys]
    where = spread(w.rng, k, min(MULTIKEY_NEEDLES, k))
    facts = {i: {"facts": [needle(key, value)]} for i, key, value in zip(where, keys, values)}
    ask = w.rng.randrange(len(where))
    return Sample(place(w, pool, k, facts), f"What is the special magic number for {keys[ask]}? Reply with the number only.",
                  [values[ask]], fact_chunks=[where[ask]])


def niah_multivalue(w: Writer, pool: list[str], k: int) -> Sample:
    key = w.rng.choice(KEYS)
    values = [number(w.rng) for _ in range(2)]
    where = spread(w.rng, k, 2)
    facts = {i: {"facts": [needle(key, value)]} for i, value in zip(where, values)}
    return Sample(place(w, pool, k, facts),
                  f"What are all the special magic numbers for {key}? Reply with the numbers only.", values, "all", where)


def vt(w: Writer, pool: list[str], k: int) -> Sample:
    first, second = w.rng.sample(KEYS, 2)
    value = str(w.rng.randint(10_000, 99_999))
    a, b = spread(w.rng, k, 2, ordered=True)
    facts = {a: {"facts": [f"The variable {first} is set to {value}."]},
             b: {"facts": [f"The variable {second} is set to the variable {first}."]}}
    return Sample(place(w, pool, k, facts), f"What is the value of the variable {second}? Reply with the number only.",
                  [value], fact_chunks=[a, b])


def fwe(w: Writer, pool: list[str], k: int) -> Sample:
    words = w.rng.sample(KEYS, 8)
    top = words[0]
    weights = [FWE_TOP_WEIGHT] + [1.0] * (len(words) - 1)  # the top word is far more frequent than any other
    passages = []
    for _ in range(k):
        text = ""
        while True:
            word = w.rng.choices(words, weights)[0]
            candidate = f"{text} {word}".strip()
            if w.tokens(candidate + " ....") > w.budget:
                break
            text = candidate
        passages.append(text + " ....")
    return Sample(passages, "Which word appears most often in the word lists above? Reply with the word only.",
                  [top], fact_chunks=list(range(k)))


def two_hop(w: Writer, pool: list[str], k: int) -> Sample:
    person, city, country = w.names.new("person"), w.names.new("city"), w.rng.choice(COUNTRIES)
    a, b = spread(w.rng, k, 2)
    facts = {a: {"facts": [f"{person} lives in the city of {city}."]},
             b: {"facts": [f"The city of {city} lies in the country of {country}."]}}
    return Sample(place(w, pool, k, facts), f"In which country does {person} live? Reply with the country only.",
                  [country], fact_chunks=[a, b])


def boundary(w: Writer, pool: list[str], k: int) -> Sample:
    key, value = w.rng.choice(KEYS), number(w.rng)
    a = w.rng.randrange(k - 1) if k > 1 else 0
    facts = {a: {"tail": f"The special magic number for {key} is:"}, a + 1: {"head": f"{value}."}}
    return Sample(place(w, pool, k, facts), f"What is the special magic number for {key}? Reply with the number only.",
                  [value], fact_chunks=[a, a + 1])


def alias(w: Writer, pool: list[str], k: int) -> Sample:
    first, second = w.rng.sample(KEYS, 2)
    value = number(w.rng)
    a, b = spread(w.rng, k, 2, ordered=True)
    facts = {a: {"facts": [needle(first, value)]},
             b: {"facts": [f"The special magic number for {second} is the same as the one for {first}."]}}
    return Sample(place(w, pool, k, facts), f"What is the special magic number for {second}? Reply with the number only.",
                  [value], fact_chunks=[a, b])


KEPT_TASKS = ("niah_single", "niah_multikey", "boundary", "alias")
TASKS = {"niah_single": niah_single, "niah_multikey": niah_multikey, "niah_multivalue": niah_multivalue, "vt": vt,
         "fwe": fwe, "two_hop": two_hop, "boundary": boundary, "alias": alias}
MIN_CHUNKS = {"niah_multikey": MULTIKEY_NEEDLES, "niah_multivalue": 2, "vt": 2, "two_hop": 2, "boundary": 2, "alias": 2}


def filler_pool(writer: Writer, size: int) -> list[str]:
    return [writer.passage() for _ in range(size)]


def check_args(tasks: list[str], length: int, n: int, chunk_tokens: int, max_positions: int) -> int:
    """Bad arguments are one-line errors; returns the number of passages per sample."""
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        hint = did_you_mean(unknown[0], list(TASKS)) if len(unknown) == 1 else ""
        raise KvfError(f"--tasks {','.join(unknown) or '(none)'}: unknown task{hint}; known: {', '.join(TASKS)}")
    if n < 1:
        raise KvfError(f"--n {n}: must be >= 1 samples per task")
    if chunk_tokens < MIN_CHUNK_TOKENS:
        raise KvfError(f"--chunk-tokens {chunk_tokens}: must be >= {MIN_CHUNK_TOKENS}")
    if length > max_positions:
        raise KvfError(f"--length {length}: longer than the model's {max_positions} positions; use at most {max_positions}")
    k = (length - TEMPLATE_TOKENS) // chunk_tokens
    need = max(MIN_CHUNKS.get(t, 1) for t in tasks)
    if k < need:
        shortest = TEMPLATE_TOKENS + need * chunk_tokens
        fitting = (length - TEMPLATE_TOKENS) // need   # the chunk size this length holds enough of
        if shortest <= max_positions:
            fix = f"use --length {shortest} or more"
        elif fitting >= MIN_CHUNK_TOKENS:   # past the model: chunks must shrink
            fix = f"use --chunk-tokens {fitting} or fewer"
        else:
            fix = f"use --chunk-tokens {MIN_CHUNK_TOKENS} and --length {TEMPLATE_TOKENS + need * MIN_CHUNK_TOKENS} or more"
        room = counted(k, "chunk") if k > 0 else "no chunk"   # below the template's own length k was -1
        raise KvfError(f"--length {length}: leaves room for {room} of {chunk_tokens} tokens; the tasks need "
                       f"{need}; {fix}")
    return k


def sample_id(task: str, length: int, seed: int, i: int) -> str:
    """niah_single-2048-000 for seed 0; other seeds name theirs (niah_single-2048-s1-000), so the
    samples of several seeds pool into one dataset (`ruler-2048`) without clashing."""
    return f"{task}-{length}-{i:03d}" if seed == 0 else f"{task}-{length}-s{seed}-{i:03d}"


def make_ruler(out_dir: str | Path | None, tokenizer, tasks: list[str], length: int, n: int, seed: int = 0,
               chunk_tokens: int = 256, max_positions: int = 8192,
               track=lambda samples, total: samples) -> list[Question]:
    """Generate n samples per task at `length` tokens; write a prepared directory unless out_dir is None.
    track: wraps the samples as they are made, as a progress bar does (fwe's word lists take a second each)."""
    k = check_args(tasks, length, n, chunk_tokens, max_positions)
    questions = list(track(generate(tokenizer, tasks, n, seed, chunk_tokens, k, length), len(tasks) * n))
    if out_dir is not None:
        manifest = {"dataset": f"ruler-{length}", "source": "kvf.pipeline.data.ruler", "format": "ruler", "seed": seed,
                    "tasks": tasks, "length": length, "chunk_tokens": chunk_tokens, "chunks_per_sample": k,
                    "samples_per_task": n, "skipped": 0}
        write_prepared(questions, out_dir, manifest)
    return questions


def generate(tokenizer, tasks: list[str], n: int, seed: int, chunk_tokens: int, k: int, length: int):
    """n samples of k passages per task, one Question at a time, deterministic by seed."""
    pool_rng = random.Random(f"ruler-pool-{seed}")
    writer = Writer(tokenizer, chunk_tokens, pool_rng, NameMaker(pool_rng))
    pool = filler_pool(writer, max(2 * k, 24))
    for task in tasks:
        rng = random.Random(f"ruler-{task}-{seed}")
        writer.rng = rng  # names stay unique across the pool and every task (one NameMaker)
        writer.names.rng = rng
        for i in range(n):
            sample = TASKS[task](writer, pool, k)
            passages = [Passage("", text) for text in sample.passages]
            yield Question(sample_id(task, length, seed, i), sample.question, sample.answers, passages,
                           gold_mode=sample.gold_mode, task=task, fact_chunks=sample.fact_chunks)
