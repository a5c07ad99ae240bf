"""A small synthetic multi-hop corpus (RULER-style) that needs no data directory.

Every question is a two-hop chain over fictional entities: chunk A holds the first hop
("Zorvan Pellick was born in the city of Quillmarsh."), chunk B the second ("Quillmarsh is the
capital of the Drelvan province."), so the answer needs both chunks. Each fact sits at a random
place among filler sentences about other fictional entities, and every question also gets
distractor passages built the same way. All names are invented and unique as words, so the
answer occurs in chunk B only and no filler sentence contradicts a question's facts.
Deterministic for a given seed (one random.Random, no set-order dependence).
"""
import itertools
import random
from pathlib import Path

from kvf.errors import KvfError
from kvf.pipeline.data.datasets import Passage, Question, write_prepared

ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "pr", "qu",
          "r", "s", "st", "t", "tr", "v", "z", "th", "sh", "h", "j"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "y"]
CODAS = ["", "", "", "n", "r", "l", "s", "th", "ck", "m"]
CITY_SUFFIXES = ["marsh", "ford", "holm", "vale", "mere", "wick", "stead", "haven", "port", "moor"]
PROVINCE_SUFFIXES = ["an", "ia", "or", "ene", "oth"]
TRIES_PER_SYLLABLE = 8   # collisions in a row before a name's stems grow a syllable
COMPANY_KINDS = ["Industries", "Works", "Trading", "Foundry", "Laboratories", "Shipping"]
JOBS = ["an engineer", "an accountant", "a chemist", "a translator", "a designer", "a surveyor"]
SUBJECTS = ["astronomy", "botany", "law", "music", "geology", "medicine", "history", "mathematics"]

# two-hop chains: (first hop, second hop, question, answer aliases); {x} = subject, {y} = bridge,
# {z} = answer. The kinds say which name generator fills each slot.
CHAINS = [
    {"kinds": ("person", "city", "province"),
     "hop1": "{x} was born in the city of {y}.",
     "hop2": "{y} is the capital of the {z} province.",
     "question": "In which province was {x} born?",
     "answers": ["{z}", "{z} province"]},
    {"kinds": ("person", "company", "city"),
     "hop1": "{x} works as {job} at {y}.",
     "hop2": "{y} has its headquarters in the city of {z}.",
     "question": "In which city is the employer of {x} headquartered?",
     "answers": ["{z}"]},
    {"kinds": ("person", "person", "company"),
     "hop1": "{x} is married to {y}.",
     "hop2": "{y} is the founder of {z}.",
     "question": "Which company was founded by the spouse of {x}?",
     "answers": ["{z}"]},
]

# filler sentences: only about filler entities, so they never touch a question's chain
FILLERS = [
    "{person} was born in the city of {city}.",
    "{city} is the capital of the {province} province.",
    "{city} lies on the banks of the {river} river, which floods most springs.",
    "{person} studied {subject} at the University of {city} for six years.",
    "{company} was founded in {year} by {person} and two of her cousins.",
    "The {river} river flows through the {province} province before it reaches the sea.",
    "{person} wrote a well-known book about the early history of {city}.",
    "The population of {city} is about {n} thousand people, most of them farmers.",
    "{person} won the {province} prize for {subject} in {year}.",
    "{person} works as {job} at {company}.",
    "{company} has its headquarters in the city of {city}.",
    "Travellers say that the old market of {city} is the busiest in the {province} province.",
]


class NameMaker:
    """Invents names whose words are all unique, so word matches are unambiguous."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used_words = set()

    def _stem(self, syllables: int) -> str:
        return "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(CODAS)
                       for _ in range(syllables))

    def _make(self, kind: str, extra_syllables: int = 0) -> str:
        r = self.rng
        stem = lambda syllables: self._stem(syllables + extra_syllables)
        if kind == "person":
            return f"{stem(2).capitalize()} {stem(r.choice([2, 2, 3])).capitalize()}"
        if kind == "city":
            return (stem(r.randint(1, 2)) + r.choice(CITY_SUFFIXES)).capitalize()
        if kind == "province":
            return (stem(2) + r.choice(PROVINCE_SUFFIXES)).capitalize()
        if kind == "company":
            return f"{stem(2).capitalize()} {r.choice(COMPANY_KINDS)}"
        if kind == "river":
            return stem(2).capitalize()
        raise ValueError(kind)

    def new(self, kind: str) -> str:
        for tries in itertools.count():
            # names run out: every kind draws from the same few million two-syllable stems. Once a draw
            # keeps colliding its stems grow a syllable, so -n 60000 takes minutes instead of never ending
            # (below ~500 questions no draw collides that often: the corpora kvf's runs use are unchanged)
            name = self._make(kind, extra_syllables=tries // TRIES_PER_SYLLABLE)
            # company kinds ("Works") repeat by design; every other word must be fresh
            words = [w for w in name.split() if w not in COMPANY_KINDS]
            if not any(w.lower() in self.used_words for w in words):
                self.used_words.update(w.lower() for w in words)
                return name


def filler_sentence(rng: random.Random, names: NameMaker) -> tuple[str, str]:
    """One filler sentence about fresh entities; returns (sentence, its first entity)."""
    template = rng.choice(FILLERS)
    slots = {"person": names.new("person"), "city": names.new("city"), "province": names.new("province"),
             "company": names.new("company"), "river": names.new("river"), "subject": rng.choice(SUBJECTS),
             "job": rng.choice(JOBS), "year": rng.randint(1700, 1990), "n": rng.randint(5, 900)}
    first = min((template.find("{" + k + "}"), k) for k in ("person", "city", "province", "company", "river")
                if "{" + k + "}" in template)[1]
    return template.format(**slots), slots[first]


def build_passage(rng: random.Random, names: NameMaker, fact: str | None, title: str | None) -> Passage:
    """~60-150 words of filler with `fact` (if any) at a random place."""
    target = rng.randint(60, 130)
    sentences, words = [], len(fact.split()) if fact else 0
    first_entity = None
    while words < target:
        sentence, entity = filler_sentence(rng, names)
        first_entity = first_entity or entity
        sentences.append(sentence)
        words += len(sentence.split())
    if fact:
        sentences.insert(rng.randint(0, len(sentences)), fact)
    return Passage(title or first_entity, " ".join(sentences))


def make_question(rng: random.Random, names: NameMaker, qid: str, passages_per_question: int) -> Question:
    """One two-hop question: its two fact chunks plus distractor chunks, shuffled."""
    chain = rng.choice(CHAINS)
    x, y, z = (names.new(kind) for kind in chain["kinds"])
    slots = {"x": x, "y": y, "z": z, "job": rng.choice(JOBS)}
    hop1 = build_passage(rng, names, chain["hop1"].format(**slots), title=x)
    hop2 = build_passage(rng, names, chain["hop2"].format(**slots), title=y)
    distractors = [build_passage(rng, names, None, None) for _ in range(passages_per_question - 2)]
    contexts = [hop1, hop2, *distractors]
    rng.shuffle(contexts)
    answers = [a.format(**slots) for a in chain["answers"]]
    return Question(qid, chain["question"].format(**slots), answers, contexts)


def make_synthetic(out_dir: str | Path | None, n_questions: int = 20, passages_per_question: int = 4,
                   seed: int = 0, track=lambda items, total: items) -> list[Question]:
    """Generate the corpus; write it as a prepared directory (unless out_dir is None) and return it.
    track: wraps the question numbers, as a progress bar does (a thousand questions take a second)."""
    if n_questions < 1:
        raise KvfError(f"--n must be at least 1 (got {n_questions})")
    if passages_per_question < 2:
        raise KvfError(f"--passages {passages_per_question}: must be at least 2 (passages per question: a two-hop "
                       "answer needs two)")
    rng = random.Random(seed)
    names = NameMaker(rng)
    questions = [make_question(rng, names, f"syn{seed}-{i:04d}", passages_per_question)
                 for i in track(range(n_questions), n_questions)]
    if out_dir is not None:
        manifest = {"dataset": "synthetic", "source": "kvf.pipeline.data.synthetic", "format": "synthetic",
                    "seed": seed, "passages_per_question": passages_per_question, "skipped": 0}
        write_prepared(questions, out_dir, manifest)
    return questions
