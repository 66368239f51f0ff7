"""Section engine: the episode engine on the device gives, through a bounded number of
slots, the episodes it gives with every episode at once (tests/test_engine.py's property,
through the same public API: `rollout.episode.run_episodes`, `EpisodeConfig`).

A random Llama-shaped model over the byte tokenizer (`common.byte_tokenizer`), fp32 at
"highest" matmul precision, samples (temperature 1, per-episode RNG) multi-turn episodes of
a scripted protocol: a segment ends at one of a few single-character stops (or EOS or its
token budget), then answers when its text hashes to 0 mod 4, else calls a scripted search
whose result ends the episode when the query hashes to 0 mod 3; so episodes end at
different turns, free slots take waiting episodes, and rows are parked and narrowed. Prompts
come in GRPO groups (each twice).

Checks: every episode's tokens, loss mask, turns and tool calls equal between
max_concurrent = `slots` and 0 (all at once); the recorded log-probs within LOGP_TOL; the
rollout really refilled slots (more episodes than slots) and its episodes ended at 2 or
more different turn counts.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from .common import Options, Part, byte_tokenizer, check, random_model, timed

LOGP_TOL = 1e-4  # float32 sums over other cache layouts and batch widths


@dataclasses.dataclass(frozen=True)
class Shape:
    model: dict  # ModelConfig fields but the vocabulary (the byte tokenizer's)
    prompts: int  # distinct prompts; each runs twice (a group of 2)
    slots: int  # max_concurrent of the bounded run
    turns: int  # EpisodeConfig.max_turns
    response_tokens: int
    obs_tokens: int


TINY = Shape(dict(model_type="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                  tie_embeddings=True), prompts=3, slots=2, turns=1, response_tokens=6, obs_tokens=9)
FULL = Shape(dict(model_type="llama", d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64, mlp_dim=1536,
                  tie_embeddings=True), prompts=32, slots=16, turns=3, response_tokens=32, obs_tokens=24)


def _h(text: str) -> int:
    return zlib.crc32(text.encode())


@dataclasses.dataclass(frozen=True)
class Scripted:
    """A protocol (`rollout.protocols`'s interface) whose decisions are a fixed function of
    the model's text."""
    stops: tuple = ("e", "t", "a", "o", " ", "\n")
    final_stops: tuple = ("e", "t", "a", "o", " ", "\n")

    def parse(self, text):
        from car_jax.rollout.protocols import ANSWER, Action
        return Action(ANSWER, text) if _h(text) % 4 == 0 else Action("search", text)

    def wrap(self, action, result):
        return "", f" [{result}] ", ""

    def observation(self, action, result):
        return "".join(self.wrap(action, result))

    def ends_episode(self, observation):
        return "END" in observation


def scripted_search(queries):
    return ["END" if _h(q) % 3 == 0 else f"doc {len(q)}" for q in queries]


def compare(a, b) -> dict:
    """Episode by episode: the first index whose tokens, mask, turns or calls differ (-1:
    none) and the largest log-prob difference."""
    first, logp = -1, 0.0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        same = (x.response_ids.tolist() == y.response_ids.tolist() and x.loss_mask.tolist() == y.loss_mask.tolist()
                and (x.n_turns, x.n_tool_calls, x.answered) == (y.n_turns, y.n_tool_calls, y.answered))
        if not same and first < 0:
            first = i
        if same:
            logp = max(logp, float(np.abs(x.logprobs - y.logprobs).max(initial=0.0)))
    return {"first_different": first, "logp_max_diff": logp}


def run(opts: Options, part: Part) -> dict:
    import jax

    from car_jax.models.config import ModelConfig
    from car_jax.rollout.episode import EpisodeConfig, EpisodeStats, run_episodes
    shape = TINY if opts.tiny else FULL
    tok = byte_tokenizer()
    model = random_model(ModelConfig(vocab_size=len(tok), **shape.model), dtype="float32", param_dtype="float32",
                         norm_noise=0.1)
    prompts = [f"Question {i}: " + "how far? " * (i % 5) for i in range(shape.prompts) for _ in range(2)]

    def rollout(slots: int):
        cfg = EpisodeConfig(max_turns=shape.turns, max_response_tokens=shape.response_tokens,
                            max_obs_tokens=shape.obs_tokens, temperature=1.0, top_p=1.0, max_concurrent=slots)
        stats = EpisodeStats()
        seconds, trajs = timed(lambda: run_episodes(model, tok, prompts, {"search": scripted_search}, config=cfg,
                                                    protocol=Scripted(), seed=7, stats=stats))
        info = {"seconds": seconds, "slots": stats.slots, "parkings": stats.parkings, "narrowings": stats.narrowings,
                "sampled_tokens": int(sum(t.loss_mask.sum() for t in trajs))}
        return trajs, info

    with jax.default_matmul_precision("highest"):
        every, every_info = rollout(0)
        part("all_at_once", every_info)
        bounded, bounded_info = rollout(shape.slots)
        part("bounded", bounded_info)
    diff = compare(every, bounded)
    turns = sorted({t.n_turns for t in every})
    return {"episodes": len(prompts), "max_concurrent": shape.slots, "turns_seen": turns,
            "all_at_once": every_info, "bounded": bounded_info, **diff,
            "checks": {"episodes_equal": check(diff["first_different"] < 0, diff["first_different"]),
                       "logp": check(diff["logp_max_diff"] <= LOGP_TOL, diff["logp_max_diff"], LOGP_TOL),
                       "slots_refilled": check(bounded_info["slots"] < len(prompts), bounded_info["slots"],
                                               len(prompts)),
                       "turns_vary": check(len(turns) >= 2, turns)}}


def summary(r: dict) -> str:
    same = "equal" if r["first_different"] < 0 else f"NOT equal (episode {r['first_different']} first)"
    return (f"{r['episodes']} episodes through {r['max_concurrent']} slots {same} to all at once (log-probs within "
            f"{r['logp_max_diff']:.1e}); turns seen {r['turns_seen']}; "
            f"all at once {r['all_at_once']['seconds']:.1f} s, "
            f"bounded {r['bounded']['seconds']:.1f} s")
