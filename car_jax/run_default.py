"""`car-jax run`: the main job on the embedded default model (SmolLM2-135M-Instruct, CPU).

For now it converts the shipped GGUF to an HF folder (once, cached), loads it into the
Flax decoder and answers one chat prompt with greedy decoding."""
from __future__ import annotations

import time

DEFAULT_PROMPT = "In one sentence: why should an AI agent say how confident it is in its answers?"


def register(sub) -> None:
    p = sub.add_parser("run", help="the main job on the embedded default model")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.set_defaults(func=_run)


def default_model_dir():
    """The embedded SmolLM2 GGUF converted to an HF folder in the car_jax cache."""
    from car_jax.assets import cache_dir, smollm2_gguf
    from car_jax.checkpoints.convert import gguf_to_hf

    out = cache_dir() / "SmolLM2-135M-Instruct"
    if not (out / "config.json").is_file():
        print(f"converting {smollm2_gguf().name} -> {out}")
        tmp = out.with_name(out.name + ".partial")
        gguf_to_hf(smollm2_gguf(), tmp)
        tmp.rename(out)  # complete folders only: an interrupted conversion is redone
    return out


def _run(args) -> int:
    import car_jax
    from car_jax.rollout.generate import generate

    folder = default_model_dir()
    model = car_jax.load_model(folder)
    tokenizer = car_jax.load_tokenizer(folder)
    start = time.perf_counter()
    [answer] = generate(model, tokenizer, [[{"role": "user", "content": args.prompt}]],
                        max_new_tokens=args.max_new_tokens)
    print(f"user: {args.prompt}\nassistant: {answer}")
    print(f"({time.perf_counter() - start:.1f} s, greedy, {model.config.n_layers} layers, CPU)")
    return 0
