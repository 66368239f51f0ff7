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


@pytest.mark.parametrize("pred, golds, f1", [
    ("Paris", ["Paris"], 1.0),
    ("Paris France", ["Paris"], 2 * 0.5 * 1.0 / 1.5),  # p = 1/2, r = 1 -> 2/3
    ("the big red dog", ["a red dog barks"], 2 * (2 / 3) * (2 / 3) / (4 / 3)),  # 3 vs 3 tokens, 2 shared
    ("x y", ["z", "y w"], 0.5),  # max over golds: second gives p = r = 1/2
    ("dog dog", ["dog"], 2 * 0.5 * 1.0 / 1.5),  # counts, not sets: one shared token
    ("", ["Paris"], 0.0),
    ("the", ["a"], 1.0),  # both empty after normalization
    ("Paris", [], 0.0),
])
def test_token_f1(pred, golds, f1):
    assert parsing.token_f1(pred, golds) == pytest.approx(f1)


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
