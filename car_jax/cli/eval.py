"""`car-jax eval`: evaluate a model's accuracy and calibration on a dataset.

    car-jax eval                                      # embedded SmolLM2, world dev split, search
    car-jax eval --mode direct --limit 20
    car-jax eval --model ckpt/ --data nq_search/ --split test --retriever-url 127.0.0.1:8000
    car-jax eval --mode tir --data math500.jsonl --out runs/tir
    car-jax eval ... --resume                         # continue a run that stopped

The logic lives in `car_jax.eval.runner`; this module only turns flags into its arguments.
"""
from __future__ import annotations

import functools
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy and calibration of a model on a dataset (search / direct / tir)")
    p.add_argument("--model", default=None,
                   help="HF folder, .gguf file or car_jax params folder (default: the embedded SmolLM2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or .gguf (default: --model)")
    p.add_argument("--dtype", default="float32", help="compute dtype (float32, bfloat16)")
    p.add_argument("--data", default="world",
                   help="'world' (built-in), a .parquet/.jsonl/.csv file, or a folder with --split")
    p.add_argument("--split", default=None, help="world: dev (default) or train; folder: file stem")
    p.add_argument("--limit", type=int, default=None, help="first N examples only")
    p.add_argument("--mode", choices=("search", "direct", "tir"), default="search")
    p.add_argument("--index", default=None, help="search: index folder from `car-jax build-index`")
    p.add_argument("--retriever-url", default=None, help="search: a Search-R1 style /retrieve server")
    p.add_argument("--topk", type=int, default=3, help="search: docs per query")
    p.add_argument("--code-timeout", type=float, default=10.0, help="tir: seconds per program")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=4, help="tool turns before the answer-only turn")
    p.add_argument("--max-response-tokens", type=int, default=500, help="sampled tokens per turn")
    p.add_argument("--max-obs-tokens", type=int, default=500, help="observation tokens per turn")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples for the 95%% intervals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default runs/eval-<mode>-<data>)")
    p.add_argument("--resume", action="store_true", help="skip examples already in <out>/samples.jsonl")
    p.set_defaults(func=eval_command)


def _load(args):
    import car_jax
    from car_jax.checkpoints.embedded import default_model_dir

    model_path = Path(args.model) if args.model else default_model_dir()
    if not model_path.exists():
        raise SystemExit(f"--model {model_path}: no such file or folder")
    tok_path = Path(args.tokenizer) if args.tokenizer else model_path
    try:
        tokenizer = car_jax.load_tokenizer(tok_path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"cannot load a tokenizer from {tok_path} ({err}); pass --tokenizer "
                         "(an HF folder or .gguf holding one)") from None
    return car_jax.load_model(model_path, dtype=args.dtype), tokenizer, model_path


def _tools(args) -> tuple[dict, str, list]:
    """The mode's tools, a short description, and the objects to close afterwards."""
    if args.mode == "direct":
        return {}, "none", []
    if args.mode == "tir":
        from car_jax.tools import PythonTool, SandboxConfig

        tool = PythonTool(SandboxConfig(timeout_s=args.code_timeout))
        return {"code": tool}, "python sandbox", [tool]
    if args.retriever_url and args.index:
        raise SystemExit("give --index or --retriever-url, not both")
    from car_jax.data import search_tool

    retriever = search_tool(args.retriever_url or args.index or "world")
    if args.retriever_url:
        what = f"server {args.retriever_url}"
    elif args.index:
        what = f"index {args.index}"
    else:
        from car_jax.data import world_index
        what = f"world BM25 index {world_index()}"
    return {"search": functools.partial(retriever.observe, topk=args.topk)}, what, [retriever]


def eval_command(args) -> int:
    from car_jax.data import load_dataset
    from car_jax.eval.runner import EVAL_EPISODE, evaluate, format_table
    from car_jax.rollout.episode import EpisodeConfig

    examples = load_dataset(args.data, split=args.split, limit=args.limit)
    data_name = args.data if args.data == "world" else Path(args.data).stem
    split = args.split or ("dev" if args.data == "world" else None)
    data_label = data_name + (f":{split}" if split else "")
    out = Path(args.out or f"runs/eval-{args.mode}-{data_name}{'-' + split if split else ''}")
    tools, tool_label, resources = _tools(args)
    config = EpisodeConfig(max_turns=args.max_turns, max_response_tokens=args.max_response_tokens,
                           max_obs_tokens=args.max_obs_tokens, sampler=EVAL_EPISODE.sampler)
    try:
        model, tokenizer, model_path = _load(args)
        print(f"eval: {len(examples)} examples of {data_label}, mode {args.mode}, model {model_path}, "
              f"tool {tool_label}, out {out}")
        summary = evaluate(model, tokenizer, examples, mode=args.mode, tools=tools, episode_config=config,
                           out_dir=out, batch_size=args.batch_size, resume=args.resume, n_boot=args.n_boot,
                           seed=args.seed, info={"model": str(model_path), "data": data_label, "tool": tool_label})
    finally:
        for resource in resources:  # the sandbox's worker pool, the retriever's doc store
            resource.close()
    print(format_table(summary))
    for w in summary["warnings"]:
        print(f"note: {w}")
    print(f"wrote {out / 'samples.jsonl'}, {out / 'summary.json'}, {out / 'reliability.png'}")
    return 0
