"""One policy, both tools: the `Mixed` protocol's parsing and observations, a mixed toolbox
routing search calls to the retriever and code calls to the sandbox inside one episode (with
the KV cache surviving both kinds of observation), malformed and unknown calls, and a tiny
training run of the mixed protocol with its SFT warm start."""
import dataclasses
import io
import itertools
import re
from contextlib import redirect_stdout

import jax
import numpy as np
import pytest

import car_jax
from car_jax.calibration import parsing
from car_jax.calibration.rewards import RewardInputs
from car_jax.config import load_config
from car_jax.data import TEMPLATES, load_dataset
from car_jax.rollout import protocols
from car_jax.rollout.episode import EpisodeConfig, observation_ids, run_episodes
from car_jax.rollout.protocols import ANSWER, INVALID, TIR, Action, Mixed, SearchR1
from car_jax.rollout.stops import matches
from car_jax.rollout.toolbox import ToolsConfig, open_tools, tool_names
from car_jax.train.config import TrainConfig
from car_jax.train.log import read_metrics
from tests.hf_factory import build_agent
from tests.test_group_stats import assert_matches, reference_stats
from tests.test_pilot import cache  # noqa: F401 - the module-wide car_jax cache fixture

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the protocol, on text
def test_mixed_parsing_picks_the_first_complete_action():
    p = Mixed()
    assert p.parse("<think>x</think>\n<search> capital of Vanmark </search>") == Action("search", "capital of Vanmark")
    assert p.parse("<think>c</think>\n```python\nprint(6 * 7)\n```") == Action("code", "print(6 * 7)\n")
    assert p.parse("<think>t</think>\n<answer> 42 </answer>\n<confidence> 80 </confidence>") == Action(ANSWER, "42")
    # the action that starts first decides
    assert p.parse("```python\nq = '<search>x</search>'\n```").kind == "code"
    assert p.parse("<search> a </search> then ```python\nprint(1)\n```") == Action("search", "a")
    assert p.parse("<answer> 3 </answer> ```python\nprint(1)\n```").kind == ANSWER
    # malformed or unknown calls: invalid, answered with the message
    for text in ("I think it is 42.", "<search> unclosed", "```python\nprint(1)", "<calculator> 2 + 2 </calculator>",
                 "```py\nprint(1)\n```"):
        assert p.parse(text) == Action(INVALID), text
    # single-tool protocols are unchanged: SearchR1 knows no code, TIR no search
    assert SearchR1().parse("```python\nprint(1)\n```").kind == INVALID
    assert TIR().parse("<search> q </search>").kind == "void"


def test_mixed_observations_and_stops():
    p = Mixed()
    docs = "Doc 1(Title: A) text"
    assert p.observation(Action("search", "q"), docs) == "\n\n<information>Doc 1(Title: A) text</information>\n\n"
    assert p.wrap(Action("search", "q"), docs) == SearchR1().wrap(Action("search", "q"), docs)
    code = "Code execution result: 42\n"
    assert p.observation(Action("code", "print(42)"), code) == "\n```output\nCode execution result: 42\n\n```\n"
    message = p.observation(Action(INVALID), "")
    assert "search" in message and "Python" in message and "answer" in message
    assert not re.search(r"</?\w+>|```", message)  # no tag or fence the parser would read as the model's
    assert not p.ends_episode("Code execution result: \\boxed{7}")  # only the model's answer ends it
    # each action's text ends a segment at its end, and only the answer ends the last turn
    for text, stop in (("<search> q </search>", "</search>"), ("```python\nprint(1)\n```", ("```python", "```")),
                       ("<answer> 1 </answer>\n<confidence> 50 </confidence>", "</confidence>")):
        assert [matches(text, s) for s in p.stops] == [s == stop for s in p.stops], text
    assert p.final_stops == ("</confidence>",) and protocols.PROTOCOLS["mixed"] == (Mixed, "mixed")


def test_mixed_prompt_shows_what_the_parsers_accept():
    system = TEMPLATES["mixed"].system
    fact, calc = system.split("Example of a question that needs a fact:\n", 1)[1].split(
        "Example of a problem that needs a calculation:\n")
    fact = fact.replace("<information> ... </information>", "<information> Doc 1 ... </information>")
    assert parsing.check_format(fact) == (True, "")
    assert Mixed().parse(fact).kind == "search"
    # the calculation example: its program really prints the output it shows
    action = Mixed().parse(calc)
    assert action.kind == "code"
    out = io.StringIO()
    with redirect_stdout(out):
        exec(action.payload, {})  # noqa: S102 - the template's own example program
    assert f"Code execution result: {out.getvalue().strip()}" in calc
    assert parsing.parse_confidence(calc)[1] and parsing.last_tag_content(calc, "answer") == out.getvalue().strip()
    for tag in ("<search>", "```python", "<answer>", "<confidence>"):
        assert tag in system


def test_tool_kinds():
    assert tool_names("mixed") == ("search", "code") and tool_names(None) == ()
    with pytest.raises(ValueError, match="unknown tool kind 'web'.*'mixed'"):
        tool_names("web")


# ---------------------------------------------------------------- episodes on a tiny model
@dataclasses.dataclass(frozen=True)
class Scripted(Mixed):
    """The Mixed protocol whose segments are read as scripted texts, one per parse, in order
    (a random model writes no tags); stops fire on "e" so that turns stay short."""
    script: tuple = ()
    calls: list = dataclasses.field(default_factory=list)
    stops: tuple = ("e",)
    final_stops: tuple = ("e",)

    def parse(self, text):
        self.calls.append(text)
        return super().parse(self.script[(len(self.calls) - 1) % len(self.script)])


QUESTION = "What is the length of the Vegrei River in kilometres?"  # a river world-large lacks (training's query)


def _single_question():
    """The first world-large dev question whose entity has a doc holding the answer."""
    return next(e for e in load_dataset("world-large", split="dev") if e.meta["kind"] == "single")


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """A tiny random llama with SmolLM2's tokenizer saved beside it: the episodes' model and
    the training run's starting policy."""
    return build_agent(tmp_path_factory.mktemp("tiny_llama"), hidden_size=64, num_attention_heads=4,
                       num_key_value_heads=2)


@pytest.fixture(scope="module")
def setup(agent):
    return car_jax.load_model(agent), car_jax.load_tokenizer(agent)


def test_one_episode_calls_both_tools(setup, cache):
    """Search goes to the world-large retriever, code to the sandbox, in one episode; the
    recorded log-probs equal teacher forcing over the whole response, both observations
    spliced in (the KV cache survived both tool calls)."""
    model, tok = setup
    temperature = 1.3
    cfg = EpisodeConfig(max_turns=2, max_response_tokens=5, max_obs_tokens=48, temperature=temperature, top_p=1.0)
    ex = _single_question()
    protocol = Scripted(script=(f"<think> look up </think>\n<search> {ex.question} </search>",
                                "<think> add </think>\n```python\nprint(6 * 7 + 1000)\n```",
                                "<answer> 1042 </answer>\n<confidence> 70 </confidence>"))
    with open_tools("mixed", ToolsConfig(retriever="world-large", topk=2)) as box:
        assert sorted(box.tools) == ["code", "search"] and "python sandbox" in box.label
        [t] = run_episodes(model, tok, ["Mixed tools, one episode?"], box.tools, config=cfg, protocol=protocol, seed=5)
        want_docs = box.tools["search"]([ex.question])[0]
    assert len(protocol.calls) == 3 and (t.n_turns, t.n_tool_calls, t.answered) == (3, 2, True)
    search, code = t.tool_log
    assert (search["tool"], search["request"], search["error"]) == ("search", ex.question, None)
    assert search["result"] == want_docs and f'(Title: "{ex.meta["entity"]}")' in want_docs  # BM25 found its doc
    assert (code["tool"], code["request"].strip(), code["error"]) == ("code", "print(6 * 7 + 1000)", None)
    assert code["result"] == f"Code execution result: {6 * 7 + 1000}\n"  # the sandbox ran the program
    assert t.observations == [Mixed().observation(Action("search", ex.question), want_docs),
                              "\n```output\nCode execution result: 1042\n\n```\n"]
    # the pieces the reward reads: the search result cut to the budget inside its wrapper, the code result whole
    docs_piece, code_piece = [text for text, by_model in t.pieces if not by_model]
    assert docs_piece.startswith("\n\n<information>Doc 1(Title:") and docs_piece.endswith("</information>\n\n")
    assert code_piece == t.observations[1]
    # the cache: every sampled token's log-prob equals a full forward over prompt + response
    seq = np.concatenate([t.prompt_ids, t.response_ids])
    logp = np.asarray(jax.nn.log_softmax(np.asarray(model.logits(seq[None]))[0] / temperature, axis=-1))
    p, mask = len(t.prompt_ids), np.array(t.loss_mask, bool)
    forced = logp[np.arange(p - 1, len(seq) - 1), seq[p:]]
    assert mask.sum() > 0 and np.abs(forced[mask] - np.array(t.logprobs)[mask]).max() <= 1e-4
    obs = [i for i, m in zip(t.response_ids, t.loss_mask) if not m]
    assert obs == [i for log in t.tool_log
                   for i in observation_ids(tok, Mixed().wrap(Action(log["tool"], ""), log["result"]), 48)]


def test_malformed_and_unknown_calls_get_observations(setup):
    """An unknown tag is invalid (the message, no tool call); a code call in a run whose
    toolbox has only the search tool gets run_tools' "no tool" text in the code wrapper."""
    model, tok = setup
    cfg = EpisodeConfig(max_turns=2, max_response_tokens=5, max_obs_tokens=48, temperature=1.3, top_p=1.0)
    script = ("<calculator> 6 * 7 </calculator>", "```python\nprint(1)\n```", "<answer> x </answer>")
    searched = []
    tools = {"search": lambda qs: searched.extend(qs) or ["docs"] * len(qs)}
    [t] = run_episodes(model, tok, ["Broken calls?"], tools, config=cfg, protocol=Scripted(script=script), seed=1)
    assert t.observations[0] == Mixed().invalid_message
    assert t.observations[1] == ("\n```output\ncode failed: no tool named 'code' in this run (have ['search'])"
                                 "\n```\n")
    assert searched == [] and t.n_tool_calls == 0 and t.n_turns == 3


# ---------------------------------------------------------------- a tiny training run
def test_tiny_mixed_training_run(agent, cache, tmp_path, monkeypatch):
    """configs/smollm2_mixed_cpu.yaml shrunk onto a tiny random policy: the SFT warm start on
    both tools' demonstrations, then a GRPO step whose episodes call both tools (a scripted
    parse routes them, as a random policy writes no tags). The step's row holds the group
    statistics (`rl.group_stats`) of its rollouts, re-derived in numpy from the HostBatch the
    step built and the rewards and advantages its scorer gave; the rows' reward inputs are
    scripted (a random policy writes no answers): a mixed group and an all-wrong one whose
    rewards differ by ~2e-2."""
    import car_jax.train.trainer as trainer_mod

    demos_seen, real = [], trainer_mod.tool_demos

    def spy(examples, tools, **kw):
        demos_seen.extend(real(examples, tools, **kw))
        return list(demos_seen)

    monkeypatch.setattr(trainer_mod, "tool_demos", spy)
    real_inputs = trainer_mod.reward_inputs

    def scripted_inputs(responses, *args, **kwargs):  # rows: prompt 1 x 2, prompt 2 x 2
        real_inputs(responses, *args, **kwargs)
        assert len(responses) == 4
        return RewardInputs(np.array([1, 0, 0, 0], bool), np.array([0.3, 0.6, 0.2, 0.25], np.float32),
                            np.ones(4, bool))

    monkeypatch.setattr(trainer_mod, "reward_inputs", scripted_inputs)
    routes = itertools.cycle([f"<search> {QUESTION} </search>", "```python\nprint(2 + 2)\n```"])
    monkeypatch.setitem(protocols.PROTOCOLS, "mixed", (lambda: _Routed(routes=routes), "mixed"))
    cfg = load_config(TrainConfig, ROOT / "configs" / "smollm2_mixed_cpu.yaml", [
        f"model.path={agent}", f"run.dir={tmp_path / 'run'}", "data.limit=4", "rollout.group_size=2",
        "rollout.max_turns=1", "rollout.max_response_tokens=6", "rollout.max_obs_tokens=16", "sft.steps=1",
        "sft.batch=2", "rl.steps=1", "rl.optim.total_steps=1", "rl.micro_batch=2", "run.checkpoint_every=1",
        "run.tensorboard=false", "run.export_hf=false", "model.remat=false"])
    assert (cfg.rollout.protocol, cfg.data.template, cfg.data.train_split) == ("mixed", "mixed", "mixed_train")
    trainer = trainer_mod.Trainer(cfg)
    calls = {"search": 0, "code": 0}
    for name, tool in list(trainer.setup.toolbox.tools.items()):
        trainer.setup.toolbox.tools[name] = _counted(tool, name, calls)
    hosts_seen, scores = [], []  # the step's HostBatch; its scorer's (batch, rewards)
    trainer.rollout = _recorded(trainer.rollout, hosts_seen, lambda out: out[1])
    trainer.setup.score = _recorded(trainer.setup.score, scores, lambda out: out)
    rows = trainer.run()
    assert [r["step"] for r in rows] == [1]
    [host], [(batch, rewards)] = hosts_seen, scores
    want = reference_stats(host.correct, host.q, np.asarray(rewards), np.asarray(batch.advantages), host.group,
                           host.keep)
    assert want["groups/count"] == 2 and want["groups/equal_correct_share"] == 0.5  # what the script makes
    assert want["groups/equal_correct_abs_adv"] > 0.5 and np.isfinite(want["calib/corr_qc"])
    assert_matches(rows[0], want)
    assert_matches(read_metrics(tmp_path / "run")[0], want)  # metrics.jsonl holds the same
    assert all(np.isfinite(r["loss"]) and r["tool_calls"] == 1.0 for r in rows)  # one tool turn each
    assert calls["search"] > 0 and calls["code"] > 0
    # the warm start saw a demonstration of each kind, each valid under the reward's parser
    kinds = {ex.task for ex in load_dataset("world-large", split="mixed_train", limit=4)}
    assert kinds == {"qa", "math"} and len(demos_seen) == 4
    assert sum("```python" in d["segments"][0]["text"] for d in demos_seen) == 2
    assert sum("<search>" in d["segments"][0]["text"] for d in demos_seen) == 2
    assert all(d["messages"][0]["content"] == TEMPLATES["mixed"].system for d in demos_seen)


@dataclasses.dataclass(frozen=True)
class _Routed(Mixed):
    """Mixed with each segment read as the next of `routes` (search, code, search, ...)."""
    routes: object = None

    def parse(self, text):
        return super().parse(next(self.routes))


def _recorded(fn, seen, pick):
    def call(*args):
        out = fn(*args)
        seen.append(pick(out))
        return out
    return call


def _counted(tool, name, calls):
    def call(requests):
        calls[name] += len(requests)
        return tool(requests)
    return call
