"""The episode engine: episodes through max_concurrent slots give the same trajectories as
all at once (greedy and sampled, per-episode RNG; also with every decode call cut short),
the KV cache is sized by the slots, and tool calls run while the other slots decode."""
import dataclasses
import threading
import zlib

import jax
import numpy as np
import pytest

import car_jax
from car_jax.assets import smollm2_gguf
from car_jax.rollout import engine
from car_jax.rollout.decode import DecodeLoop, episode_keys
from car_jax.rollout.episode import EpisodeConfig, EpisodeStats, run_episodes
from car_jax.rollout.generate import round_up
from car_jax.rollout.protocols import ANSWER, Action
from car_jax.rollout.schedule import Clock
from car_jax.rollout.slots import compact, move_rows
from tests.hf_factory import build
from tests.lockstep import run_lockstep

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


def slow_search(queries):
    threading.Event().wait(0.05)
    return scripted_search(queries)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    build("llama", folder, vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    return folder


@pytest.fixture(scope="module")
def setup(folder):
    return car_jax.load_model(folder), car_jax.load_tokenizer(smollm2_gguf())


@pytest.fixture(scope="module")
def sharded(folder):
    """The same model on an 8-device mesh: rows over fsdp=4, kv heads over tp=2."""
    return car_jax.load_model(folder, mesh=car_jax.make_mesh(fsdp=4, tp=2), mode="sample")


def _cfg(temperature, max_concurrent=0, park_slots=-1):
    return EpisodeConfig(max_turns=3, max_response_tokens=5, max_obs_tokens=9, temperature=temperature, top_p=1.0,
                         max_concurrent=max_concurrent, park_slots=park_slots)


def _run(setup, temperature, max_concurrent, prompts=PROMPTS, stats=None, tools=None, park_slots=-1):
    model, tok = setup
    return run_episodes(model, tok, prompts, tools or {"search": scripted_search},
                        config=_cfg(temperature, max_concurrent, park_slots), protocol=Scripted(), seed=7, stats=stats)


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
    width = round_up(max(map(len, seqs)))  # a multiple of 16: the tests' forwards share one program
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
    if temperature:
        # fewer slots (one of two parking episodes that wait for a tool), as many, more.
        # Sampled episodes only: the slot mechanics (refill, parking, narrowing, compaction)
        # are the same code whatever the sampler, which only picks each row's token from its
        # logits inside the decode loop (a static part of DecodeLoop: greedy slot layouts would compile
        # their own decode programs to run that code again); sampled episodes are the
        # stricter check, each row's draw also following its episode's RNG stream whatever
        # its slot. Greedy episodes through fewer slots than episodes are checked on a mesh
        # (test_a_mesh_rollout_gives_the_unsharded_episodes), and here against the lockstep runner.
        moved = EpisodeStats()  # parkings and narrowings over the runs below
        for max_concurrent, park in ((2, -1), (2, 1), (len(PROMPTS), -1), (len(PROMPTS) + 4, -1)):
            stats = EpisodeStats()
            # a tool slow next to the host's loop (50 ms) is still out when the next round
            # schedules, so its episode is parked while the fresh ones want its row
            tools = {"search": slow_search} if park > 0 else None
            _same(_run(setup, temperature, max_concurrent, stats=stats, park_slots=park, tools=tools), every)
            assert stats.slots == min(max_concurrent, len(PROMPTS))
            quarter = max_concurrent // 4 if park < 0 else park  # parking only while episodes wait for a row
            assert stats.park_slots == (quarter if max_concurrent < len(PROMPTS) else 0)
            moved.parkings += stats.parkings
            moved.narrowings += stats.narrowings
        assert moved.parkings and moved.narrowings  # episodes were parked and the tail narrowed the rows
    else:  # greedy: the lockstep runner (the loop before the engine) agrees
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
    """The caches a rollout allocates (decode rows + park rows at the start, then the
    tail's narrower decode caches) are set by max_concurrent, not by the episode count."""
    model, tok = setup
    made = []  # (rows, slots, bytes) of every cache the engine allocated, in order
    init = type(model).init_cache

    def spy(self, rows, capacity):
        cache = init(self, rows, capacity)
        made.append((cache.batch_size, cache.capacity, sum(x.nbytes for x in jax.tree.leaves(cache))))
        return cache

    monkeypatch.setattr(type(model), "init_cache", spy)
    sizes, narrowed = {}, 0
    # 2 slots (1 decode row, 1 park row) and all at once: the row counts, capacity and
    # sampler of test_slots_give_the_episodes_of_all_at_once[1.0], whose programs serve
    for n, max_concurrent in ((6, 2), (12, 2), (6, 0)):
        made.clear()
        stats = EpisodeStats()
        trajs = _run(setup, 1.0, max_concurrent, prompts=(PROMPTS * 2)[:n], stats=stats, park_slots=1)
        park = 1 if max_concurrent else 0
        start = [(stats.slots - park, stats.capacity)] + ([(park, stats.capacity)] if park else [])
        assert len(trajs) == n and [m[:2] for m in made[:len(start)]] == start
        later = [m[0] for m in made[len(start):]]  # each narrowing halves the decode rows, once or more
        widths = [stats.slots - park] + later
        assert all(v in (w >> 1, w >> 2, w >> 3) and v >= 1 for w, v in zip(widths, later)), widths
        assert len(later) == stats.narrowings
        narrowed += len(later)
        sizes[n, max_concurrent] = sum(m[2] for m in made[:len(start)])
    # bytes of keys + values + valid + positions: rows x (L x 2 x K x H x S x 4 + S + 4) + index
    cfg = model.config
    per_row = lambda s: cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * s * 4 + s + 4  # noqa: E731
    assert sizes[6, 2] == sizes[12, 2] == 2 * per_row(stats.capacity) + 2 * 4  # twice the episodes, the same cache
    assert sizes[6, 0] == 6 * per_row(stats.capacity) + 4
    assert narrowed  # the tail allocated a narrower cache at least once (all at once: 6 rows -> fewer)


def _numpy_packed(k, v, valid):
    """An independent reference of `compact`: each row's valid slots moved to its front."""
    k2, v2, valid2 = np.zeros_like(k), np.zeros_like(v), np.zeros_like(valid)
    for b in range(valid.shape[0]):
        keep = np.flatnonzero(valid[b])
        k2[:, b, ..., :len(keep)] = k[:, b][..., keep]
        v2[:, b, :, :len(keep)] = v[:, b][:, :, keep]
        valid2[b, :len(keep)] = True
    return k2, v2, valid2


def test_compact_and_move_rows_sharded_as_unsharded(setup, sharded):
    """compact and move_rows on a cache split over an 8-device mesh (rows over fsdp=4, kv
    heads over tp=2) give the unsharded results, and both match a numpy re-derivation."""
    model, _ = setup
    rng = np.random.default_rng(0)
    b, s = 8, 24
    plain = model.init_cache(b, s)
    valid = rng.random((b, s)) < 0.5
    valid[:, 20:] = False  # index 20: the slots after it are empty
    k = [rng.standard_normal(x.shape).astype(np.float32) * valid[None, :, None, None, :]
         for x in jax.tree.leaves(plain.k)]
    v = [rng.standard_normal(x.shape).astype(np.float32) * valid[None, :, None, :, None]
         for x in jax.tree.leaves(plain.v)]
    pos = rng.integers(0, 50, b).astype(np.int32)

    def filled(like):  # the random cache in `like`'s layout and shardings
        put = lambda x, a: jax.device_put(a.reshape(x.shape), x.sharding)  # noqa: E731
        return like.replace(k=jax.tree.unflatten(jax.tree.structure(like.k), [put(x, a) for x, a in zip(
            jax.tree.leaves(like.k), k)]), v=jax.tree.unflatten(jax.tree.structure(like.v), [put(x, a) for x, a in zip(
                jax.tree.leaves(like.v), v)]), valid=put(like.valid, valid), next_pos=put(like.next_pos, pos),
            index=jax.numpy.int32(20))

    leaves = lambda c: [np.asarray(x) for x in (*jax.tree.leaves(c.k), *jax.tree.leaves(c.v), c.valid, c.next_pos)]  # noqa: E731
    one, split = compact(filled(plain)), compact(filled(sharded.init_cache(b, s)))
    assert int(one.index) == int(split.index) == valid.sum(axis=1).max()
    for x, y in zip(leaves(one), leaves(split), strict=True):
        np.testing.assert_array_equal(x, y)
    k2, v2, valid2 = _numpy_packed(np.stack(k).reshape(-1, *k[0].shape[-4:]) if len(k) > 1 else k[0],
                                   np.stack(v).reshape(-1, *v[0].shape[-4:]) if len(v) > 1 else v[0], valid)
    got = leaves(one)
    np.testing.assert_array_equal(np.stack(got[:len(k)]).reshape(k2.shape), k2)
    np.testing.assert_array_equal(np.stack(got[len(k):len(k) + len(v)]).reshape(v2.shape), v2)
    np.testing.assert_array_equal(got[-2], valid2)

    # rows 5 and 2 moved into rows 0 and 3 of an empty cache (row 1's move is none)
    src, dst = np.array([5, 7, 2, 0], np.int32), np.array([0, -1, 3, -1], np.int32)
    moved = []
    for m, like in ((model, plain), (sharded, sharded.init_cache(b, s))):
        empty = m.init_cache(b, s)
        out, _ = move_rows(filled(like), None, empty, None, jax.numpy.asarray(src), jax.numpy.asarray(dst))
        moved.append(leaves(out))
        assert int(out.index) == max(valid[5].sum(), valid[2].sum())
    for x, y in zip(*moved, strict=True):
        np.testing.assert_array_equal(x, y)
    want_valid = np.zeros_like(valid)
    want_valid[[0, 3]] = valid2[[5, 2]]
    np.testing.assert_array_equal(moved[0][-2], want_valid)
    np.testing.assert_array_equal(moved[0][-1][[0, 3]], pos[[5, 2]])
    np.testing.assert_array_equal(np.stack(moved[0][:len(k)]).reshape(k2.shape)[:, [0, 3]], k2[:, [5, 2]])


def test_a_mesh_rollout_gives_the_unsharded_episodes(setup, sharded, monkeypatch):
    """On an 8-device mesh (rows over fsdp=4, kv heads over tp=2), 4 slots for 6 episodes:
    greedy episodes equal those of one device, all at once, and each refill runs only its
    rows' distinct prompts (u rows, split over fsdp), not every slot."""
    every = _run(setup, 0.0, 0)
    prefill = engine.prefill_distinct
    runs = []  # (prompt rows run, slots) of each refill

    def spy(module, *, cache, tokens, inverse, **kwargs):
        runs.append((tokens.shape[0], cache.batch_size, int((np.asarray(inverse) >= 0).sum())))
        return prefill(module, cache=cache, tokens=tokens, inverse=inverse, **kwargs)

    monkeypatch.setattr(engine, "prefill_distinct", spy)
    model, tok = setup
    trajs = run_episodes(sharded, tok, PROMPTS, {"search": scripted_search}, config=_cfg(0.0, 4), protocol=Scripted(),
                         seed=7)
    _same(trajs, every)
    assert sum(refilled for _, _, refilled in runs) == len(PROMPTS)  # every episode's prompt, once
    assert all(u % 4 == 0 and u <= slots for u, slots, _ in runs) and runs[0] == (4, 4, 4), runs


def _count_decode_calls(monkeypatch) -> list[int]:
    """The engine's decode calls counted, from now on, in the one-item list returned."""
    calls = [0]
    decode = DecodeLoop.run

    def counting(*args, **kwargs):
        calls[0] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(DecodeLoop, "run", counting)
    return calls


def test_tools_run_while_other_slots_decode(setup, monkeypatch):
    """Each tool call holds its result until the device loop has made another decode call
    (or a fifth of a second passed): with tools overlapping decoding some call sees one; a loop
    that waited for its tools would make none while a call is out."""
    calls = _count_decode_calls(monkeypatch)
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


def test_decode_calls_cut_anywhere_give_the_same_episodes(setup, monkeypatch):
    """Every decode call cut after one step (as if a tool result were always due): the
    episodes are those of uncut calls, all at once."""
    every = _run(setup, 1.0, 0)
    monkeypatch.setattr(Clock, "steps_until", lambda self, jobs, now, floor, most: 1)
    calls = _count_decode_calls(monkeypatch)
    stats = EpisodeStats()
    _same(_run(setup, 1.0, 2, stats=stats, park_slots=1), every)
    # one step a call: as many calls as steps, and at least an episode's sampled tokens
    assert calls[0] == stats.decode_steps >= max(int(t.loss_mask.sum()) for t in every) > 1


def test_clock_sizes_a_decode_call_to_the_next_due_result():
    clock = Clock()
    assert clock.steps_until(["a"], 0.0, 2, 32) == 32  # no decode step timed yet
    clock.decoded(0.5, 50)  # 10 ms a step
    assert clock.steps_until([], 0.0, 2, 32) == 32  # no job out: the whole budget
    clock.started = {"a": 1.0, "b": 1.05}
    assert clock.steps_until(["a", "b"], 1.0, 2, 32) == 2  # no job finished yet: the floor
    clock.finished("x", 0.2)  # a job took 200 ms
    clock.decoded(0.3, 20)  # 15 ms a step: the mean is 0.75 x 10 + 0.25 x 15 = 11.25 ms
    # "a" is due at 1.2 s; at 1.1 s that is 100 ms away: ceil(100 / 11.25) = 9 steps
    assert clock.steps_until(["a", "b"], 1.1, 2, 32) == 9
    assert clock.steps_until(["b"], 1.0, 2, 32) == 23  # due in 250 ms: ceil(22.2)
    assert clock.steps_until(["b"], 0.0, 2, 32) == 32  # due in 1.25 s: capped at the budget
    assert clock.steps_until(["a"], 1.5, 2, 32) == 2  # overdue: the floor
    clock.finished("a", 0.4)  # 0.75 x 0.2 + 0.25 x 0.4 = 0.25 s
    assert "a" not in clock.started and clock.job_s == 0.25


def test_bad_max_concurrent_is_a_clear_error():
    with pytest.raises(ValueError, match=r"max_concurrent=-1 must be >= 0 \(0: every episode at once\)"):
        EpisodeConfig(max_concurrent=-1)
    with pytest.raises(ValueError, match=r"park_slots=-2 must be >= 0, or -1"):
        EpisodeConfig(park_slots=-2)
    with pytest.raises(ValueError, match="tool_workers=0 must be >= 1"):
        EpisodeConfig(tool_workers=0)
