"""Host parsing: answer / confidence extraction, the format chain, EM / F1 / math equivalence."""
import pytest

from car_jax.calibration import parsing

GOOD = (
    "<think>I should look it up.</think>\n<search>capital of France</search>\n"
    "<information>Doc 1(Title: Paris) Paris is the capital.</information>\n"
    "<think>It is Paris.</think>\n<answer>Paris</answer>\n<confidence>85</confidence>"
)


@pytest.mark.parametrize("content, q, ok", [
    ("85", 0.85, True),
    ("85%", 0.85, True),
    ("85 %", 0.85, True),
    (" 85.0 ", 0.85, True),
    ("85.", 0.85, True),
    (".5", 0.005, True),
    ("0.85", 0.0085, True),  # the scale is 0..100: 0.85 means 0.85 %, not 85 %
    ("0", 0.0, True),
    ("100", 1.0, True),
    ("100.0%", 1.0, True),
    ("100.5", 0.0, False),
    ("250", 0.0, False),
    ("-3", 0.0, False),
    ("-0", 0.0, False),
    ("+5", 0.0, False),
    ("1e309", 0.0, False),
    ("1e1", 0.0, False),
    ("NaN", 0.0, False),
    ("nan", 0.0, False),
    ("inf", 0.0, False),
    ("", 0.0, False),
    ("high", 0.0, False),
    ("85/100", 0.0, False),
    ("80 90", 0.0, False),
    ("1" + "0" * 400, 0.0, False),  # finite regex match, float overflows to inf
])
def test_confidence_table(content, q, ok):
    got_q, got_ok = parsing.parse_confidence(f"<answer>x</answer><confidence>{content}</confidence>")
    assert got_ok is ok
    assert got_q == pytest.approx(q, abs=1e-12)


@pytest.mark.parametrize("content", [
    "\u0668\u0665",  # Arabic-Indic 85
    "\u06f8\u06f5",  # Extended Arabic-Indic (Persian) 85
    "\uff18\uff15",  # fullwidth 85
    "\uff18\uff15%",
    "8\u0665",  # one ASCII digit, one Arabic-Indic
    "\U0001d7d6\U0001d7d3",  # mathematical bold 85
    "\u0968\u0966.5",  # Devanagari 20.5
])
def test_confidence_takes_only_ascii_digits(content):
    assert float(content.rstrip("%")) > 0  # Python reads these digits: the parser must not
    assert parsing.parse_confidence(f"<confidence>{content}</confidence>") == (0.0, False)
    ascii_digits = "".join(str(int(c)) if c.isdigit() else c for c in content)
    assert parsing.parse_confidence(f"<confidence>{ascii_digits}</confidence>")[1]


@pytest.mark.parametrize("text, q, ok", [
    ("<answer>x</answer><confidence>70", 0.0, False),  # missing closing tag
    ("<answer>x</answer>", 0.0, False),  # missing tag
    ("<confidence>10</confidence><confidence>70</confidence>", 0.7, True),  # last one wins
    ("<confidence>10<confidence>70</confidence>", 0.7, True),  # innermost pair
])
def test_confidence_tags(text, q, ok):
    assert parsing.parse_confidence(text) == (pytest.approx(q), ok)


@pytest.mark.parametrize("text, answer", [
    ("<answer>Paris</answer>", "Paris"),
    ("<answer> Paris \n</answer>", "Paris"),
    ("<answer>Lyon</answer> ... <answer>Paris</answer>", "Paris"),  # two answers: the last
    ("<answer>a<answer>b</answer>c</answer>", "b"),  # nested: the innermost pair
    ("<answer>Paris", None),  # missing closing tag
    ("<answer>Lyon</answer><answer>Paris", "Lyon"),  # unclosed last one is not an answer
    ("Paris", None),
    ("</answer>Paris<answer>", None),
])
def test_answer_table(text, answer):
    assert parsing.last_tag_content(text, "answer") == answer


def test_good_chain_passes():
    assert parsing.check_format(GOOD) == (True, "")
    direct = "<think>easy</think><answer>4</answer><confidence>99%</confidence>\n"
    assert parsing.check_format(direct) == (True, "")
    p = parsing.parse_response(GOOD)
    assert (p.answer, p.q, p.confidence_ok, p.format_ok) == ("Paris", 0.85, True, True)


@pytest.mark.parametrize("text, reason_part", [
    ("<answer>Paris</answer><confidence>85</confidence>", "not allowed after start"),
    ("<think>a</think><answer>P</answer>", "ends after answer"),
    ("<think>a</think><answer>P</answer><confidence>85</confidence>extra", "after </confidence>"),
    ("<think>a</think>chatter<answer>P</answer><confidence>8</confidence>", "outside blocks"),
    ("<think>a</think><answer>P</answer><answer>Q</answer><confidence>8</confidence>",
     "not allowed after answer"),  # two answers
    ("<think>a <answer>P</answer></think><answer>P</answer><confidence>8</confidence>",
     "nested"),
    ("<think>a</think><answer>P<confidence>8</confidence></answer>", "nested"),
    ("<think>a</think><answer>P</answer><confidence>85", "not closed"),
    ("<think>a</think><answer>P</answer><confidence>-3</confidence>", "confidence"),
    ("<think>a</think><answer>P</answer><confidence>NaN</confidence>", "confidence"),
    ("<think>a</think><answer> </answer><confidence>50</confidence>", "empty answer"),
    ("<think>a</think><search> </search><information>d</information>", "empty search"),
    ("<think>a</think><search>q</search><think>b</think><answer>P</answer>"
     "<confidence>5</confidence>", "not allowed after search"),  # no observation
    ("<think>a</think><search>q</search><information>d</information><answer>P</answer>"
     "<confidence>5</confidence>", "not allowed after information"),  # no think after it
    ("</think><answer>P</answer><confidence>5</confidence>", "unexpected"),
    ("", "ends after start"),
])
def test_bad_chains_fail(text, reason_part):
    ok, reason = parsing.check_format(text)
    assert not ok
    assert reason_part in reason


PROMPT = ("<|im_start|>user\nAnswer inside <answer> and </answer>, then give your confidence "
          "0-100 as <confidence>90</confidence>. Question: capital of France?<|im_end|>\n"
          "<|im_start|>assistant\n")


def test_prompt_echo_is_cut_off():
    full = PROMPT + GOOD
    response = parsing.strip_prompt(full, PROMPT)
    assert response == GOOD
    assert parsing.parse_response(response).format_ok
    # Parsing the prompt with it would fail the format (the prompt's tags are stray text) ...
    assert not parsing.check_format(full)[0]
    # ... and with a response that gave no confidence, the echoed 90 would be read.
    assert parsing.parse_confidence(PROMPT + "<answer>Paris</answer>") == (0.9, True)
    assert parsing.parse_confidence("<answer>Paris</answer>") == (0.0, False)
    with pytest.raises(ValueError):
        parsing.strip_prompt(GOOD, PROMPT)


@pytest.mark.parametrize("pred, golds, em", [
    ("The Eiffel Tower!", ["eiffel tower"], True),
    ("an apple", ["Apple", "pear"], True),
    ("  Paris,  France ", ["paris france"], True),
    ("Paris", ["London", "paris"], True),
    ("Paris France", ["Paris"], False),
    ("theatre", ["atre"], False),  # articles are dropped as words only
    ("", ["the"], True),  # both normalize to ""
    ("Paris", [], False),
])
def test_exact_match(pred, golds, em):
    assert parsing.exact_match(pred, golds) is em


def test_normalize_answer():
    assert parsing.normalize_answer("  The  U.S.A.'s   capital, a city ") == "usas capital city"


@pytest.mark.parametrize("text, boxed", [
    ("so \\boxed{3} and finally \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{x^{2}}", "x^{2}"),
    ("\\boxed{1} then \\boxed{2", "1"),  # unbalanced last one: fall back to an earlier one
    ("no box", None),
])
def test_last_boxed(text, boxed):
    assert parsing.last_boxed(text) == boxed


@pytest.mark.parametrize("pred, golds, equal", [
    ("the answer is \\boxed{0.5}", ["\\frac{1}{2}"], True),
    ("\\boxed{3} no wait \\boxed{\\frac12}", ["1/2"], True),  # last box counts
    ("\\boxed{\\frac12} no wait \\boxed{3}", ["1/2"], False),
    ("\\boxed{\\sqrt{12}}", ["$2\\sqrt{3}$"], True),
    ("\\boxed{204}", ["\\boxed{204}"], True),
    ("\\boxed{203}", ["204"], False),
    ("204", ["7", "204"], True),  # no box: the whole prediction; any gold
    ("\\boxed{}", ["0"], False),
    ("", ["0"], False),
])
def test_math_equal(pred, golds, equal):
    assert parsing.math_equal(pred, golds) is equal


def _last_boxed_before_the_fix(text):
    """The quadratic last_boxed that the linear one replaced: the reference semantics."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j].strip()
        start = text.rfind("\\boxed{", 0, start)
    return None


BOX_CASES = [
    "", "\\boxed{", "\\boxed{}", "\\boxed{ a }", "}\\boxed{a}}", "\\boxed{a{b}c}d}",
    "\\boxed{a} \\boxed{b", "\\boxed{a \\boxed{b}", "\\boxed{a \\boxed{b} c}", "\\boxed{{}", "\\boxed{{}}}",
    "\\boxed{1} and \\boxed{2{3}", "{\\boxed{x}", "\\boxed x", "\\boxed{\\frac{1}{2}} \\boxed{",
    "\\boxed\\boxed{7}", "\\boxed{\\boxed{\\boxed{}}", "\\boxed{ \u00a0x\n}",
]


def test_last_boxed_equals_the_old_implementation():
    import random

    rng = random.Random(0)
    pieces = ["\\boxed{", "\\boxed", "{", "}", "}", "a", " ", "x^{2}", "\\frac{1}{2}", "\\", "\n"]
    texts = BOX_CASES + ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 25))) for _ in range(3000)]
    for text in texts:
        assert parsing.last_boxed(text) == _last_boxed_before_the_fix(text), text
    assert sum(parsing.last_boxed(t) is not None for t in texts) > 1000  # both outcomes are exercised
    assert sum(parsing.last_boxed(t) is None for t in texts) > 300


def _lines_run(fn, text, budget):
    """Python lines `fn` executes on `text` (sys.settrace), stopping past `budget`: a
    machine-independent count of the work done, unlike a wall-clock time."""
    import sys

    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > budget:
                raise RuntimeError(f"more than {budget} lines run")
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local if frame.f_code is fn.__code__ else None)
    try:
        result = fn(text)
    finally:
        sys.settrace(previous)
    return result, count


@pytest.mark.parametrize("make, expected", [
    (lambda n: "\\boxed{" * n, None),  # every box unbalanced: the old code rescanned to the end from each
    (lambda n: "\\boxed{a}" + "\\boxed{" * n, "a"),
    (lambda n: "\\boxed{" + "{" * n, None),
    (lambda n: ("\\boxed{" + "{") * n + "}", None),
    (lambda n: "}" * n + "\\boxed{" * n + "}", ""),
    (lambda n: "\\boxed{" + "{}" * n, None),
])
def test_last_boxed_is_linear(make, expected):
    """The work grows with len(text), not its square: at most 8 Python lines per character
    (a brace costs at most 6), on hostile inputs of 1x and 8x the size (7 KB and 56 KB for the
    first); the old scan ran ~len**2 / 7 lines (~7 M on 7 KB) and stops here at the budget."""
    for n in (1000, 8000):
        text = make(n)
        result, lines = _lines_run(parsing.last_boxed, text, budget=8 * len(text) + 100)
        assert result == expected
    # and a 210 KB hostile input (149 s for 112 KB before the fix) returns at all
    assert parsing.last_boxed("\\boxed{b}" + "\\boxed{" * 30_000) == "b"


def _last_tag_content_before_the_fix(text, tag):
    """The quadratic last_tag_content that the linear one replaced: the reference semantics."""
    open_, close = f"<{tag}>", f"</{tag}>"
    end = text.rfind(close)
    while end != -1:
        start = text.rfind(open_, 0, end)
        if start != -1 and text.rfind(close, start, end) == -1:
            return text[start + len(open_):end].strip()
        end = text.rfind(close, 0, end)
    return None


def test_last_tag_content_equals_the_old_implementation(monkeypatch):
    import random

    rng = random.Random(0)
    tags = [f"<{t}>" for t in parsing.TAGS] + [f"</{t}>" for t in parsing.TAGS]
    # whole tags (mostly answer / confidence), halves that join into tags across pieces, text
    pieces = tags + ["<answer>", "</answer>", "<confidence>", "</confidence>"] * 3 + [
        "<", "</", "answer>", "confidence>", "<answer", "</answer >", "<Answer>", "x", " 85 ", "\n", ">",
        "<answer>P</answer>", "<confidence>70</confidence>"]
    texts = [GOOD, GOOD * 3, ""] + [
        "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30))) for _ in range(4000)]
    new = [parsing.parse_response(t) for t in texts]
    for text in texts:
        for tag in parsing.TAGS:
            assert parsing.last_tag_content(text, tag) == _last_tag_content_before_the_fix(text, tag), (text, tag)
    monkeypatch.setattr(parsing, "last_tag_content", _last_tag_content_before_the_fix)
    assert new == [parsing.parse_response(t) for t in texts]  # every field, answer and confidence included
    answers = [p.answer for p in new]  # both outcomes, and nested / repeated tags, are exercised
    assert sum(a is None for a in answers) > 1000 and sum(a is not None for a in answers) > 1000
    assert sum(p.confidence_ok for p in new) > 500


class _Scanned(str):
    """A str that counts the characters its find / rfind calls read: a call that finds the
    tag at i reads [i, end) (rfind) or [start, i + len(tag)) (find), one that does not reads
    the whole [start, end). So the count is the work of the searches, with no clock involved."""
    read = 0

    def _span(self, start, end):
        start = 0 if start is None else start
        end = len(self) if end is None else end
        return max(start, 0), max(min(end, len(self)), 0)

    def rfind(self, sub, start=None, end=None):
        i = str.rfind(self, sub, *(x for x in (start, end) if x is not None))
        lo, hi = self._span(start, end)
        _Scanned.read += hi - (i if i != -1 else lo)
        return i

    def find(self, sub, start=None, end=None):
        i = str.find(self, sub, *(x for x in (start, end) if x is not None))
        lo, hi = self._span(start, end)
        _Scanned.read += (i + len(sub) if i != -1 else hi) - lo
        return i


@pytest.mark.parametrize("make", [
    lambda n: "</answer>" * n,  # every closing tag searched back to the start before the fix
    lambda n: "<answer><confidence>" + "</answer> x </confidence>" * n,
    lambda n: "<answer>x" * n + "</answer>" * n + "<confidence>",
])
def test_last_tag_content_reads_each_character_a_bounded_number_of_times(make):
    """The searches of `last_tag_content` read at most 3 characters per character of text, at
    4,000 and at 64,000 repeats of a tag-heavy pattern (the scan before the fix read each
    stretch again for every closing tag after it: 0.037 s -> 0.33 s for 4,000 -> 16,000
    closing tags, 13 s on 1 MB of them)."""
    for n in (4000, 64_000):
        text = _Scanned(make(n))
        for tag in ("answer", "confidence"):
            _Scanned.read = 0
            got = parsing.last_tag_content(text, tag)
            if n == 4000:  # the same result as before the fix (which takes seconds at 64,000)
                assert got == _last_tag_content_before_the_fix(str(text), tag)
            assert _Scanned.read <= 3 * len(text), (tag, n, _Scanned.read / len(text))
