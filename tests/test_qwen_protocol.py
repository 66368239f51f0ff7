"""The `qwen` protocol (native tool calls of Qwen2.5 / Qwen3 Instruct): parsing of
`<tool_call>` JSON, observations in Qwen's chat layout, the prompt rendered with `tools=`,
and scripted episodes, tokenized with the real Qwen2/2.5 vocabulary and a Qwen2.5-layout
chat template (`tests/qwen_chat.py`), that equal the chat template's rendering of the same
conversation token for token, with a loss mask over exactly the model-written tokens.

The episodes are scripted on the host (no model): each segment is tokenized as the model
would have written it and goes through the engine's own steps (`Engine._take_output` /
`_observe`): `Trajectory.add`, `parse` of the segment decoded with special tokens skipped,
`run_tools`, `wrap`, `observation_ids`."""
import json
import re

import numpy as np
import pytest

from car_jax.calibration import pieces
from car_jax.config import ConfigError, load_config
from car_jax.data import make_prompt
from car_jax.data.chat_tools import check_tool_template, read_call, tool_prompts, tool_schemas
from car_jax.rollout import protocols
from car_jax.rollout.protocols import ANSWER, INVALID, Action, Qwen
from car_jax.rollout.stops import matches
from car_jax.rollout.tool_calls import run_tools
from car_jax.rollout.toolbox import tool_names
from car_jax.rollout.trajectory import Trajectory, observation_ids
from car_jax.tools.python_tool import PythonTool
from car_jax.tools.sandbox import SandboxConfig
from tests.hf_factory import qwen_tokenizer
from tests.qwen_chat import QWEN25_TOOLS_TEMPLATE, TOOL_TAGS, qwen_tool_tokenizer

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
KINDS = ("search", "code")
QUESTION = "How long is the Vegrei River in kilometres?"
QUERY, CODE = "Vegrei River length", "miles = 812\nprint(round(miles * 1.609344, 1))"
DOCS = 'Doc 1(Title: "Vegrei River") The Vegrei River is 812 miles long.\n'
FINAL = "<answer> 1306.8 km </answer>\n<confidence> 70 </confidence>"
END = "<|im_end|>\n"  # the end of the model's last turn in a rendering: the episode stops before it


@pytest.fixture(scope="module")
def tok():
    return qwen_tool_tokenizer()


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _call(name: str, arguments: dict) -> str:
    """A tool call as the model writes it (the layout the chat template renders)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def _assistant(content: str, name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def scripted_episode(tok, segments, tools, budget: int = 500) -> Trajectory:
    """One episode whose segments are `segments` (texts the model writes, in order), run
    through the engine's host steps; the prompt is the `qwen` template rendered with tools."""
    protocol = Qwen()
    [prompt] = tool_prompts(tok, [make_prompt(QUESTION, "qwen")], KINDS)
    traj = Trajectory(_ids(tok, prompt))
    for segment in segments:
        ids = _ids(tok, segment)
        _assert_stops_at_its_end(tok, ids, protocol.stops)
        traj.add(ids, np.zeros(len(ids)))
        traj.n_turns += 1
        action = protocol.parse(tok.decode(ids, skip_special_tokens=True))
        if action.kind == ANSWER:
            traj.answered = True
            break
        results = run_tools({0: action}, tools, 10.0, [traj])
        parts = protocol.wrap(action, results.get(0, ""))
        traj.add(observation_ids(tok, parts, budget), sampled=False)
        traj.observations.append("".join(parts))
    traj.pieces = traj.decode_pieces(tok)
    return traj


def _assert_stops_at_its_end(tok, ids, stops):
    """The segment's stop pattern completes at its last token and at no earlier one (what
    the stop automata decide on device, checked with their host reference)."""
    fired = [any(matches(tok.decode(ids[: k + 1]), s) for s in stops) for k in range(len(ids))]
    assert fired[-1] and not any(fired[:-1]), tok.decode(ids)


def _recording(log: list, reply):
    def tool(requests):
        log.extend(requests)
        return [reply(r) for r in requests]
    return tool


# ---------------------------------------------------------------- parsing and observations
def test_calls_parse_into_the_tools_actions():
    p = Qwen()
    assert p.parse("Let me look.\n" + _call("search", {"query": "  Vegrei River  "})) == Action("search", "Vegrei River")
    assert p.parse(_call("python", {"code": CODE})) == Action("code", CODE)  # the program as written
    assert p.parse(FINAL) == Action(ANSWER, "1306.8 km")
    # the first complete action decides; an unclosed call does not count
    assert p.parse(_call("search", {"query": "a"}) + "\n" + FINAL).kind == "search"
    assert p.parse("<answer> 3 </answer> " + _call("search", {"query": "a"})).kind == ANSWER
    assert p.parse('<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n' + FINAL).kind == ANSWER
    assert protocols.PROTOCOLS["qwen"] == (Qwen, "mixed") and tool_names("mixed") == KINDS
    assert p.stops == ("</tool_call>", "</confidence>") and p.final_stops == ("</confidence>",)


@pytest.mark.parametrize("body", [
    '{"name": "search", "arguments": {"query": "a"}',  # bad JSON
    "search: a", "", "[]", '"search"',
    '{"name": "calculator", "arguments": {"expression": "2 + 2"}}',  # unknown tool
    '{"name": "search", "arguments": {}}',  # missing argument
    '{"name": "search", "arguments": {"query": "a", "topk": 3}}',  # extra argument
    '{"name": "search", "arguments": {"code": "print(1)"}}',  # the other tool's argument
    '{"name": "search", "arguments": {"query": 7}}',  # mistyped
    '{"name": "search", "arguments": {"query": "  "}}',  # blank
    '{"name": "python", "arguments": "print(1)"}',  # arguments not an object
    '{"name": "search", "arguments": {"query": "a"}, "id": 1}',  # extra key
    '{"arguments": {"query": "a"}}', '{"name": ["search"], "arguments": {"query": "a"}}',
])
def test_malformed_calls_are_invalid(body):
    assert read_call(body) is None
    assert Qwen().parse(f"<tool_call>\n{body}\n</tool_call>") == Action(INVALID)


def test_observations_follow_qwens_chat_layout(tok):
    p = Qwen()
    head, body, tail = p.wrap(Action("search", "q"), DOCS)
    assert (head, body, tail) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n", DOCS.strip(),
                                  "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert p.observation(Action(INVALID), "") == f"<|im_end|>\n<|im_start|>user\n{p.invalid_message}<|im_end|>\n" \
                                                 "<|im_start|>assistant\n"
    assert not re.search(r"</?\w+>", p.invalid_message)  # no tag the parser would read as the model's
    assert not p.ends_episode(p.observation(Action("code", "x"), "\\boxed{7}"))
    # a long result is cut inside the wrapper: the turn layout survives the budget
    parts = p.wrap(Action("search", "q"), "word " * 400)
    ids = observation_ids(tok, parts, 40)
    tail_ids = _ids(tok, parts[2])
    assert len(ids) == 40 and ids[: len(_ids(tok, parts[0]))] == _ids(tok, parts[0]) and ids[-len(tail_ids):] == tail_ids


# ---------------------------------------------------------------- the prompt
def test_prompt_lists_the_tools_through_the_chat_template(tok):
    messages = make_prompt(QUESTION, "qwen")
    [text] = tool_prompts(tok, [messages], KINDS)
    assert text == tok.apply_chat_template(messages, tools=tool_schemas(KINDS), tokenize=False,
                                           add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n" + messages[0]["content"] + "\n\n# Tools")
    assert text.endswith(f"Question: {QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    for schema in tool_schemas(KINDS):
        assert json.dumps(schema) in text
    assert [s["function"]["name"] for s in tool_schemas(KINDS)] == ["search", "python"]
    assert "<answer>" in messages[0]["content"] and "<confidence>" in messages[0]["content"]
    with pytest.raises(ValueError, match=r"no chat tool for the action kinds \['web'\]"):
        tool_schemas(("web",))


def test_a_tokenizer_without_native_tools_is_refused():
    bare = qwen_tokenizer()  # the vocabulary alone: no chat template
    with pytest.raises(ValueError, match="no chat template.*'qwen'.*Qwen2.5 / Qwen3 Instruct tokenizer"):
        check_tool_template(bare, KINDS)
    # a ChatML template that never reads `tools`
    bare.chat_template = QWEN25_TOOLS_TEMPLATE.replace("{%- if tools %}", "{%- if false %}")
    with pytest.raises(ValueError, match=r"ignores tools=.*\['search', 'python'\].*'qwen'.*Instruct"):
        tool_prompts(bare, [make_prompt(QUESTION, "qwen")], KINDS)


def test_training_setup_refuses_such_a_tokenizer(monkeypatch):
    """`car-jax train` with rollout.protocol=qwen checks the tokenizer before building anything."""
    import car_jax.train.setup as setup
    from car_jax.train.config import TrainConfig

    monkeypatch.setattr(setup, "load_policy", lambda cfg, mesh: (None, qwen_tokenizer()))
    cfg = load_config(TrainConfig, ROOT / "configs" / "tiny_test.yaml", ["rollout.protocol=qwen", "data.template=qwen"])
    with pytest.raises(ConfigError, match="model.path: this tokenizer has no chat template.*'qwen'"):
        setup.build_setup(cfg)


# ---------------------------------------------------------------- scripted episodes
def test_an_episode_round_trips_through_the_chat_template(tok):
    """(a) search, then python, then the answer: prompt + segments + observations are the
    chat template's rendering of the same conversation, token for token; (b) the loss mask
    covers exactly the model's turns; (d) the parsed query and program reach the tools."""
    searched, ran = [], []
    python = PythonTool(SandboxConfig(timeout_s=10.0))
    try:
        tools = {"search": _recording(searched, lambda q: DOCS), "code": _recording(ran, lambda c: python([c])[0])}
        segments = ["The river's length is in the documents.\n" + _call("search", {"query": QUERY}),
                    _call("python", {"code": CODE}), FINAL]
        t = scripted_episode(tok, segments, tools)
    finally:
        python.close()
    # (d) the tools got the parsed payloads; the sandbox ran the program
    assert searched == [QUERY] and ran == [CODE]
    assert [(log["tool"], log["request"], log["error"]) for log in t.tool_log] == [("search", QUERY, None),
                                                                                  ("code", CODE, None)]
    computed = t.tool_log[1]["result"]
    assert computed.strip() == "Code execution result: 1306.8"
    assert (t.n_turns, t.n_tool_calls, t.answered) == (3, 2, True)
    # (a) the conversation as a chat-template user would write it
    conversation = make_prompt(QUESTION, "qwen") + [
        _assistant("The river's length is in the documents.", "search", {"query": QUERY}),
        {"role": "tool", "name": "search", "content": DOCS.strip()},
        _assistant("", "python", {"code": CODE}),
        {"role": "tool", "name": "python", "content": computed.strip()},
        {"role": "assistant", "content": FINAL},
    ]
    rendered = tok.apply_chat_template(conversation, tools=tool_schemas(KINDS), tokenize=False)
    assert rendered.endswith(FINAL + END)
    episode = np.concatenate([t.prompt_ids, t.response_ids]).tolist()
    assert episode == _ids(tok, rendered[: -len(END)])
    # (b) the masked-in tokens are the model's turns, as the rendering delimits them
    # (after each `<|im_start|>assistant\n`, up to its `<|im_end|>`), and nothing else
    response = rendered[len(tok.decode(t.prompt_ids)):-len(END)]
    turns = re.findall(r"(?:^|<\|im_start\|>assistant\n)(.*?)(?=<\|im_end\|>|$)", response, re.DOTALL)
    assert turns == segments
    spans = t.spans()
    assert [tok.decode(t.response_ids[a:b]) for a, b, sampled in spans if sampled] == segments
    assert [tok.decode(t.response_ids[a:b]) for a, b, sampled in spans if not sampled] == t.observations
    chat_ids = {tok.convert_tokens_to_ids(x) for x in ("<|im_start|>", "<|im_end|>", "<tool_response>",
                                                       "</tool_response>")}
    assert not chat_ids & set(t.response_ids[t.loss_mask].tolist())  # chat-format tokens are never the model's
    assert chat_ids <= set(t.response_ids[~t.loss_mask].tolist())
    assert t.loss_mask.sum() == sum(len(_ids(tok, s)) for s in segments)
    # the reward reads the model's answer and confidence from its own pieces
    parsed = pieces.parse_pieces(t.pieces)
    assert (parsed.answer, parsed.q) == ("1306.8 km", pytest.approx(0.7))


@pytest.mark.parametrize("body", ['{"name": "search", "arguments": {"query": "a"',
                                  '{"name": "calculator", "arguments": {"expression": "6 * 7"}}',
                                  '{"name": "python", "arguments": {"program": "print(42)"}}'],
                         ids=["bad_json", "unknown_tool", "bad_arguments"])
def test_a_malformed_call_gets_the_message(tok, body):
    """(c) the call is invalid: no tool runs, the fixed message comes back as a user turn,
    and the episode still round-trips through the chat template."""
    calls = []
    tools = {"search": _recording(calls, lambda q: DOCS), "code": _recording(calls, lambda c: "ran")}
    malformed = f"<tool_call>\n{body}\n</tool_call>"
    t = scripted_episode(tok, [malformed, FINAL], tools)
    assert calls == [] and t.n_tool_calls == 0 and t.tool_log == []
    assert t.observations == [Qwen().observation(Action(INVALID), "")]
    conversation = make_prompt(QUESTION, "qwen") + [
        {"role": "assistant", "content": malformed}, {"role": "user", "content": Qwen().invalid_message},
        {"role": "assistant", "content": FINAL}]
    rendered = tok.apply_chat_template(conversation, tools=tool_schemas(KINDS), tokenize=False)
    assert np.concatenate([t.prompt_ids, t.response_ids]).tolist() == _ids(tok, rendered[: -len(END)])
    assert [tok.decode(t.response_ids[a:b]) for a, b, s in t.spans() if s] == [malformed, FINAL]


def test_the_tool_tags_are_added_tokens_the_parser_still_sees(tok):
    """As in Qwen2.5's tokenizer: one id each, not special, so the episode loop's decode
    (special tokens skipped) keeps them for `parse`."""
    for tag in TOOL_TAGS:
        assert len(_ids(tok, tag)) == 1 and tag not in tok.all_special_tokens
    ids = _ids(tok, _call("search", {"query": QUERY}) + "<|im_end|>")
    assert Qwen().parse(tok.decode(ids, skip_special_tokens=True)) == Action("search", QUERY)
