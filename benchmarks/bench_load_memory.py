"""Peak host memory while loading a checkpoint: car_jax's streaming loader against
transformers `from_pretrained`, each in a fresh subprocess, on a random Llama checkpoint
of about 500 MB written with numpy (nothing downloaded).

    .venv/bin/python benchmarks/bench_load_memory.py [--mb 500] [--mesh]

Prints the peak RSS increase over the process's footprint just before loading, as a
multiple of the checkpoint size."""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def write_checkpoint(folder: Path, target_mb: int) -> int:
    """A random fp32 Llama checkpoint of about `target_mb` MB; returns its byte size."""
    from car_jax.checkpoints.safetensors_io import write_safetensors
    from car_jax.checkpoints.table import entries, hf_names
    from car_jax.models.config import ModelConfig

    layers = max(1, int((target_mb * 2**20 / 4 - 2 * 32000 * 768) / (4 * 768 * 768 + 3 * 768 * 3072)))
    hf = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072,
          "num_hidden_layers": layers, "num_attention_heads": 12, "num_key_value_heads": 12,
          "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "hidden_act": "silu"}
    cfg = ModelConfig.from_hf(hf)
    rng = np.random.default_rng(0)
    tensors = ((name, rng.standard_normal(e.hf_shape(cfg), dtype=np.float32) * 0.02)
               for e in entries(cfg) for name in hf_names(e, cfg))
    write_safetensors(tensors, folder, max_shard_bytes=200 * 2**20)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf()))
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def child(kind: str, folder: str) -> None:
    """Runs in the subprocess: load, then report (rss before, peak rss) in bytes."""
    if kind == "car_jax_mesh":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax  # noqa: F401  (runtime initialised before the baseline is taken)
    import car_jax
    if kind == "transformers":
        import torch
        import transformers
        torch.zeros(1)
        before = _rss_bytes()
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        mesh = car_jax.make_mesh(fsdp=4, tp=2) if kind == "car_jax_mesh" else None
        jax.numpy.zeros(1).block_until_ready()
        before = _rss_bytes()
        model = car_jax.load_model(folder, mesh=mesh, progress=False)
        jax.block_until_ready(model.params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"before": before, "peak": peak}))


def measure(kind: str, folder: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(folder)], capture_output=True,
                         text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    from common import header

    with tempfile.TemporaryDirectory() as tmp:
        size = write_checkpoint(Path(tmp), args.mb)
        rows = [(kind, measure(kind, Path(tmp))) for kind in ("car_jax", "car_jax_mesh", "transformers")]
    print(header(f"Peak host memory while loading a {size / 2**20:.0f} MB fp32 checkpoint",
                 f"python benchmarks/bench_load_memory.py --mb {args.mb}"))
    print("| loader | RSS before (MB) | peak RSS (MB) | peak increase / checkpoint size |")
    print("|---|---:|---:|---:|")
    names = {"car_jax": "car_jax `load_model` (1 device)", "car_jax_mesh": "car_jax `load_model`, mesh fsdp=4 x tp=2 "
             "(8 fake CPU devices)", "transformers": "transformers `from_pretrained` (torch)"}
    for kind, r in rows:
        print(f"| {names[kind]} | {r['before'] / 2**20:.0f} | {r['peak'] / 2**20:.0f} | "
              f"{(r['peak'] - r['before']) / size:.2f}x |")


if __name__ == "__main__":
    main()
