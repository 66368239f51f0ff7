"""The reward's format check for the `qwen` protocol (`calibration.chat_format`, grammar
"qwen" of `calibration.pieces`) and `car-jax eval mode=qwen`: episodes in Qwen's native
tool-call layout pass it turn by turn, the Search-R1 tag chain does not apply to them, an
invalid call (answered with the protocol's message) fails it, and the eval mode renders its
prompts with the tools listed and scores by that grammar."""
import json

import numpy as np
import pytest

from car_jax.calibration import parsing, pieces
from car_jax.calibration.chat_format import check_chat_turns, split_turns
from car_jax.calibration.rewards import reward_inputs
from car_jax.data import QAExample
from car_jax.eval import runner as ev
from car_jax.rollout.protocols import INVALID, Action, Qwen
from car_jax.rollout.trajectory import Trajectory
from tests.hf_factory import qwen_tokenizer
from tests.qwen_chat import qwen_tool_tokenizer

DOCS = 'Doc 1(Title: "Vegrei River") The Vegrei River is 812 miles long.'
RESULT = "Code execution result: 1306.8"


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SEARCH = "I should look this up.\n" + _call("search", {"query": "Vegrei River length"})
PYTHON = _call("python", {"code": "print(round(812 * 1.609344, 1))"})
FINAL = "The program gives it.\n<answer> 1306.8 km </answer>\n<confidence> 70 </confidence>"


def episode(*segments: str, results=(DOCS, RESULT)) -> list[tuple[str, bool]]:
    """Pieces of an episode: the model's segments, each but the last followed by the
    protocol's observation of its call (the tool's result, or the invalid message)."""
    out, p = [], Qwen()
    for k, seg in enumerate(segments):
        out.append((seg, True))
        if k < len(segments) - 1:
            action = p.parse(seg)
            out.append((p.observation(action, results[k % len(results)]), False))
    return out


# ---------------------------------------------------------------- the grammar, turn by turn
@pytest.mark.parametrize("turns", [
    [SEARCH, PYTHON, FINAL],
    [FINAL],
    ["<answer>x</answer><confidence>5</confidence>"],
    ["<think> a plan </think>\n" + SEARCH, "<|im_start|>assistant\n" + FINAL],  # markers are not the model's text
    [SEARCH + "\n  ", "  " + FINAL + "\n"],
], ids=["two_calls", "answer_only", "no_whitespace", "think_and_markers", "whitespace"])
def test_well_formed_turns_pass(turns):
    assert check_chat_turns(turns) == (True, "")


@pytest.mark.parametrize("turns,reason", [
    ([], "no turn"),
    ([SEARCH], "turn 1: tool_call, expected answer confidence"),
    ([SEARCH + PYTHON, FINAL], "turn 1: tool_call tool_call, expected tool_call (one call a turn)"),
    ([FINAL, FINAL], "turn 1: answer confidence, expected tool_call"),
    (["I know this. <answer> x </answer>"], "turn 1: answer, expected answer confidence"),
    ([FINAL + " Thanks!"], "turn 1: text after </confidence>"),
    ([SEARCH + " then more", FINAL], "turn 1: text after </tool_call>"),
    (["<answer> x </answer> so <confidence> 5 </confidence>"], "text between </answer> and <confidence>"),
    (["<answer>  </answer><confidence> 5 </confidence>"], "turn 1: empty answer"),
    (["<tool_call>\n\n</tool_call>", FINAL], "turn 1: empty tool_call"),
    (["<answer> x </answer><confidence> lots </confidence>"], "confidence does not parse"),
    (["<answer> x </answer><confidence> 130 </confidence>"], "confidence does not parse"),
    (["<search> q </search>", FINAL], "turn 1: search, expected tool_call"),
    ([SEARCH, "<tool_response> made up </tool_response>" + FINAL], "turn 2: tool_response answer confidence"),
    (["<tool_call> {} ", FINAL], "turn 1: <tool_call> is not closed"),
    (["</answer>" + FINAL], "turn 1: unexpected </answer>"),
    (["<answer> <confidence> 5 </confidence> </answer>"], "turn 1: nested tag inside <answer>"),
])
def test_malformed_turns_fail_with_their_reason(turns, reason):
    ok, why = check_chat_turns(turns)
    assert not ok and reason in why


def test_a_whole_text_splits_at_each_tool_response():
    """A response read whole (no pieces) is cut at the protocol's observations, turn markers
    kept or dropped, into the model's turns."""
    p = Qwen()
    text = SEARCH + p.observation(Action("search", "q"), DOCS) + PYTHON + p.observation(Action("code", "c"), RESULT) \
        + FINAL
    assert split_turns(text) == [SEARCH, PYTHON, FINAL]
    bare = text.replace("<|im_end|>", "").replace("<|im_start|>user", "").replace("<|im_start|>assistant", "")
    assert [t.strip() for t in split_turns(bare)] == [SEARCH, PYTHON, FINAL]
    assert pieces.parse_pieces(text, "qwen").format_ok and pieces.parse_pieces(bare, "qwen").format_ok


# ---------------------------------------------------------------- the reward's grammar
def test_an_invalid_call_fails_the_format_though_its_turns_look_right():
    """The protocol answered the call with its message (unknown tool): no `<tool_response>`
    came back, so the episode fails the format, as an invalid action fails the tag chain."""
    bad = _call("calculator", {"expression": "812 * 1.6"})
    assert Qwen().parse(bad) == Action(INVALID)
    parsed = pieces.parse_pieces(episode(SEARCH, bad, FINAL), "qwen")
    assert not parsed.format_ok and "turn 2: not a valid tool call" in parsed.reason
    assert (parsed.answer, parsed.q) == ("1306.8 km", pytest.approx(0.7))  # the answer is still read
    assert check_chat_turns([SEARCH, bad, FINAL])[0]  # the text alone cannot tell


def test_the_grammar_follows_the_protocol_in_the_reward():
    """The same qwen-layout episodes: the "qwen" grammar passes the well-formed ones and the
    tag chain passes none (it wants <think>/<search>); correctness and q do not depend on
    the grammar. A tag-layout episode fails the "qwen" grammar (its <information> piece is
    no tool response)."""
    good = [episode(SEARCH, PYTHON, FINAL), episode(FINAL), episode(SEARCH, FINAL)]
    bad = [episode(SEARCH, FINAL + " ok"), episode(SEARCH, _call("search", {}), FINAL), [(SEARCH, True)]]
    tagged = [("<think> t </think>\n<search> q </search>", True), ("\n\n<information>d</information>\n\n", False),
              ("<think> t </think>\n<answer> 1306.8 km </answer>\n<confidence> 70 </confidence>", True)]
    responses = good + bad + [tagged]
    golds = [["1306.8 km"]] * len(responses)
    qwen = reward_inputs(responses, golds, grammar="qwen")
    tags = reward_inputs(responses, golds, grammar="tags")
    assert np.asarray(qwen.format_ok).tolist() == [True] * 3 + [False] * 4
    assert np.asarray(tags.format_ok).tolist() == [False] * 6 + [True]
    np.testing.assert_array_equal(qwen.correct, tags.correct)
    np.testing.assert_array_equal(qwen.q, tags.q)
    assert np.asarray(qwen.correct).tolist() == [True] * 5 + [False, True]
    with pytest.raises(ValueError, match="unknown format grammar 'json'.*'tags', 'qwen'"):
        pieces.parse_pieces(FINAL, "json")


@pytest.mark.parametrize("text", [
    "<think> a </think>\n<answer> b </answer>\n<confidence> 60 </confidence>",
    "<think> a </think>\n<search> q </search>\n\n<information>d</information>\n\n<think> c </think>\n"
    "<answer> b </answer>\n<confidence> 60 </confidence>",
    "<answer> b </answer>", "no tags at all", "<think> a </think>\n<answer> b </answer>\n<confidence> 6O </confidence>",
])
def test_a_plain_string_under_the_tag_grammar_is_parsed_as_before(text):
    """A string of unknown origin with the default grammar: what `parsing.parse_response`
    (the parser of whole responses) gives."""
    assert pieces.parse_pieces(text) == parsing.parse_response(text)


# ---------------------------------------------------------------- car-jax eval mode=qwen
def _examples():
    return [QAExample(f"q{i}", f"Question number {i}?", (f"answer {i}",), "toy", f"q{i}") for i in range(4)]


def test_eval_mode_qwen_renders_the_tools_and_scores_by_turns(monkeypatch, tmp_path):
    tok = qwen_tool_tokenizer()
    seen = []
    answers = {0: "answer 0", 1: "answer 1", 2: "wrong", 3: "answer 3"}

    def fake(model, tokenizer, prompts, tools, *, config, protocol, seed, stats):
        assert isinstance(protocol, Qwen) and tokenizer is tok
        out = []
        for prompt in prompts:
            seen.append(prompt)
            i = int(prompt.split("Question number ")[1][0])
            final = f"<answer> {answers[i]} </answer>\n<confidence> {20 * (i + 1)} </confidence>"
            middle = _call("calculator", {"x": 1}) if i == 3 else PYTHON  # 3: an invalid call
            t = Trajectory(prompt_ids=[1])
            t.pieces = episode(SEARCH, middle, final)
            t.n_turns, t.n_tool_calls, t.answered = 3, 1 if i == 3 else 2, True
            out.append(t)
        return out

    monkeypatch.setattr(ev, "run_episodes", fake)
    summary = ev.evaluate(None, tok, _examples(), ev.EvalOptions(mode="qwen", batch_size=3, n_boot=0),
                          tools={"search": len, "code": len}, out_dir=tmp_path)
    # the prompts: the qwen template's messages rendered by the chat template with both tools
    assert len(seen) == 4
    for i, prompt in enumerate(seen):
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
        assert "<tools>" in prompt and '"name": "search"' in prompt and '"name": "python"' in prompt
        assert f"Question number {i}?" in prompt
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["format_ok"] for r in records] == [True, True, True, False]
    assert [r["correct"] for r in records] == [True, True, False, True]
    assert [r["confidence"] for r in records] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert "not a valid tool call" in records[3]["format_reason"]
    assert summary["n"] == 4


def test_eval_mode_qwen_refuses_a_tokenizer_without_native_tools(tmp_path):
    with pytest.raises(ValueError, match="car-jax eval mode='qwen' writes native tool calls.*Qwen2.5 / Qwen3 Instruct"):
        ev.evaluate(None, qwen_tokenizer(), _examples(), ev.EvalOptions(mode="qwen", n_boot=0),
                    tools={"search": len, "code": len}, out_dir=tmp_path)
