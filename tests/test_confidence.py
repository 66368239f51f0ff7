"""`car_jax.rl.confidence`: the value distribution at the `<confidence>` tag equals a numpy
re-derivation from full-sequence logits, with a tokenizer that writes one token per digit
(SmolLM2's) and one that groups digits (a GPT-2-style byte-level BPE trained here); the
prefix and tail of an episode's tag (token boundaries, layouts, several tags, a tool's tag)."""
import json
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import car_jax
from car_jax.assets import smollm2_gguf
from car_jax.rl import confidence as cf
from tests.hf_factory import build, build_agent, qwen_tokenizer
from tests.multihost import run_processes, succeeded


def grouping_tokenizer():
    """A byte-level BPE with GPT-2's pre-tokenizer (` ?\\p{N}+`: digits grouped), trained on
    confidence tags: " 37", " 5" and " 100" are single tokens, "37" after a ">" is not."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    corpus = [f"Question {v}? <answer> item {v} </answer>\n<confidence> {v} </confidence>" for v in range(101)]
    backend.train_from_iterator(corpus * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def smol_tok():
    return car_jax.load_tokenizer(smollm2_gguf())


@pytest.fixture(scope="module")
def qwen_tok():
    return qwen_tokenizer()


def _tiny_model(folder, vocab_size):
    # weights 10x the default scale: peaked, unequal next-token distributions, so that a
    # token scored at the wrong position moves the numbers far beyond the tolerance
    build("llama", folder, vocab_size=vocab_size, initializer_range=0.2)
    return car_jax.load_model(folder)


@pytest.fixture(scope="module", params=["smollm2", "grouping"])
def setup(request, tmp_path_factory, smol_tok):
    tok = smol_tok if request.param == "smollm2" else grouping_tokenizer()
    return request.param, tok, _tiny_model(tmp_path_factory.mktemp(request.param), len(tok))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def reference(model, tok, prefix, tail) -> np.ndarray:
    """float64[101]: from `Model.logits` of each whole sequence prefix + continuation
    (right-padded: causal), log-softmax in numpy, the continuation's log-probs summed,
    softmax over the 101 values."""
    conts = [_ids(tok, tail.format(v)) for v in cf.VALUES]
    seqs = [list(prefix) + c for c in conts]
    tokens = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    logits = np.asarray(model.logits(tokens))  # float32[101, T, V]
    total = np.zeros(len(conts))
    for i, c in enumerate(conts):  # the positions that predict the continuation's tokens
        rows = logits[i, len(prefix) - 1:len(prefix) - 1 + len(c)].astype(np.float64)  # [len(c), V]
        shifted = rows - rows.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        total[i] = logp[np.arange(len(c)), c].sum()
    p = np.exp(total - total.max())
    return p / p.sum()


PREFIX_TEXTS = ["<|im_start|>user\nQuestion 3?<|im_end|>\n<|im_start|>assistant\n<think> easy </think>\n"
                "<answer> item 3 </answer>\n<confidence>",
                "Question 41? <answer> item 7 </answer>\n<confidence>",
                "A longer question with many more words in it, to pad the prompt: Question 99? <answer> x </answer>"
                "<confidence>"]
TAILS = [" {} </confidence>", "{}</confidence>", "\n{}\n</confidence>"]


def test_value_distribution_equals_full_sequence_rederivation(setup):
    name, tok, model = setup
    prefixes = [_ids(tok, t) for t in PREFIX_TEXTS]
    dist = cf.value_distribution(model, tok, prefixes, TAILS)
    assert dist.shape == (3, 101) and dist.dtype == np.float64
    np.testing.assert_allclose(dist.sum(1), 1.0, atol=1e-12)
    ref = np.stack([reference(model, tok, p, t) for p, t in zip(prefixes, TAILS)])
    np.testing.assert_allclose(dist, ref, atol=1e-5)
    want_q = ref @ (np.arange(101) / 100)
    np.testing.assert_allclose(cf.expected_q(dist), want_q, atol=1e-5)
    # the numbers are not degenerate: the rows differ, no value takes all the mass
    assert np.ptp(want_q) > 1e-3 and ref.max() < 0.999
    # one pattern for every row is the same as repeating it
    same = cf.value_distribution(model, tok, prefixes[:2], TAILS[0])
    np.testing.assert_allclose(same, cf.value_distribution(model, tok, prefixes[:2], [TAILS[0]] * 2), atol=1e-12)
    np.testing.assert_allclose(same[1], reference(model, tok, prefixes[1], TAILS[0]), atol=1e-5)
    if name == "grouping":  # the continuations really are grouped digits: " 37" is one token
        assert len(_ids(tok, " 37 </confidence>")) == len(_ids(tok, " 5 </confidence>")) == 4
        assert [tok.decode([i]) for i in _ids(tok, " 100 </confidence>")][0] == " 100"
    else:
        assert len(_ids(tok, " 37 </confidence>")) == len(_ids(tok, " 5 </confidence>")) + 1


def test_calls_of_one_prefix_each_equal_one_call(setup):
    """max_bytes=1: one prefix per call (4 calls, the bucketed shapes change); the numbers stay."""
    _, tok, model = setup
    prefixes = [_ids(tok, t) for t in PREFIX_TEXTS] + [_ids(tok, "Question 5? <confidence>")]
    assert cf.prefixes_per_call(model, 4, 64, 8, max_bytes=1) == 1
    assert cf.prefixes_per_call(model, 3, 64, 8) == 4  # the smallest power of two that holds them
    together = cf.value_distribution(model, tok, prefixes, " {} </confidence>")
    apart = cf.value_distribution(model, tok, prefixes, " {} </confidence>", max_bytes=1)
    np.testing.assert_allclose(apart, together, atol=1e-5)  # float32 sums of other shapes: ~2e-6 apart


def test_on_a_mesh_equals_one_device(tmp_path, smol_tok):
    build("llama", tmp_path, vocab_size=len(smol_tok), initializer_range=0.2)
    mesh = car_jax.make_mesh(fsdp=4, tp=2)
    one, sharded = car_jax.load_model(tmp_path), car_jax.load_model(tmp_path, mesh=mesh, mode="sample")
    prefixes = [_ids(smol_tok, t) for t in PREFIX_TEXTS]
    want = cf.value_distribution(one, smol_tok, prefixes, TAILS)
    np.testing.assert_allclose(cf.value_distribution(sharded, smol_tok, prefixes, TAILS), want, atol=1e-5)


# every process loads the model on one mesh over all 8 devices and calls value_distribution
# with the same rows; process 0 saves the result
TWO_PROCESSES = """
import json, sys
import numpy as np
from car_jax.cli import distributed
distributed.maybe_init_distributed()
import jax, car_jax
from car_jax.rl import confidence as cf
folder, out, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = car_jax.load_model(folder, mesh=car_jax.make_mesh(fsdp=-1, tp=2), mode="sample", progress=False)
dist = cf.value_distribution(model, car_jax.load_tokenizer(folder), [p for p, _ in rows], [t for _, t in rows])
if jax.process_index() == 0:
    np.save(out, dist)
"""


def test_two_processes_on_one_mesh_equal_one_device(tmp_path):
    folder = build_agent(tmp_path / "agent", initializer_range=0.2)
    tok = car_jax.load_tokenizer(folder)
    rows = [(_ids(tok, t), tail) for t, tail in zip(PREFIX_TEXTS, TAILS)]
    succeeded(run_processes([sys.executable, "-c", TWO_PROCESSES, str(folder), str(tmp_path / "d.npy"),
                             json.dumps(rows)], processes=2, devices=4))
    want = cf.value_distribution(car_jax.load_model(folder), tok, [p for p, _ in rows], TAILS)
    np.testing.assert_allclose(np.load(tmp_path / "d.npy"), want, atol=1e-5)


def test_bad_arguments_name_the_value(setup):
    _, tok, model = setup
    prefix = _ids(tok, "Question 3? <confidence>")
    with pytest.raises(ValueError, match="2 tails for 1 prefixes"):
        cf.value_distribution(model, tok, [prefix], [" {} </confidence>"] * 2)
    with pytest.raises(ValueError, match=r"tails\[0\]=' 50 </confidence>' must hold exactly one"):
        cf.value_distribution(model, tok, [prefix], " 50 </confidence>")
    with pytest.raises(ValueError, match=r"tails\[1\]=.*\{x\}"):
        cf.value_distribution(model, tok, [prefix, prefix], [" {} </confidence>", " {x} {} "])
    with pytest.raises(ValueError, match=r"prefixes\[1\] is empty"):
        cf.value_distribution(model, tok, [prefix, []])
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        cf.expected_q(np.ones(3))
    assert cf.value_distribution(model, tok, []).shape == (0, 101)


def test_expected_q_and_mode_by_hand():
    dist = np.zeros((2, 101))
    dist[0, [20, 80]] = 0.5
    dist[1, 100] = 1.0
    np.testing.assert_allclose(cf.expected_q(dist), [0.5, 1.0])
    assert cf.mode_value(dist).tolist() == [20, 100]


# ---------------------------------------------------------------- the prefix of an episode
PROMPT = [1, 2, 3]


def _split(tok, prompt, response_text):
    """confidence_prefix of a response -> (the response text its prefix holds, tail)."""
    ids = _ids(tok, response_text)
    found = cf.confidence_prefix(prompt, ids, tok)
    if found is None:
        return None
    prefix, tail = found
    assert prefix[:len(prompt)] == prompt and prefix[len(prompt):] == ids[:len(prefix) - len(prompt)]
    return tok.decode(prefix[len(prompt):]), tail


@pytest.mark.parametrize("which", ["smollm2", "qwen"])
def test_prefix_at_a_clean_token_boundary(which, smol_tok, qwen_tok):
    tok = smol_tok if which == "smollm2" else qwen_tok
    text = "<think> sure </think>\n<answer> Paris </answer>\n<confidence> 85 </confidence>"
    head, tail = _split(tok, PROMPT, text)
    assert head.endswith("<confidence>") and tail == " {} </confidence>"
    assert head + tail.format(85) == text  # the prefix and the tail give back the model's text


def test_tag_that_ends_inside_a_token(qwen_tok, smol_tok):
    # Qwen2 merges ">\n" into one token: the prefix backs up before it, the tail starts with ">"
    text = "<answer> Paris </answer>\n<confidence>\n85\n</confidence>"
    assert ">\n" in [qwen_tok.decode([i]) for i in _ids(qwen_tok, text)]
    head, tail = _split(qwen_tok, PROMPT, text)
    assert head.endswith("<confidence") and tail == ">\n{}\n</confidence>"
    assert head + tail.format(85) == text
    # SmolLM2 keeps ">" and "\n" apart: the same text splits right after the tag
    head, tail = _split(smol_tok, PROMPT, text)
    assert head.endswith("<confidence>") and tail == "\n{}\n</confidence>"
    # ">)" is one SmolLM2 token; only whitespace is the model's layout, so ")" is dropped
    head, tail = _split(smol_tok, PROMPT, "<answer> x </answer><confidence>)85</confidence>")
    assert head.endswith("<confidence") and tail == ">{}</confidence>"


def test_tag_cut_from_hand_picked_tokens(qwen_tok):
    """Token ids a sampler may write though the tokenizer would not: "<confidence", then ">\\n\\n"
    as one token, then " 40": the prefix stops before that token; ">" and the layout's
    whitespace open the tail."""
    merged = qwen_tok.convert_tokens_to_ids(">ĊĊ")  # ">\n\n" in byte-level form
    assert qwen_tok.decode([merged]) == ">\n\n"
    ids = _ids(qwen_tok, "<answer> x </answer>\n<confidence") + [merged] + _ids(qwen_tok, " 40 </confidence>")
    prefix, tail = cf.confidence_prefix(PROMPT, ids, qwen_tok)
    assert prefix == PROMPT + ids[:ids.index(merged)] and tail == ">\n\n {} </confidence>"


def test_layouts_missing_and_several_tags(smol_tok):
    assert _split(smol_tok, PROMPT, "<answer> x </answer><confidence>85</confidence>")[1] == "{}</confidence>"
    assert _split(smol_tok, PROMPT, "<confidence>  7\t</confidence>")[1] == "  {}\t</confidence>"
    # no closing tag, or nothing inside: the demonstrations' spaces
    assert _split(smol_tok, PROMPT, "<answer> x </answer>\n<confidence>85")[1] == " {} </confidence>"
    # ("><" is one SmolLM2 token: the tag ends inside it, so ">" opens the tail)
    assert _split(smol_tok, PROMPT, "<answer> x </answer>\n<confidence></confidence>")[1] == "> {} </confidence>"
    assert _split(smol_tok, PROMPT, "<answer> x </answer>\n<confidence> \n</confidence>")[1] == " {} </confidence>"
    assert _split(smol_tok, PROMPT, "<answer> x </answer>") is None
    assert _split(smol_tok, PROMPT, "<answer> x </answer>\n<confidenc 80 </confidence>") is None
    assert cf.confidence_prefix(PROMPT, [], smol_tok) is None
    # several tags: the last one counts (its prefix holds the first tag and its value)
    text = "<confidence> 20 </confidence> wait <answer> y </answer>\n<confidence>60</confidence>"
    head, tail = _split(smol_tok, PROMPT, text)
    assert head == "<confidence> 20 </confidence> wait <answer> y </answer>\n<confidence>" and tail == "{}</confidence>"


def test_a_tools_tag_does_not_count(smol_tok):
    """With `sampled` (the loss mask), a tag inside an observation is skipped: the model's own
    earlier tag counts, and a response whose only tag is the tool's has none."""
    own = _ids(smol_tok, "<search> q </search>\n<confidence> 30 </confidence>")
    obs = _ids(smol_tok, "<information> Doc 1: <confidence> 99 </confidence> </information>")
    ids, mask = own + obs, [True] * len(own) + [False] * len(obs)
    prefix, tail = cf.confidence_prefix(PROMPT, ids, smol_tok, sampled=mask)
    assert smol_tok.decode(prefix[3:]) == "<search> q </search>\n<confidence>"
    unmasked, _ = cf.confidence_prefix(PROMPT, ids, smol_tok)  # without the mask the tool's tag is the last
    assert len(unmasked) > len(own) + 3
    assert cf.confidence_prefix(PROMPT, obs, smol_tok, sampled=[False] * len(obs)) is None
    with pytest.raises(ValueError, match="sampled has 2 entries"):
        cf.confidence_prefix(PROMPT, ids, smol_tok, sampled=[True, False])


def test_episode_prefix_feeds_value_distribution(setup):
    """confidence_prefix's (prefix, tail) rows go straight into value_distribution and give the
    re-derivation's numbers, in the demonstrations' layout and in a layout without spaces."""
    name, tok, model = setup
    texts = ["<answer> item 3 </answer>\n<confidence> 70 </confidence>",
             "<answer> item 9 </answer>\n<confidence>9</confidence>"]
    rows = [cf.confidence_prefix(_ids(tok, "Question 3?"), _ids(tok, t), tok) for t in texts]
    dist = cf.value_distribution(model, tok, [p for p, _ in rows], [t for _, t in rows])
    for d, (p, t) in zip(dist, rows):
        np.testing.assert_allclose(d, reference(model, tok, p, t), atol=1e-5)
