"""Slot utilisation and wall time of a long-tail rollout: the episode engine (continuous
batching through max_concurrent slots, tools overlapping decoding) against the lockstep
runner it replaced (every episode at once, each turn waiting for its slowest row and its
tools), in one run, same model, prompts, tool and seed.

    .venv/bin/python benchmarks/rollout_engine.py [--episodes 128] [--slots 16] [--latency 0.1] [--warmups 2]

The mix: a random tiny model samples (temperature 1) every segment to its budget (no stop
pattern fires); a segment's text decides, by a fixed hash, whether it answers (about 2 in 3)
or searches, so most episodes answer at once and a geometric tail takes up to four tool
turns; the search tool sleeps --latency seconds per batched call (a retriever's round trip).
Utilisation = sampled tokens / slot-steps (decode rows x steps, summed over decode calls;
the engine's tail narrows its decode rows); "at full width" divides by the first decode
rows x every step instead. Each configuration runs --warmups times to compile, then once
timed (the engine's schedule follows the tool's timing, so one run may not meet every
shape the next one does: its decode windows, its narrowings); "compile (s)" is what the
timed run still spent tracing, lowering and compiling (jax.monitoring's compile events),
part of its wall time."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/lockstep.py

from common import header  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LongTail:
    """Answers when the segment's text hashes below `answer_share`, else searches for it."""
    answer_share: float = 0.65
    stops: tuple = ("</answer>",)  # never produced by a random model: segments run to budget
    final_stops: tuple = ("</answer>",)

    def parse(self, text):
        from car_jax.rollout.protocols import Action
        answers = zlib.crc32(text.encode()) % 1000 < 1000 * self.answer_share
        return Action("answer", text) if answers else Action("search", text[:32])

    def wrap(self, action, result):
        return "\n<information>", result, "</information>\n"

    def observation(self, action, result):
        return "".join(self.wrap(action, result))

    def ends_episode(self, observation):
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.1, help="seconds per batched tool call")
    ap.add_argument("--response", type=int, default=32, help="tokens per segment")
    ap.add_argument("--warmups", type=int, default=2, help="untimed runs of each configuration first (compiles)")
    ap.add_argument("--only-engine", action="store_true", help="skip the all-at-once runs")
    args = ap.parse_args()

    import jax
    import numpy as np
    import torch
    import transformers

    import car_jax
    from car_jax.assets import smollm2_gguf
    from car_jax.rollout.episode import EpisodeConfig, EpisodeStats, run_episodes
    from tests.lockstep import run_lockstep  # the reference runner, kept beside the tests

    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    model, tok = car_jax.load_model(folder, progress=False), car_jax.load_tokenizer(smollm2_gguf())
    prompts = [f"Question {i}: where does river number {i * 7 % 13} flow?" for i in range(args.episodes)]

    def search(queries):
        time.sleep(args.latency)
        return [f"Doc 1(Title: River) river {len(q)} flows into the sea." for q in queries]

    def episode_config(max_concurrent):
        return EpisodeConfig(max_turns=4, max_response_tokens=args.response, max_obs_tokens=32, temperature=1.0,
                             top_p=1.0, max_concurrent=max_concurrent)

    compiling = [0.0]  # seconds of jax's compile events (trace, lower, backend compile) so far

    def on_event(event, seconds, **_):
        if event.startswith("/jax/core/compile/"):
            compiling[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(on_event)
    rows = []
    runs = [("lockstep runner (before): every episode at once, turn by turn", run_lockstep, 0),
            ("engine, max_concurrent=0 (every episode at once)", run_episodes, 0),
            (f"engine, max_concurrent={args.slots}", run_episodes, args.slots)]
    for label, run, max_concurrent in runs[2:] if args.only_engine else runs:
        kwargs = dict(config=episode_config(max_concurrent), protocol=LongTail(), seed=1)
        for _ in range(args.warmups):  # compile
            run(model, tok, prompts, {"search": search}, **kwargs)
        stats = EpisodeStats()
        compiled, start = compiling[0], time.perf_counter()
        trajs = run(model, tok, prompts, {"search": search}, stats=stats, **kwargs)
        seconds = time.perf_counter() - start
        turns = np.bincount([t.n_turns for t in trajs], minlength=6)[1:]
        rows.append((label, stats, seconds, turns, compiling[0] - compiled))

    print(header(f"Long-tail rollout, {args.episodes} episodes, random tiny Llama (vocab 49152, width 64, 2 layers), "
                 f"{args.response} tokens a segment, tool latency {args.latency:g} s",
                 f"python benchmarks/rollout_engine.py --episodes {args.episodes} --slots {args.slots} "
                 f"--latency {args.latency:g} --response {args.response} --warmups {args.warmups}"))
    print(f"episodes by segments (1..5): {rows[0][3].tolist()} (first), {rows[-1][3].tolist()} (last)\n")
    print("| runner | KV rows (decode + park) | slot utilisation | slot-steps | at full width | decode steps "
          "| sampled tokens | wall (s) | compile (s) | device (s) | tools (s) | parkings | narrowings |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, st, seconds, _, compile_s in rows:
        full = st.sampled_tokens / (st.decode_slots * st.decode_steps)
        print(f"| {label} | {st.slots} ({st.decode_slots} + {st.park_slots}) | {st.utilisation():.1%} | {st.slot_steps} "
              f"| {full:.1%} | {st.decode_steps} | {st.sampled_tokens} | {seconds:.2f} | {compile_s:.2f} "
              f"| {st.seconds_device:.2f} "
              f"| {st.seconds_tools:.2f} | {st.parkings} | {st.narrowings} |")
    if len(rows) > 1:
        (_, _, base, _, base_c), (_, _, last, _, last_c) = rows[0], rows[-1]
        print(f"\nwall time, lockstep runner / engine with {args.slots} slots: {base / last:.2f}x "
              f"({(base - base_c) / (last - last_c):.2f}x without the timed runs' compiles)")
    print("\nIdle slot-steps by cause (engine runs): free while episodes wait | free in the tail | episode waiting "
          "for its tool | stopped within a call")
    for label, st, *_ in rows:
        if st.capacity:
            print(f"- {label}: {st.idle_refill} | {st.idle_tail} | {st.idle_tool} | {st.idle_stopped}")


if __name__ == "__main__":
    main()
