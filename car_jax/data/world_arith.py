"""Arithmetic word problems over the large world's facts (`car_jax.data.world_large`), for
the code tool (the `tir` mode). Each problem states its numbers, which are world facts that
the evidence docs also state; the answer is exact (an integer, or a terminating decimal).

Operations (OPS):
    years_between     |founded(a) - founded(b)| of two towns
    total_length      the sum of three rivers' lengths
    age_at_invention  an invention's year - its inventor's birth year
    mean_height       the mean height of 2 or 4 mountains
    line_lowered      k * (depth(a) + depth(b)) of two lakes, k in 2..6 (stated in the problem)
    ascent_hours      a mountain's height / v metres per hour, v stated in the problem

`program(op, problem)` writes the short Python program that computes a problem's answer
from the numbers its text states (the mixed SFT demonstrations run it with the code tool).
"""
from __future__ import annotations

import random
import re
from decimal import Decimal
from fractions import Fraction

OPS = ("years_between", "total_length", "age_at_invention", "mean_height", "line_lowered", "ascent_hours")


def number(x: Fraction) -> str:
    """An exact number as text: "12", "-3", "7.5525" (x must have a terminating decimal)."""
    if x.denominator == 1:
        return str(x.numerator)
    d = Decimal(x.numerator) / Decimal(x.denominator)
    if Fraction(d) != x:
        raise ValueError(f"{x} has no short terminating decimal")
    return format(d.normalize(), "f")


# op -> (how many numbers its text states, in order; the program over them, `n` their list)
PROGRAMS = {
    "years_between": (2, "a, b = {n[0]}, {n[1]}\nprint(abs(a - b))"),
    "total_length": (3, "lengths = [{n[0]}, {n[1]}, {n[2]}]\nprint(sum(lengths))"),
    "age_at_invention": (2, "born, shown = {n[0]}, {n[1]}\nprint(shown - born)"),
    "mean_height": (None, "heights = [{heights}]\nmean = sum(heights) / len(heights)\n"
                          "print(mean if mean % 1 else int(mean))"),
    "line_lowered": (3, "depths = [{n[0]}, {n[1]}]\nprint({n[2]} * sum(depths))"),
    "ascent_hours": (2, "hours = {n[0]} / {n[1]}\nprint(hours if hours % 1 else int(hours))"),
}


def program(op: str, problem: str) -> str:
    """The Python program that prints the answer of a word problem of `op` (the numbers
    read from its text, in the order `word_problems` writes them; mean_height's last number
    is the count of mountains). ValueError for an unknown op or a text whose numbers do not fit."""
    if op not in PROGRAMS:
        raise ValueError(f"unknown arithmetic op {op!r}; choose one of {', '.join(OPS)}")
    count, code = PROGRAMS[op]
    n = re.findall(r"\d+", problem)
    if op == "mean_height":  # the heights, then how many there are
        count = int(n[-1]) + 1 if n else 0
    if not n or len(n) != count:
        raise ValueError(f"{op} problem {problem!r} states the numbers {n}, not the ones a {op} problem states")
    return code.format(n=n, heights=", ".join(n[:-1]))


def word_problems(rng: random.Random, world: dict, hidden: dict, doc_of: dict, n: int) -> list[dict]:
    """`n` distinct word problems, shuffled, cycling through OPS; rows {"problem", "answer",
    "kind": "arith", "op", "answerable", "evidence": [doc ids of the entities used]}.
    world: kind -> entity dicts (`world_large`'s); hidden: entity name -> the fact its doc
    leaves out (never used here); doc_of: entity name -> doc id."""
    def pick(kind, n, *facts):
        ok = [e for e in world[kind] if hidden.get(e["name"]) not in facts]
        return rng.sample(ok, n)

    def make(op):
        if op == "years_between":
            a, b = pick("town", 2, "founded")
            text = (f"The town of {a['name']} was founded in {a['founded']} and the town of {b['name']} in "
                    f"{b['founded']}. How many years passed between the two foundings?")
            return text, Fraction(abs(a["founded"] - b["founded"])), [a, b]
        if op == "total_length":
            rs = pick("river", 3, "length")
            legs = ", then the whole ".join(f"{r['name']} ({r['length']} km)" for r in rs)
            text = f"A boat travels the whole {legs}. How many kilometres does it travel in all?"
            return text, Fraction(sum(r["length"] for r in rs)), rs
        if op == "age_at_invention":
            inv = pick("invention", 1, "inventor", "year")[0]
            p = next(x for x in world["person"] if x["name"] == inv["inventor"])
            if hidden.get(p["name"]) == "born":
                return None
            first = p["name"].split()[0]
            text = (f"{p['name']} was born in {p['born']}. The {inv['name']}, which {first} devised, was first "
                    f"demonstrated in {inv['year']}. How many years after {first}'s birth was that?")
            return text, Fraction(inv["year"] - p["born"]), [p, inv]
        if op == "mean_height":
            ms = pick("mountain", rng.choice((2, 4)), "height")
            listed = "; ".join(f"{m['name']} rises {m['height']} metres" for m in ms)
            text = f"{listed}. What is the mean height of these {len(ms)} mountains, in metres?"
            return text, Fraction(sum(m["height"] for m in ms), len(ms)), ms
        if op == "line_lowered":
            a, b = pick("lake", 2, "depth")
            k = rng.randint(2, 6)
            text = (f"A survey team lowers a line to the bottom of {a['name']}, {a['depth']} metres deep, and to the "
                    f"bottom of {b['name']}, {b['depth']} metres deep, {k} times each. How many metres of line do "
                    "they lower in all?")
            return text, Fraction(k * (a["depth"] + b["depth"])), [a, b]
        m = pick("mountain", 1, "height")[0]  # ascent_hours
        v = rng.choice((125, 200, 250, 400, 500))
        text = (f"Climbers go from sea level to the top of {m['name']}, which rises {m['height']} metres, at {v} "
                "metres per hour. How many hours does the climb take?")
        return text, Fraction(m["height"], v), [m]

    out, seen = [], set()
    while len(out) < n:
        op = OPS[len(out) % len(OPS)]
        made = make(op)
        if made is None or made[0] in seen:
            continue
        text, answer, used = made
        seen.add(text)
        out.append({"problem": text, "answer": number(answer), "kind": "arith", "op": op, "answerable": True,
                    "evidence": [doc_of[e["name"]] for e in used]})
    rng.shuffle(out)
    return out
