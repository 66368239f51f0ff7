"""Generator of the large offline world, dataset name "world-large": the small world's
invented encyclopedia (`car_jax.data.world_gen`: names, fact sentences, question templates)
scaled up to what the pilot and the CAR-vs-vanilla experiment need.

    load_dataset("world-large", split="train" | "dev" | "ood" | "arith_train" | "arith_dev"
                 | "mixed_train" | "mixed_dev")
    search_tool("world-large")                             # BM25 over its corpus
    python -m car_jax.data.world_large --out DIR           # write the files to DIR, e.g. to read them

Storage (car_jax's decision): generated, not shipped. The first use writes the files into
`<car_jax cache>/world_large_<key>/` (a temporary folder renamed into place, so an interrupted
write is never used); key = sha256 of the generator's sources (this file, world_gen.py,
world_arith.py, world_mixed.py) and the seed, so an edited generator gets fresh files and the repository
stays small (the files take 1.9 MB, ~1 s to generate). The output is a pure
function of the seed (`random.Random`; no `hash()`, no set order, no clock).

What makes it harder than the small world:
- 5,040 docs: 3,540 entities (900 towns, 1,300 people, 220 rivers, 160 lakes, 260 mountains,
  700 inventions) and 1,500 distractor passages (floods, fairs, surveys, two towns confused,
  letters) that name several entities each; the surveys state wrong depths and heights.
- Shared name roots: half the mountains, lakes, rivers and inventions are named after a town
  (a town Kelvar, Mount Kelvar, the Kelvar River and the Kelvar lamp can all exist), and 60%
  of the people share a surname with someone else, so a query's name words hit several docs.
- Docs carry facts that train/dev never ask (a town's population, a person's death year, a
  lake's area, a mountain's first-ascent year): the out-of-distribution split asks them.
- Absent entities are half fresh names and half near misses (Lake Kelvar where only the
  town Kelvar exists, a first name joined to an existing surname; absent towns are fresh).
Measured with the BM25 index (`search_tool("world-large")`) on the dev single-hop questions:
the entity's doc ranks first for 95% of them and is in the top 3 for all; the other two
results are mostly distractors naming the same entity or root.

Files (the small world's formats; question rows also carry `entity` and `relation`):
    corpus.jsonl      {"id", "contents": "\\"Title\\"\\ntext"}, id = row number (wiki-18 format), 1.1 MB
    train / dev       kinds single, two_hop, hidden, absent (as the small world), 2,000 / 500
    ood               kinds new_relation (a fact train never asks), paraphrase (a train relation
                      asked in a wording train never uses), absent; 500. Stands in for
                      SimpleQA-verified: the same corpus, other relations and phrasings.
    arith_train / arith_dev
                      {"id", "problem", "answer", "op", "evidence", ...}: MATH-500's columns, so
                      `load_dataset` gives task "math" (the `tir` mode, the code tool); word
                      problems whose numbers are world facts, stated in the problem (no search
                      needed) and written in the evidence docs; answers exact (integers, or
                      terminating decimals); 800 / 200.
    mixed_train / mixed_dev
                      search questions and word problems interleaved, each row marked with the
                      `tool` it needs (`car_jax.data.world_mixed`); 800 / 200, drawn from
                      train + arith_train / dev + arith_dev.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

from car_jax.data import world_gen as wg
from car_jax.data import world_arith, world_mixed

NAME = "world-large"
SEED = 20240612
COUNTS = {"town": 900, "person": 1300, "river": 220, "lake": 160, "mountain": 260, "invention": 700}
SPLITS = {"train": (1200, 400, 200, 200), "dev": (300, 100, 50, 50)}  # single, two_hop, hidden, absent
OOD = {"new_relation": 250, "paraphrase": 200, "absent": 50}
ARITH = {"arith_train": 800, "arith_dev": 200}
FILES = ("corpus", "train", "dev", "ood", "arith_train", "arith_dev", *world_mixed.MIXED)
HIDDEN_FRACTION, SHARE_ROOT, SHARE_SURNAME, N_GHOSTS, N_EVENTS = 0.1, 0.5, 0.6, 80, 1500

# facts written in the docs that train/dev never ask: kind -> fact -> (sentence or None when
# another sentence already holds it, OOD question, gold answers)
EXTRA = {
    "town": {"population": ("About {population} people live there.",
                            "How many people live in the town of {n}?", ("{population}",))},
    "person": {"died": ("{first} died in {died}.", "In what year did {n} die?", ("{died}",))},
    "lake": {"area": ("It covers {area} square kilometres.", "What area does {n} cover, in square kilometres?",
                      ("{area}", "{area} square kilometres", "{area} km2"))},
    "mountain": {"ascent": (None, "In what year did anyone first reach the summit of {n}?", ("{ascent}",))},
}
# train relations asked in wordings train/dev never use
PARAPHRASE = {
    ("town", "province"): "Name the province that contains the town of {n}.",
    ("town", "founded"): "When was {n} founded? Give the year.",
    ("person", "occupation"): "What did {n} do for a living?",
    ("person", "born"): "{n} was born in which year?",
    ("mountain", "height"): "What is the elevation of {n} in metres?",
    ("lake", "depth"): "What is the maximum depth of {n}, in metres?",
    ("river", "length"): "What is the length of the {n} in kilometres?",
    ("invention", "inventor"): "Which person is credited with devising the {n}?",
}
FACTS = {k: {**wg.FACTS[k], **EXTRA.get(k, {})} for k in wg.FACTS}
TRAIN_FACTS = {k: [f for f, (_, q, _) in wg.FACTS[k].items() if q] for k in wg.FACTS}


class _Names:
    """world_gen's name rule (unique words, none a prefix of another) in O(length) per name."""

    def __init__(self, rng: random.Random):
        self.rng, self.used, self.prefixes = rng, set(), set()

    def __call__(self, syllables=(2, 2, 3)) -> str:
        while True:
            w = wg._word(self.rng, self.rng.choice(syllables))
            low = w.lower()
            if len(low) >= 5 and low not in self.prefixes and not any(low[:i] in self.used for i in range(1, len(low) + 1)):
                self.used.add(low)
                self.prefixes.update(low[:i] for i in range(1, len(low) + 1))
                return w


def _share_names(rng: random.Random, world: dict) -> None:
    """Renames in place: mountains, lakes, rivers, inventions after towns; people into families."""
    towns = [t["name"] for t in world["town"]]
    forms = {"mountain": "Mount {}", "lake": "Lake {}", "river": "{} River"}
    taken, mapping = {e["name"] for es in world.values() for e in es}, {}
    for kind, es in world.items():
        for e in es:
            if kind in forms or kind == "invention":
                root = rng.choice(towns)
                new = forms[kind].format(root) if kind in forms else f"{root} {e['name'].split()[-1]}"
                share = rng.random() < SHARE_ROOT
            elif kind == "person":
                other = rng.choice(world["person"])["name"]
                new, share = f"{e['name'].split()[0]} {other.split()[-1]}", rng.random() < SHARE_SURNAME
            else:
                continue
            if share and new not in taken:
                taken.add(new)
                mapping[e["name"]] = new
    for es in world.values():
        for e in es:
            e.update({k: mapping.get(v, v) for k, v in e.items() if isinstance(v, str)})


def _extras(rng: random.Random, world: dict) -> None:
    for t in world["town"]:
        t["population"] = 100 * rng.randint(20, 900)
    for p in world["person"]:
        p["died"] = p["born"] + rng.randint(30, 85)
    for lake in world["lake"]:
        lake["area"] = rng.randint(2, 900)


def _has(text: str, golds) -> bool:
    """Any gold written in `text` as whole words."""
    return any(re.search(rf"(?<!\w){re.escape(g)}(?!\w)", text) for g in golds)


def _events(rng: random.Random, world: dict, hidden: dict) -> list[tuple[str, str]]:
    """N_EVENTS distractor passages (title, text): floods, fairs, surveys, confusions, letters.
    They name several entities each (so a name's query hits them too), and surveys state
    wrong depths and heights (noisy evidence); none states a fact its entity's doc hides."""
    pick = lambda kind: rng.choice(world[kind])  # noqa: E731
    out, titles = [], set()
    while len(out) < N_EVENTS:
        year, t, t2, p = rng.randint(1620, 1900), pick("town"), pick("town"), pick("person")
        what = len(out) % 5
        if what == 0:
            title = f"{year} flood on the {t['river']}"
            text = (f"In {year} a flood on the {t['river']} damaged the bridges of {t['name']} and {t2['name']}. "
                    f"Traders from {t['name']} moved their {t['product']} by road that season.")
        elif what == 1:
            title = f"{t['name']} fair of {year}"
            text = (f"The {t['name']} fair of {year} drew traders from {t2['name']} and {pick('town')['name']}. "
                    f"{p['name']} kept its accounts, and {t2['product']} from {t2['name']} sold out on the first day.")
        elif what == 2:
            lake, m = pick("lake"), pick("mountain")
            title = f"{year} survey of {lake['name']}"
            text = (f"In {year} {p['name']} surveyed {lake['name']} and {m['name']}. The survey put the lake's depth "
                    f"at {lake['depth'] + rng.choice((-1, 1)) * rng.randint(3, 40)} metres and the mountain's height at "
                    f"{m['height'] + rng.choice((-1, 1)) * rng.randint(30, 400)} metres; later measurements differ.")
        elif what == 3:
            if t is t2 or hidden.get(t2["name"]) in ("province", "founded"):
                continue
            title = f"{t['name']} and {t2['name']}"
            text = (f"{t['name']} is often confused with {t2['name']}, which lies in the province of {t2['province']} "
                    f"and was founded in {t2['founded']}. The two towns trade {t['product']} with each other.")
        else:
            title = f"Letters of {p['name']}"
            text = (f"The letters of {p['name']} mention the {pick('invention')['name']}, {pick('mountain')['name']} and "
                    f"the town of {t['name']}. They were collected by {pick('person')['name']} in {year}.")
        if title not in titles:
            titles.add(title)
            out.append((title, text))
    return out


def _doc_text(kind: str, e: dict, hidden: str | None) -> str:
    f = wg._fields(e)
    kept = [s for fact, (s, _, _) in FACTS[kind].items() if s and fact != hidden]
    return " ".join(s.format(**f) for s in (wg.INTRO[kind], *kept))


def _question(kind: str, e: dict, fact: str, template: str, relation: str | None = None) -> dict:
    f = wg._fields(e)
    return {"question": template.format(**f), "golden_answers": wg._golds(FACTS[kind][fact][2], e),
            "entity": e["name"], "relation": relation or f"{kind}.{fact}"}


def _ghosts(rng: random.Random, names: _Names, world: dict) -> list[tuple[str, dict]]:
    """Entities with no doc: N_GHOSTS of each kind, every second one (towns aside) a near-miss name."""
    ghosts = wg._entities(rng, names, {k: N_GHOSTS for k in wg.N_ENTITIES})
    _extras(rng, ghosts)
    taken = {e["name"] for es in world.values() for e in es}
    towns = [t["name"] for t in world["town"]]
    surnames = [p["name"].split()[-1] for p in world["person"]]
    forms = {"mountain": "Mount {}", "lake": "Lake {}", "river": "{} River"}
    out = []
    for kind, es in ghosts.items():
        for i, e in enumerate(es):
            if i % 2 and kind != "town":  # (a town's near miss would be another kind's name)
                if kind == "person":
                    near = f"{rng.choice(wg._FIRST)} {rng.choice(surnames)}"
                elif kind == "invention":
                    near = f"{rng.choice(towns)} {e['name'].split()[-1]}"
                else:
                    near = forms[kind].format(rng.choice(towns).split()[-1])
                if near not in taken:
                    taken.add(near)
                    e["name"] = near
            out.append((kind, e))
    return out


def generate(seed: int = SEED) -> dict[str, str]:
    """The large world as {file name: file text}; a pure function of `seed`."""
    rng = random.Random(seed)
    names = _Names(rng)
    world = wg._entities(rng, names, COUNTS)
    _share_names(rng, world)
    _extras(rng, world)
    by_name = {e["name"]: (k, e) for k, es in world.items() for e in es}
    everyone = [(k, e) for k, es in world.items() for e in es]

    hidden = {}  # one train fact per chosen entity, only where its gold is nowhere else in the doc
    for kind, e in rng.sample(everyone, int(HIDDEN_FRACTION * len(everyone))):
        fact = rng.choice(TRAIN_FACTS[kind])
        if not _has(_doc_text(kind, e, fact), wg._golds(FACTS[kind][fact][2], e)):
            hidden[e["name"]] = fact

    order = list(everyone)
    rng.shuffle(order)
    docs = [(e["name"], _doc_text(kind, e, hidden.get(e["name"])), e["name"]) for kind, e in order]
    docs += [(title, text, None) for title, text in _events(rng, world, hidden)]
    rng.shuffle(docs)
    corpus, doc_of = [], {}
    for title, text, entity in docs:
        if entity is not None:
            doc_of[entity] = str(len(corpus))
        corpus.append({"id": str(len(corpus)), "contents": f'"{title}"\n{text}'})

    pools: dict[str, list[dict]] = {k: [] for k in ("single", "two_hop", "hidden", "absent")}
    ood: dict[str, list[dict]] = {k: [] for k in OOD}
    for kind, e in order:
        h = hidden.get(e["name"])
        for fact in TRAIN_FACTS[kind]:
            q = _question(kind, e, fact, FACTS[kind][fact][1])
            q.update(answerable=fact != h, evidence=[doc_of[e["name"]]])
            pools["single" if q["answerable"] else "hidden"].append(q)
            if (kind, fact) in PARAPHRASE and fact != h:
                ood["paraphrase"].append(dict(_question(kind, e, fact, PARAPHRASE[kind, fact]),
                                              answerable=True, evidence=q["evidence"]))
        for fact, (_, template, _) in EXTRA.get(kind, {}).items():
            if h is None:
                ood["new_relation"].append(dict(_question(kind, e, fact, template), answerable=True,
                                                evidence=[doc_of[e["name"]]]))
        for k1, link, k2, fact, template in wg.TWO_HOP:
            if k1 != kind or h == link or hidden.get(e[link]) == fact:
                continue
            _, other = by_name[e[link]]
            q = _question(k2, other, fact, template, relation=f"{k1}.{link}>{k2}.{fact}")
            q.update(question=template.format(**wg._fields(e)), entity=e["name"], answerable=True,
                     evidence=[doc_of[e["name"]], doc_of[other["name"]]])
            pools["two_hop"].append(q)
    for i, (kind, e) in enumerate(_ghosts(rng, names, world)):
        if i % 3 == 2:  # every third ghost goes to the OOD split, asked in an OOD wording
            choices = [(f, t) for (k, f), t in PARAPHRASE.items() if k == kind]
            choices += [(f, t) for f, (_, t, _) in EXTRA.get(kind, {}).items()]
            fact, template = rng.choice(choices)
            ood["absent"].append(dict(_question(kind, e, fact, template), answerable=False, evidence=[]))
        else:
            fact = rng.choice(TRAIN_FACTS[kind])
            pools["absent"].append(dict(_question(kind, e, fact, FACTS[kind][fact][1]), answerable=False, evidence=[]))

    files = {"corpus.jsonl": wg._jsonl(corpus)}
    for split, sizes in SPLITS.items():
        files[f"{split}.jsonl"] = _split(rng, split, dict(zip(pools, sizes)), pools)
    files["ood.jsonl"] = _split(rng, "ood", OOD, ood)
    problems = world_arith.word_problems(rng, world, hidden, doc_of, sum(ARITH.values()))
    start = 0
    for split, n in ARITH.items():
        if len(problems) < start + n:
            raise ValueError(f"{NAME}: only {len(problems) - start} arithmetic problems left for {split}, need {n}")
        files[f"{split}.jsonl"] = wg._jsonl([{"id": f"{NAME}-{split}-{i:04d}", **p, "data_source": NAME}
                                             for i, p in enumerate(problems[start:start + n])])
        start += n
    files.update(world_mixed.mixed_files(seed, files, NAME))  # its own rng: the files above stay as they were
    return files


def _split(rng: random.Random, split: str, sizes: dict, pools: dict) -> str:
    """Takes sizes[kind] questions from each (shuffled, then consumed) pool; a JSONL text."""
    rows = []
    for kind, n in sizes.items():
        pool = pools[kind]
        if len(pool) < n:
            raise ValueError(f"{NAME}: only {len(pool)} {kind} questions left for {split}, need {n}")
        rng.shuffle(pool)
        rows += [dict(q, kind=kind) for q in pool[:n]]
        pools[kind] = pool[n:]
    rng.shuffle(rows)
    return wg._jsonl([{"id": f"{NAME}-{split}-{i:04d}", "question": r["question"], "golden_answers": r["golden_answers"],
                       "data_source": NAME, "answerable": r["answerable"], "kind": r["kind"], "evidence": r["evidence"],
                       "entity": r["entity"], "relation": r["relation"]} for i, r in enumerate(rows)])


# ---------------------------------------------------------------- files on disk
def source_key(seed: int = SEED) -> str:
    """12 hex digits of sha256(the sources of world_gen.py, world_arith.py, world_mixed.py and
    this file, seed): the cache folder's key."""
    h = hashlib.sha256()
    for path in (Path(wg.__file__), Path(world_arith.__file__), Path(world_mixed.__file__), Path(__file__)):
        h.update(path.read_bytes())
    h.update(str(seed).encode())
    return h.hexdigest()[:12]


def ensure_files(root: str | Path, seed: int = SEED) -> Path:
    """The folder `root/world_large_<key>` holding every file of FILES (written now if missing)."""
    out = Path(root) / f"world_large_{source_key(seed)}"
    if all((out / f"{name}.jsonl").is_file() for name in FILES):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(generate(seed), tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write(files: dict[str, str], folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder to write the files to")
    p.add_argument("--seed", type=int, default=SEED)
    args = p.parse_args(argv)
    write(generate(args.seed), args.out)
    print(f"wrote {', '.join(f'{n}.jsonl' for n in FILES)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
