"""The mixed splits of world-large (`car_jax.data.world_mixed`): deterministic, interleaved,
drawn from the single-tool splits without leaking dev into train, every answer recoverable
(search answers in their gold docs, arithmetic answers re-derived from the docs' facts);
and the mixed SFT demonstrations, which the reward's own parser scores as intended."""
import io
import re
from contextlib import redirect_stdout
from fractions import Fraction

import pytest

from car_jax.assets import smollm2_gguf
from car_jax.calibration import parsing
from car_jax.calibration.rewards import reward_inputs
from car_jax.data import QAExample, load_dataset, world_arith, world_large, world_mixed
from car_jax.loading import load_tokenizer
from car_jax.rollout.protocols import Action, Mixed
from car_jax.rollout.toolbox import ToolsConfig, open_tools
from car_jax.train.sft import tool_demos, tokenize_demos, world_demos
from tests.test_pilot import cache  # noqa: F401 - the module-wide car_jax cache fixture
from tests.test_world_large import _fact, _title, _word, large  # noqa: F401 - large: the generated files


def test_mixed_splits_are_deterministic_and_interleaved(large):
    files, _, splits = large
    assert world_mixed.mixed_files(world_large.SEED, files, world_large.NAME) == {
        f"{s}.jsonl": files[f"{s}.jsonl"] for s in world_mixed.MIXED}
    other = world_mixed.mixed_files(world_large.SEED + 1, files, world_large.NAME)
    assert all(other[k] != files[k] for k in other)
    sources = {}
    for split, (qa, arith, n) in world_mixed.MIXED.items():
        rows = splits[split]
        assert [r["tool"] for r in rows] == ["search", "code"] * n  # alternating: any prefix holds both
        assert [r["id"] for r in rows] == [f"world-large-{split}-{i:04d}" for i in range(2 * n)]
        own = {r["id"]: r for r in splits[qa] + splits[arith]}
        for r in rows:  # each row is its source row, with a new id, its tool and the source's id
            src = own[r["source_id"]]
            assert {k: v for k, v in r.items() if k not in ("id", "tool", "source_id")} == \
                   {k: v for k, v in src.items() if k != "id"}
            assert ("question" in r) == (r["tool"] == "search") and ("problem" in r) == (r["tool"] == "code")
        sources[split] = [r["source_id"] for r in rows]
        assert len(set(sources[split])) == len(rows)
    # nothing of dev or arith_dev is in mixed_train, nothing of train or arith_train in mixed_dev
    train_side = {r["id"] for s in ("train", "arith_train") for r in splits[s]}
    assert set(sources["mixed_train"]) <= train_side and not set(sources["mixed_dev"]) & train_side
    assert {r["kind"] for r in splits["mixed_train"] if r["tool"] == "search"} == {"single", "two_hop", "hidden",
                                                                                  "absent"}


def test_load_dataset_gives_each_row_its_task_and_tool(cache):
    dev = load_dataset("world-large", split="mixed_dev")
    assert len(dev) == 200
    assert [(e.task, e.meta["tool"]) for e in dev[:4]] == [("qa", "search"), ("math", "code")] * 2
    assert {e.meta["tool"] for e in dev if e.task == "qa"} == {"search"}
    assert all(e.meta["op"] in world_arith.OPS for e in dev if e.task == "math")


# the facts each op reads from its evidence docs (in order; None: every doc's), and how the
# answer follows from them and the problem text
DERIVE = {
    "years_between": (("founded", "founded"), lambda f, text: abs(f[0] - f[1])),
    "total_length": (("length",) * 3, lambda f, text: sum(f)),
    "age_at_invention": (("born", "year"), lambda f, text: f[1] - f[0]),
    "mean_height": (None, lambda f, text: Fraction(sum(f), len(f))),
    "line_lowered": (("depth", "depth"), lambda f, text: int(re.search(r"(\d+) times each", text)[1]) * sum(f)),
    "ascent_hours": (("height",), lambda f, text: Fraction(f[0], int(re.search(r"at (\d+) metres per", text)[1]))),
}


def _run(program: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        exec(program, {})  # noqa: S102 - world_arith's generated program
    return out.getvalue().strip()


def test_mixed_answers_recoverable(large):
    _, corpus, splits = large
    all_text = "\n".join(corpus.values())
    for r in splits["mixed_train"] + splits["mixed_dev"]:
        docs = [corpus[i] for i in r["evidence"]]
        if r["tool"] == "code":
            names, derive = DERIVE[r["op"]]
            facts = [_fact(d, name) for d, name in zip(docs, names or ["height"] * len(docs))]
            want = Fraction(derive(facts, r["problem"]))
            assert Fraction(r["answer"]) == want, r
            assert all(_title(d) in r["problem"] for d in docs)
            program = world_arith.program(r["op"], r["problem"])  # what the demonstrations run
            assert _run(program) == r["answer"], (program, r)
        elif r["kind"] == "absent":
            assert not r["answerable"] and not _word(r["entity"]).search(all_text), r
        elif r["kind"] == "hidden":
            assert not any(_word(g).search(docs[0]) for g in r["golden_answers"]), r
        else:
            assert r["answerable"] and _word(r["golden_answers"][0]).search(docs[-1]), r
    with pytest.raises(ValueError, match="unknown arithmetic op 'modulo'"):
        world_arith.program("modulo", "1 and 2")
    with pytest.raises(ValueError, match="total_length problem .* states the numbers \\['3'\\]"):
        world_arith.program("total_length", "A boat travels 3 km.")


def test_tool_demos_teach_both_tools_as_the_reward_reads_them(cache):
    examples = load_dataset("world-large", split="mixed_dev", limit=8)
    with open_tools("mixed", ToolsConfig(retriever="world-large", topk=2)) as box:
        demos = tool_demos(examples, box.tools)
        with pytest.raises(ValueError, match="need a 'code' tool"):
            tool_demos(examples, {"search": box.tools["search"]})
        with pytest.raises(ValueError, match="tool_demos"):
            world_demos(examples, box.tools["search"], "mixed")
        bare = QAExample("m1", "What is 1 + 1?", ("2",), "x", "m1", task="math")
        with pytest.raises(ValueError, match="world-large word problems.*'m1'"):
            tool_demos([bare], box.tools)
    hits = []
    for ex, demo in zip(examples, demos):
        first, obs, last = demo["segments"]
        assert (first["train"], obs["train"], last["train"]) == (True, False, True)
        action = Mixed().parse(first["text"])
        if ex.task == "qa":
            assert action == Action("search", ex.question)
            assert obs["text"].startswith("\n\n<information>Doc 1(Title:")
            assert obs["text"].endswith("</information>\n\n")
            hit = any(parsing.normalize_answer(g) in parsing.normalize_answer(obs["text"]) for g in ex.golden_answers)
        else:  # the sandbox ran the program and printed the gold answer
            assert action.kind == "code" and Fraction(_run(action.payload)) == Fraction(ex.golden_answers[0])
            assert obs["text"] == Mixed().observation(action, f"Code execution result: {ex.golden_answers[0]}\n")
            hit = True
        hits.append(hit)
        # the reward's parser on the demonstration's pieces: format valid, right exactly when found
        inputs = reward_inputs([[(s["text"], s["train"]) for s in demo["segments"]]], [list(ex.golden_answers)],
                               task=ex.task)
        assert inputs.format_ok[0], demo
        assert bool(inputs.correct[0]) == hit and inputs.q[0] == pytest.approx(0.9 if hit else 0.1)
    assert True in hits and {ex.task for ex in examples} == {"qa", "math"}
    tok = load_tokenizer(smollm2_gguf())
    for demo, traj in zip(demos, tokenize_demos(demos, tok)):  # only the tool's text is out of the loss
        obs_ids = tok(demo["segments"][1]["text"], add_special_tokens=False)["input_ids"]
        assert sum(1 for m in traj.loss_mask if not m) == len(obs_ids)


def test_qwen_demos_are_the_chat_templates_conversation_and_pass_its_format(cache):
    """template qwen: the same demonstrations in Qwen's native calls. Each tokenized demo is
    the chat template's rendering of the conversation (system + user with the tools listed,
    an assistant turn with one tool call, the tool's message, the final assistant turn) token
    for token, its loss mask is exactly the model's turns, and the reward with the qwen
    grammar finds the format valid and the answer right exactly when the tool gave it."""
    from car_jax.data import make_prompt
    from car_jax.data.chat_tools import tool_schemas
    from car_jax.rollout.protocols import Qwen
    from tests.qwen_chat import qwen_tool_tokenizer

    examples = load_dataset("world-large", split="mixed_dev", limit=6)
    with open_tools("mixed", ToolsConfig(retriever="world-large", topk=2)) as box:
        demos = tool_demos(examples, box.tools, template="qwen")
        mixed = tool_demos(examples, box.tools)
        with pytest.raises(ValueError, match="templates \\['mixed', 'qwen'\\], not 'search'"):
            tool_demos(examples, box.tools, template="search")
    tok = qwen_tool_tokenizer()
    for ex, demo, traj, twin in zip(examples, demos, tokenize_demos(demos, tok), mixed):
        call, obs, final = (s["text"] for s in demo["segments"])
        assert [s["train"] for s in demo["segments"]] == [True, False, True] and demo["tools"] == ["search", "code"]
        action = Qwen().parse(call)
        kind, key = ("search", "query") if ex.task == "qa" else ("code", "code")
        twin_action = Mixed().parse(twin["segments"][0]["text"])  # the same call as the tag demo's
        assert (action.kind, action.payload) == (twin_action.kind, twin_action.payload.strip()) and action.kind == kind
        result = obs.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
        conversation = make_prompt(ex, "qwen") + [
            {"role": "assistant", "content": call.split("\n<tool_call>")[0],
             "tool_calls": [{"type": "function", "function": {"name": "search" if kind == "search" else "python",
                                                              "arguments": {key: action.payload}}}]},
            {"role": "tool", "content": result}, {"role": "assistant", "content": final}]
        rendered = tok.apply_chat_template(conversation, tools=tool_schemas(("search", "code")), tokenize=False)
        ids = traj.prompt_ids.tolist() + traj.response_ids.tolist()
        assert ids == tok(rendered.removesuffix("<|im_end|>\n"), add_special_tokens=False)["input_ids"]
        assert [tok.decode(traj.response_ids[a:b]) for a, b, own in traj.spans() if own] == [call, final]
        assert int(traj.loss_mask.sum()) == sum(len(tok(t, add_special_tokens=False)["input_ids"])
                                                for t in (call, final))
        pieces = [(s["text"], s["train"]) for s in demo["segments"]]
        qwen = reward_inputs([pieces], [list(ex.golden_answers)], task=ex.task, grammar="qwen")
        tagged = reward_inputs([[(s["text"], s["train"]) for s in twin["segments"]]], [list(ex.golden_answers)],
                               task=ex.task)
        assert bool(qwen.format_ok[0]) and "<think>" not in final
        assert (bool(qwen.correct[0]), float(qwen.q[0])) == (bool(tagged.correct[0]), float(tagged.q[0]))
    assert {ex.task for ex in examples} == {"qa", "math"}
