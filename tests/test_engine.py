"""The episode engine: episodes through max_concurrent slots give the same trajectories as
all at once (greedy and sampled, per-episode RNG), the KV cache is sized by the slots, and
tool calls run while the other slots decode."""
import dataclasses
import threading
import zlib

import jax
import numpy as np
import pytest

import car_jax
from car_jax.assets import smollm2_gguf
from car_jax.rollout import engine
from car_jax.rollout.episode import EpisodeConfig, EpisodeStats, run_episodes
from car_jax.rollout.lockstep import run_lockstep
from car_jax.rollout.protocols import ANSWER, Action
from car_jax.rollout.slots import episode_keys
from tests.hf_factory import build

PROMPTS = ["Question one?", "A much longer second question, with more words in it?", "Q3", "Four",
           "Q3", "Six: the last one"]


def _h(text: str) -> int:
    return zlib.crc32(text.encode())


@dataclasses.dataclass(frozen=True)
class Scripted:
    """A protocol whose decisions are a fixed function of the model's text: a segment
    answers when its text hashes to 0 mod 4, else it searches for its text; the scripted
    tool's result ends the episode when the query hashes to 0 mod 3. Stops fire often on a
    random model ("e"), so episodes end at different turns."""
    stops: tuple = ("e",)
    final_stops: tuple = ("e",)

    def parse(self, text):
        return Action(ANSWER, text) if _h(text) % 4 == 0 else Action("search", text)

    def wrap(self, action, result):
        return "", f" [{result}] ", ""

    def observation(self, action, result):
        return "".join(self.wrap(action, result))

    def ends_episode(self, observation):
        return "END" in observation


def scripted_search(queries):
    return ["END" if _h(q) % 3 == 0 else f"doc {len(q)}" for q in queries]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    build("llama", folder, vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    return car_jax.load_model(folder), car_jax.load_tokenizer(smollm2_gguf())


def _cfg(temperature, max_concurrent=0):
    return EpisodeConfig(max_turns=3, max_response_tokens=5, max_obs_tokens=9, temperature=temperature, top_p=1.0,
                         max_concurrent=max_concurrent)


def _run(setup, temperature, max_concurrent, prompts=PROMPTS, stats=None, tools=None):
    model, tok = setup
    return run_episodes(model, tok, prompts, tools or {"search": scripted_search},
                        config=_cfg(temperature, max_concurrent), protocol=Scripted(), seed=7, stats=stats)


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.response_ids.tolist() == y.response_ids.tolist()
        assert x.loss_mask.tolist() == y.loss_mask.tolist()
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)  # float32 sums over other cache layouts
        assert (x.n_turns, x.n_tool_calls, x.answered, x.observations) == (y.n_turns, y.n_tool_calls,
                                                                          y.answered, y.observations)


def _teacher_forced(model, trajs):
    """Per trajectory: logits float32[R, V] at each response position (predicting it), from
    one full forward over prompt + response (right-padded), no cache."""
    seqs = [np.concatenate([t.prompt_ids, t.response_ids]) for t in trajs]
    width = max(map(len, seqs))
    tokens = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    logits = np.asarray(model.logits(tokens), np.float32)
    out = []
    for i, t in enumerate(trajs):
        p = len(t.prompt_ids)
        out.append(logits[i, p - 1:p - 1 + len(t.response_ids)])
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_slots_give_the_episodes_of_all_at_once(setup, temperature):
    model, tok = setup
    every = _run(setup, temperature, 0)
    turns = [t.n_turns for t in every]
    assert len(set(turns)) >= 2 and min(turns) == 1, turns  # episodes end at different turns
    assert any(t.answered for t in every) and any(t.n_tool_calls for t in every)
    for max_concurrent in (2, len(PROMPTS), len(PROMPTS) + 4):  # fewer slots, as many, more
        stats = EpisodeStats()
        _same(_run(setup, temperature, max_concurrent, stats=stats), every)
        assert stats.slots == min(max_concurrent, len(PROMPTS))
    if temperature == 0:  # greedy: the lockstep runner (the loop before the engine) agrees
        _same(run_lockstep(model, tok, PROMPTS, {"search": scripted_search}, config=_cfg(0.0), protocol=Scripted(),
                           seed=7), every)

    # an independent re-derivation: each sampled token is the draw of its episode's own
    # stream (key(seed) folded with the episode index and its drawn-token count) from the
    # teacher-forced logits, and its recorded log-prob is log-softmax(logits / T) there
    t_eff = temperature or 1.0
    sampler = _cfg(temperature).sampler
    for e, (traj, logits) in enumerate(zip(every, _teacher_forced(model, every))):
        pos = np.flatnonzero(traj.loss_mask)
        sampled = traj.response_ids[pos]
        logp = np.asarray(jax.nn.log_softmax(logits[pos] / t_eff, axis=-1))
        np.testing.assert_allclose(logp[np.arange(len(pos)), sampled], traj.logprobs[pos], atol=1e-4)
        keys = episode_keys(jax.random.key(7), np.full(len(pos), e, np.int32), np.arange(len(pos), dtype=np.int32))
        drawn = [int(sampler(logits[j][None], k, model.module.policy)[0][0]) for j, k in zip(pos, keys)]
        assert drawn == sampled.tolist()


def test_kv_cache_is_sized_by_the_slots(setup, monkeypatch):
    model, tok = setup
    seen = []  # (rows, slots, bytes) of every cache a decode call got
    decode = engine.decode_slots

    def spy(*args, **kwargs):
        cache = args[4]
        seen.append((cache.batch_size, cache.capacity, sum(x.nbytes for x in jax.tree.leaves(cache))))
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, "decode_slots", spy)
    sizes = {}
    for n, max_concurrent in ((6, 2), (12, 2), (6, 0)):
        seen.clear()
        stats = EpisodeStats()
        trajs = _run(setup, 1.0, max_concurrent, prompts=(PROMPTS * 2)[:n], stats=stats)
        assert len(trajs) == n and {s[:2] for s in seen} == {(stats.slots, stats.capacity)}
        sizes[n, max_concurrent] = seen[0][2]
    # bytes of keys + values + valid + positions: rows x (L x 2 x K x H x S x 4 + S) + ...
    cfg = model.config
    per_row = lambda s: cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * s * 4 + s + 4  # noqa: E731
    assert sizes[6, 2] == sizes[12, 2] == 2 * per_row(stats.capacity) + 4  # twice the episodes, the same cache
    assert sizes[6, 0] == 6 * per_row(stats.capacity) + 4


def test_tools_run_while_other_slots_decode(setup, monkeypatch):
    """Each tool call holds its result until the device loop has made another decode call
    (or a fifth of a second passed): with tools overlapping decoding some call sees one; a loop
    that waited for its tools would make none while a call is out."""
    calls = [0]
    decode = engine.decode_slots

    def counting(*args, **kwargs):
        calls[0] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, "decode_slots", counting)
    spans = []  # (decode calls made when the tool call started, when it returned)

    def tool(queries):
        start = calls[0]
        for _ in range(10):
            if calls[0] > start:
                break
            threading.Event().wait(0.02)
        spans.append((start, calls[0]))
        return scripted_search(queries)

    model, tok = setup
    trajs = run_episodes(model, tok, PROMPTS, {"search": tool}, config=_cfg(1.0, 2), protocol=Scripted(), seed=7)
    assert any(end > start for start, end in spans), spans  # decode calls ran while a tool call was out
    assert all(log["error"] is None for t in trajs for log in t.tool_log)
    _same(trajs, _run(setup, 1.0, 0))  # and the episodes are the same as without the waits


def test_bad_max_concurrent_is_a_clear_error():
    with pytest.raises(ValueError, match=r"max_concurrent=-1 must be >= 0 \(0: every episode at once\)"):
        EpisodeConfig(max_concurrent=-1)
    with pytest.raises(ValueError, match="tool_workers=0 must be >= 1"):
        EpisodeConfig(tool_workers=0)
