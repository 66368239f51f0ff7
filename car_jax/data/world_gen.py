"""Generator of the built-in offline world: a small invented encyclopedia and its questions.

    python -m car_jax.data.world_gen            # rewrites car_jax/data/world/*.jsonl
    python -m car_jax.data.world_gen --check    # exit 1 when the committed files differ

Everything is fictional (invented towns, people, rivers, lakes, mountains and inventions with
invented facts), so no model can know an answer without searching. The output is a pure
function of the seed (`random.Random`, whose seeded `random`/`choice`/`shuffle`/`sample` are
stable across Python versions); `tests/test_data.py` checks the committed files equal it.

Files (wiki-18 corpus format; question lines readable by `car_jax.data.load_dataset`):
    corpus.jsonl  {"id": "17", "contents": "\\"Title\\"\\ntext"}; id = row number
    train.jsonl / dev.jsonl
                  {"id", "question", "golden_answers", "data_source": "world",
                   "answerable", "kind", "evidence"}

Question kinds:
    single    the answer is in the doc of the entity the question names (evidence: [doc])
    two_hop   the named entity's doc points to a second doc holding the answer
              (evidence: [first doc, answer doc])
    hidden    the entity has a doc, but the asked fact was left out of it (evidence: [doc])
    absent    the entity has no doc anywhere in the corpus (evidence: [])
Sizes: 208 docs (50 towns, 60 people, 24 rivers, 14 lakes, 20 mountains, 40 inventions; one
doc each), train 160 questions (96 single, 24 two_hop, 20 hidden, 20 absent), dev 80
(48 / 12 / 10 / 10); 40 docs leave one fact out. Splits share the corpus, not questions.
`hidden` and `absent` questions still carry a gold answer (the fact in the generator's world
model), so a lucky guess scores; a calibrated agent should give them low confidence.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 20240611
OUT_DIR = Path(__file__).resolve().parent / "world"
N_ENTITIES = {"town": 50, "person": 60, "river": 24, "lake": 14, "mountain": 20, "invention": 40}
# per split: single, two_hop, hidden, absent
SPLITS = {"train": (96, 24, 20, 20), "dev": (48, 12, 10, 10)}
N_HIDDEN = 40  # entities whose doc leaves one askable fact out

_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s",
           "sk", "st", "t", "th", "tr", "v", "w", "z", "qu", "y")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ei", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "th", "m", "nd", "rk", "sk", "lt")
_FIRST = ("Aldric", "Brenna", "Corvin", "Dalla", "Edrin", "Fenna", "Gideor", "Halda", "Isolt",
          "Joreth", "Kalla", "Lisbet", "Marek", "Nerys", "Osric", "Perrin", "Quenna", "Rolf",
          "Sabeth", "Tomas", "Ulla", "Varo", "Wenna", "Yorick")
PROVINCES = ("Ostrel", "Vanmark", "Quellen", "Hadria Minor", "Sorrow Coast", "Thessaly Vale",
             "Brannock", "Ulmgard")
PRODUCTS = ("blue glass", "copper bells", "salted eel", "felt hats", "tarred rope",
            "paper lanterns", "pewter spoons", "wool blankets", "pear cider", "slate tiles",
            "barometers", "goose quills", "cheese wheels", "hand drums", "clay pipes",
            "silk ribbons", "smoked trout", "river pearls", "oak barrels", "dyed linen")
OCCUPATIONS = ("clockmaker", "cartographer", "botanist", "glassblower", "surveyor", "astronomer",
               "shipwright", "apothecary", "bookbinder", "engineer", "weaver", "stonemason",
               "mathematician", "beekeeper", "printer", "locksmith")
MATERIALS = ("brass", "oak", "glass", "bronze", "walnut", "iron", "porcelain", "copper", "ash wood",
             "tin", "ivory", "slate")
DEVICES = ("lamp", "loom", "compass", "press", "pump", "kiln", "lock", "clock", "sextant", "bellows",
           "telescope", "plough")
PURPOSES = ("measure the depth of wells", "keep time aboard river barges", "sort grain by weight",
            "light mine shafts", "copy maps quickly", "dry herbs without sunlight",
            "lift water to hillside terraces", "find north on cloudy nights",
            "weave sailcloth", "seal wine casks", "count sheep at the gate", "track the phases of the moon")
RANGES = ("Grey Teeth", "Harrow", "Sallow Crown", "Ember Spine", "Kestrel")


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(_CODAS)).capitalize()


class _Names:
    """Unique invented words: no repeats, none a prefix of another (BM25 and EM stay clean)."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def __call__(self, syllables=(2, 2, 3)) -> str:
        while True:
            w = _word(self.rng, self.rng.choice(syllables))
            low = w.lower()
            if len(low) >= 5 and not any(low.startswith(u) or u.startswith(low) for u in self.used):
                self.used.add(low)
                return w


def _entities(rng: random.Random, names: _Names, counts: dict) -> dict[str, list[dict]]:
    """The world model: every entity with all its facts (docs may leave some out)."""
    towns = [{"name": names(), "province": rng.choice(PROVINCES), "founded": rng.randint(1150, 1880),
              "product": rng.choice(PRODUCTS)} for _ in range(counts["town"])]
    people = []
    for _ in range(counts["person"]):
        people.append({"name": f"{rng.choice(_FIRST)} {names()}", "born": rng.randint(1620, 1890),
                       "town": rng.choice(towns)["name"], "occupation": rng.choice(OCCUPATIONS)})
    mountains = [{"name": f"Mount {names()}", "height": rng.randint(900, 4800),
                  "range": rng.choice(RANGES)} for _ in range(counts["mountain"])]
    for m in mountains:
        climber = rng.choice(people)
        m.update(climber=climber["name"], ascent=climber["born"] + rng.randint(18, 50))
    lakes = [{"name": f"Lake {names()}", "depth": rng.randint(8, 420), "province": rng.choice(PROVINCES)}
             for _ in range(counts["lake"])]
    rivers = [{"name": f"{names()} River", "length": rng.randint(40, 900),
               "source": rng.choice(mountains)["name"], "mouth": rng.choice(lakes)["name"]}
              for _ in range(counts["river"])]
    for t in towns:
        t["river"] = rng.choice(rivers)["name"]
    for lake in lakes:
        lake["shore_town"] = rng.choice(towns)["name"]
    inventions = []
    for _ in range(counts["invention"]):
        inventor = rng.choice(people)
        inventions.append({"name": f"{names()} {rng.choice(DEVICES)}", "inventor": inventor["name"],
                           "year": inventor["born"] + rng.randint(20, 60),
                           "material": rng.choice(MATERIALS), "purpose": rng.choice(PURPOSES)})
    return {"town": towns, "person": people, "mountain": mountains, "lake": lakes, "river": rivers,
            "invention": inventions}


# the first sentence of every doc (never hidden), then one sentence per fact
INTRO = {"town": "{n} is a market town.", "person": "{n} appears in several regional histories.",
         "mountain": "{n} is a mountain.", "lake": "{n} is a freshwater lake.", "river": "The {n} is a river.",
         "invention": "The {n} is a historical device."}
# kind -> fact -> (sentence in the doc, question, gold answers). {n} is the entity name,
# {short} the name without "Mount "/"Lake "/" River", {first} a person's given name.
FACTS = {
    "town": {
        "province": ("It lies in the province of {province}.",
                     "In which province is the town of {n}?", ("{province}",)),
        "river": ("It stands on the banks of the {river}.",
                  "On which river does the town of {n} stand?", ("{river}", "{river_short}")),
        "founded": ("{n} was founded in {founded}.", "In what year was the town of {n} founded?",
                    ("{founded}",)),
        "product": ("The town is known for its {product}.", "What is the town of {n} known for making?",
                    ("{product}",)),
    },
    "person": {
        "occupation": ("{n} was a {occupation}.", "What was the occupation of {n}?", ("{occupation}",)),
        "born": ("{first} was born in {born}.", "In what year was {n} born?", ("{born}",)),
        "town": ("{first} grew up in the town of {town}.", "In which town did {n} grow up?", ("{town}",)),
    },
    "mountain": {
        "range": ("It is a peak of the {range} range.", "Which mountain range is {n} part of?",
                  ("{range}", "{range} range")),
        "height": ("It rises {height} metres above the sea.", "How high is {n}, in metres?",
                   ("{height}", "{height} metres", "{height} m")),
        "climber": ("Its first ascent was made by {climber} in {ascent}.", "Who first climbed {n}?",
                    ("{climber}", "{climber_last}")),
    },
    "lake": {
        "province": ("It lies in the province of {province}.", "In which province does {n} lie?",
                     ("{province}",)),
        "depth": ("At its deepest point it measures {depth} metres.", "How deep is {n} at its deepest, in metres?",
                  ("{depth}", "{depth} metres", "{depth} m")),
        "shore_town": ("The town of {shore_town} sits on its shore.", "Which town sits on the shore of {n}?",
                       ("{shore_town}",)),
    },
    "river": {
        "source": ("The {n} rises on the slopes of {source}.", "On which mountain does the {n} rise?",
                   ("{source}", "{source_short}")),
        "length": ("It runs for {length} kilometres.", "How long is the {n}, in kilometres?",
                   ("{length}", "{length} km", "{length} kilometres")),
        "mouth": ("It empties into {mouth}.", "Into which lake does the {n} empty?", ("{mouth}", "{mouth_short}")),
    },
    "invention": {
        "inventor": ("The {n} was devised by {inventor}.", "Who devised the {n}?",
                     ("{inventor}", "{inventor_last}")),
        "year": ("It was first demonstrated in {year}.", "In what year was the {n} first demonstrated?",
                 ("{year}",)),
        "material": ("Its frame was made of {material}.", "What material was the frame of the {n} made of?",
                     ("{material}",)),
        "purpose": ("It was built to {purpose}.", None, ()),  # not asked: too long to match exactly
    },
}
# two-hop: (kind, linking fact, kind of the linked entity, fact asked of it, question)
TWO_HOP = (
    ("invention", "inventor", "person", "town", "In which town did the person who devised the {n} grow up?"),
    ("invention", "inventor", "person", "born", "In what year was the person who devised the {n} born?"),
    ("town", "river", "river", "length", "How long, in kilometres, is the river on which {n} stands?"),
    ("town", "river", "river", "mouth", "Into which lake does the river through {n} empty?"),
    ("mountain", "climber", "person", "occupation", "What was the occupation of the first person to climb {n}?"),
    ("lake", "shore_town", "town", "founded", "In what year was the town on the shore of {n} founded?"),
)


def _short(name: str) -> str:
    return name.removeprefix("Mount ").removeprefix("Lake ").removesuffix(" River")


def _fields(e: dict) -> dict:
    """An entity's facts plus the derived forms used in templates."""
    f = dict(e, n=e["name"], first=e["name"].split()[0])
    for key in ("river", "source", "mouth"):
        if key in e:
            f[key + "_short"] = _short(e[key])
    for key in ("climber", "inventor"):
        if key in e:
            f[key + "_last"] = e[key].split()[-1]
    return f


def _doc_text(kind: str, e: dict, hidden: str | None) -> str:
    f = _fields(e)
    kept = [s for fact, (s, _, _) in FACTS[kind].items() if fact != hidden]
    return " ".join(s.format(**f) for s in (INTRO[kind], *kept))


def _golds(templates, e: dict) -> list[str]:
    f = _fields(e)
    out = []
    for t in templates:
        g = t.format(**f)
        if g not in out:
            out.append(g)
    return out


def generate(seed: int = SEED) -> dict[str, str]:
    """The world as {file name: file text}; a pure function of `seed`."""
    rng = random.Random(seed)
    names = _Names(rng)
    world = _entities(rng, names, N_ENTITIES)
    by_name = {e["name"]: (k, e) for k, es in world.items() for e in es}

    # hidden facts: one per chosen entity, never one that a two-hop question relies on
    askable = {k: [f for f, (_, q, _) in facts.items() if q] for k, facts in FACTS.items()}
    everyone = [(k, e) for k, es in world.items() for e in es]
    hidden = {e["name"]: rng.choice(askable[k]) for k, e in rng.sample(everyone, N_HIDDEN)}

    corpus, doc_of = [], {}
    order = list(everyone)
    rng.shuffle(order)
    for kind, e in order:
        doc_of[e["name"]] = str(len(corpus))
        text = _doc_text(kind, e, hidden.get(e["name"]))
        corpus.append({"id": doc_of[e["name"]], "contents": f'"{e["name"]}"\n{text}'})

    pools: dict[str, list[dict]] = {"single": [], "two_hop": [], "hidden": [], "absent": []}
    for kind, e in order:
        for fact in askable[kind]:
            _, question, golds = FACTS[kind][fact]
            q = {"question": question.format(**_fields(e)), "golden_answers": _golds(golds, e),
                 "answerable": fact != hidden.get(e["name"]), "evidence": [doc_of[e["name"]]]}
            pools["single" if q["answerable"] else "hidden"].append(q)
        for k1, link, k2, fact, question in TWO_HOP:
            if k1 != kind or hidden.get(e["name"]) == link:
                continue
            _, other = by_name[e[link]]
            if hidden.get(other["name"]) == fact:
                continue
            pools["two_hop"].append({
                "question": question.format(**_fields(e)), "golden_answers": _golds(FACTS[k2][fact][2], other),
                "answerable": True, "evidence": [doc_of[e["name"]], doc_of[other["name"]]]})
    # absent: fresh entities of each kind, never written to the corpus
    ghosts = _entities(rng, names, {k: 6 for k in N_ENTITIES})
    for kind, es in ghosts.items():
        for e in es:
            fact = rng.choice(askable[kind])
            _, question, golds = FACTS[kind][fact]
            pools["absent"].append({"question": question.format(**_fields(e)), "golden_answers": _golds(golds, e),
                                    "answerable": False, "evidence": []})

    files = {"corpus.jsonl": _jsonl(corpus)}
    for kind, pool in pools.items():
        rng.shuffle(pool)
    for split, sizes in SPLITS.items():
        rows = []
        for kind, n in zip(pools, sizes):
            if len(pools[kind]) < n:
                raise ValueError(f"world: only {len(pools[kind])} {kind} questions left for {split}, need {n}")
            rows += [dict(q, kind=kind) for q in pools[kind][:n]]
            pools[kind] = pools[kind][n:]
        rng.shuffle(rows)
        files[f"{split}.jsonl"] = _jsonl([
            {"id": f"world-{split}-{i:04d}", "question": r["question"], "golden_answers": r["golden_answers"],
             "data_source": "world", "answerable": r["answerable"], "kind": r["kind"], "evidence": r["evidence"]}
            for i, r in enumerate(rows)])
    return files


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--check", action="store_true", help="compare with the files in --out, write nothing")
    args = p.parse_args(argv)
    files = generate(args.seed)
    if args.check:
        stale = [n for n, text in files.items()
                 if not (args.out / n).is_file() or (args.out / n).read_text(encoding="utf-8") != text]
        print("world files up to date" if not stale else f"stale world files: {stale}")
        return int(bool(stale))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text, encoding="utf-8")
    print(f"wrote {', '.join(files)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
