"""Tokens prefilled in a 4-turn tool episode: car_jax (KV cache kept across tool calls,
only new tokens prefilled) against a re-send-the-history baseline (each turn prefills the
prompt and the whole history again, as chat-API agents and Tunix/EasyDeL/MaxText
multi-turn loops do). Both sides run the same model, prompts and tool, greedy, in one
run; the baseline is driven by car_jax's own generate on the growing history, so only
the caching differs.

    .venv/bin/python benchmarks/bench_episode_prefill.py [--batch 8] [--turns 4]

To get exactly `turns` tool calls from a model that does not know the tags, every
segment ends at a newline and counts as a search; the tool returns ~120 tokens of text."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header  # noqa: E402

DOC = ("Doc 1(Title: Paris) Paris is the capital and most populous city of France. It is located on the "
       "Seine river, in the north of the country. Doc 2(Title: France) France is a country in Western Europe. "
       "Doc 3(Title: Seine) The Seine is a river that flows through Paris into the English Channel.")


@dataclasses.dataclass(frozen=True)
class EveryLine:
    stops: tuple = ("\n",)
    final_stops: tuple = ("\n",)

    def parse(self, text):
        from car_jax.rollout.protocols import Action
        return Action("search", text.strip()[:64])

    def observation(self, action, result):
        return f"\n<information>{result}</information>\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--response", type=int, default=48)
    args = ap.parse_args()

    import numpy as np

    import car_jax
    from car_jax.rollout.episode import EpisodeConfig, EpisodeStats, run_episodes
    from car_jax.rollout.generate import generate_ids
    from car_jax.rollout.sampling import Sampler
    from car_jax.checkpoints.embedded import default_model_dir

    folder = default_model_dir()
    model = car_jax.load_model(folder, progress=False)
    tok = car_jax.load_tokenizer(folder)
    questions = ["Where is the Seine?", "What is the capital of France?", "Which country is Paris in?",
                 "Name a river in France."]
    prompts = [[{"role": "user", "content": questions[i % 4] + " Search, one query per line."}]
               for i in range(args.batch)]
    cfg = EpisodeConfig(max_turns=args.turns, max_response_tokens=args.response, max_obs_tokens=160,
                        temperature=0.0, top_p=1.0)
    tool = {"search": lambda qs: [DOC] * len(qs)}

    run_episodes(model, tok, prompts, tool, config=cfg, protocol=EveryLine())  # compile
    stats = EpisodeStats()
    start = time.perf_counter()
    trajs = run_episodes(model, tok, prompts, tool, config=cfg, protocol=EveryLine(), stats=stats)
    ours_s = time.perf_counter() - start

    # the same runner with each turn's decode attending over the whole episode cache
    from car_jax.rollout import engine
    windowed = engine.decode_windows
    engine.decode_windows = lambda index, steps, capacity: ()
    run_episodes(model, tok, prompts, tool, config=cfg, protocol=EveryLine())  # compile
    start = time.perf_counter()
    run_episodes(model, tok, prompts, tool, config=cfg, protocol=EveryLine())
    whole_s = time.perf_counter() - start
    engine.decode_windows = windowed

    # baseline: every turn re-prefills prompt + history and decodes the same segment
    def resend():
        prefilled = 0
        for t in trajs:
            ids = list(t.prompt_ids)
            for turn_ids, turn_mask in _segments(t):
                prefilled += len(ids)
                out = generate_ids(model, tok, [ids], max_new_tokens=args.response, stop=EveryLine.stops,
                                   sampler=Sampler(0.0))
                n = int(out.length[0])
                assert list(out.tokens[0, :n]) == turn_ids[: n], "baseline diverged from the cached episode"
                ids += turn_ids + turn_mask
        return prefilled
    resend()  # compile
    start = time.perf_counter()
    base_tokens = resend()
    base_s = time.perf_counter() - start

    turns = np.mean([t.n_turns for t in trajs])
    print(header(f"Prefill work in a {args.turns}-turn tool episode, SmolLM2-135M fp32, batch {args.batch}",
                 f"python benchmarks/bench_episode_prefill.py --batch {args.batch} --turns {args.turns}"))
    print("| system | tokens prefilled | seconds (whole episode) |")
    print("|---|---:|---:|")
    print(f"| re-send history each turn (car_jax generate per turn, row by row) | {base_tokens} | {base_s:.1f} |")
    print(f"| car_jax episode runner (cache kept across tool calls, batched) | {stats.prefilled_tokens} | "
          f"{ours_s:.1f} |")
    print(f"| the same, each turn decoding over the whole episode cache (no `decode_windows`) | "
          f"{stats.prefilled_tokens} | {whole_s:.1f} |")
    print(f"\nprefill tokens ratio: **{base_tokens / stats.prefilled_tokens:.2f}x** fewer; mean turns per "
          f"episode {turns:.1f}; sampled tokens {stats.sampled_tokens}. The time column also includes decoding, "
          f"and the baseline runs rows one at a time, so it is not a like-for-like throughput figure.")


def _segments(t):
    """(sampled ids, following observation ids) per turn of a trajectory."""
    out, sampled, obs = [], [], []
    for i, m in zip(t.response_ids, t.loss_mask):
        if m and obs:
            out.append((sampled, obs))
            sampled, obs = [], []
        (sampled if m else obs).append(i)
    out.append((sampled, obs))
    return out


if __name__ == "__main__":
    main()
