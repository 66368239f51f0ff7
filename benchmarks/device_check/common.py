"""What the sections share: their options, the checks they record, timing, a policy, a
byte-level tokenizer and random models built here (nothing is downloaded)."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

Part = Callable[[str, Any], None]  # part(key, value): a partial result, sent as soon as it is known


@dataclasses.dataclass(frozen=True)
class Options:
    """One run's options, the same for every section."""
    tiny: bool  # tiny shapes (a CPU run, seconds); else the accelerator shapes of each section
    work: Path  # a scratch folder (random checkpoints, run folders)
    assets: Path | None = None  # an HF config.json (+ tokenizer files) for the parity model; None: built in


def check(ok: bool, value: Any = None, limit: Any = None, **detail) -> dict:
    """One asserted property of a section: {"ok", "value", "limit", ...} (JSON-ready)."""
    out = {"ok": bool(ok)}
    if value is not None:
        out["value"] = value
    if limit is not None:
        out["limit"] = limit
    return {**out, **detail}


def max_abs(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))


def scale(x) -> float:
    """max(1, |x| max): what an absolute tolerance is relative to."""
    return max(1.0, float(np.max(np.abs(np.asarray(x, np.float64)))))


def block(x):
    """x once the device has computed it (every array leaf)."""
    import jax
    return jax.block_until_ready(x)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of fn(), its arrays computed."""
    start = time.perf_counter()
    out = block(fn())
    return time.perf_counter() - start, out


def check_policy():
    """The execution policy every section runs: the one `load_model` picks for the backend
    (on a GPU or TPU the plain accelerator path), and on a CPU `PLAIN` forced, so that a
    CPU run goes through the same code as an accelerator."""
    import jax

    from car_jax.models.policy import PLAIN, backend_policy
    return PLAIN if jax.default_backend() == "cpu" else backend_policy()


def device_summary() -> dict:
    import jax

    from car_jax.models.policy import device_kind
    return {"backend": jax.default_backend(), "device_kind": device_kind(), "devices": jax.device_count(),
            "jax": jax.__version__}


# ChatML, as SmolLM2's and Qwen's templates lay a conversation out
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_tokenizer():
    """A transformers fast tokenizer whose tokens are the 256 bytes (byte-level BPE with no
    merges) and SPECIALS (ids 256-258; EOS <|im_end|>, pad <|endoftext|>), with a ChatML
    template: the rollout engine and the trainer run on it like on a real vocabulary, with
    no asset to load (SmolLM2's GGUF vocabulary takes 10-20 s to build on a small CPU)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c))
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML, padding_side="left")


class IdTokenizer:
    """The least `generate_ids` needs for prompts given as ids: pad id 0 and a vocabulary
    whose token i reads "<i>" (no stop pattern is used, so its texts only size the tables)."""
    pad_token_id = 0
    eos_token_id = None
    unk_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __len__(self):
        return self.vocab_size

    def get_vocab(self):
        return {f"<{i}>": i for i in range(self.vocab_size)}

    def get_added_vocab(self):
        return {}

    def convert_tokens_to_ids(self, token):
        return None

    def decode(self, ids, **_):
        return "".join(f"<{i}>" for i in ids)


def random_model(cfg, *, dtype: str, param_dtype: str, remat: bool = False, seed: int = 0, norm_noise: float = 0.0):
    """A car_jax `Model` of `cfg` with random weights, initialised on the device in one jit
    (flax's init: normal(0.02) matrices, norm scales 1, plus N(0, norm_noise) on the norm
    scales and biases so that a dropped term shows), under `check_policy()`."""
    import jax
    import jax.numpy as jnp

    from car_jax.loading import Model
    from car_jax.models.config import as_dtype
    from car_jax.models.decoder import Decoder

    module = Decoder(cfg, dtype=as_dtype(dtype), param_dtype=as_dtype(param_dtype), remat=remat,
                     policy=check_policy())

    @jax.jit
    def init(key):
        params = module.init(key, jnp.zeros((1, 4), jnp.int32))["params"]
        if not norm_noise:
            return params
        leaves, tree = jax.tree_util.tree_flatten_with_path(params)
        keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
        noisy = [x + (norm_noise * jax.random.normal(k, x.shape)).astype(x.dtype)
                 if ("norm" in jax.tree_util.keystr(p) or "bias" in jax.tree_util.keystr(p)) else x
                 for (p, x), k in zip(leaves, keys)]
        return jax.tree_util.tree_unflatten(tree, noisy)

    return Model(cfg, block(init(jax.random.key(seed))), module)


def save_folder(model, tokenizer, folder: Path) -> Path:
    """`model` written as an HF folder (config.json, safetensors) with `tokenizer` beside it:
    what `car-jax train` loads as `model.path`."""
    from car_jax.checkpoints.loader import save_hf_folder

    save_hf_folder(model.params, model.config, folder)
    tokenizer.save_pretrained(str(folder))
    return folder
