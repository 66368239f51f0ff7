"""Generation: greedy parity with transformers, BPE-robust stops, sampling statistics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import car_jax
from car_jax.models.policy import PLAIN, XLA_CPU
from car_jax.rollout.generate import generate, generate_ids
from car_jax.rollout.sampling import Sampler, truncate
from car_jax.rollout.stops import STOP, Balanced, matches, stop_tables, token_texts
from tests.hf_factory import StubTokenizer, build, qwen_tokenizer
from tests.truncated import smollm2_short  # noqa: F401 (a fixture)

PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write one short sentence about the ocean and the moon at night, please.", "Hi"]


def _chat_ids(tok, prompts):
    """The chat-templated prompts, as text and as token ids."""
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    return texts, [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _hf_greedy(hf, batch, max_new_tokens, eos, pad_id):
    """transformers' greedy decoding of a left-padded batch -> (new tokens int[B, R], their
    log-softmax float[B, R, V])."""
    import torch
    with torch.no_grad():
        out = hf.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                          eos_token_id=eos, output_scores=True, return_dict_in_generate=True)
    logp = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1)
    return out.sequences[:, batch["input_ids"].shape[1]:].numpy(), logp.numpy()


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_hf):
    """The embedded model's tokenizer as users load it: from its converted folder."""
    return car_jax.load_tokenizer(smollm2_hf)


@pytest.fixture(scope="module")
def short_reference(smollm2_short, smollm2_tok):
    """transformers' greedy decoding of PROMPTS (32 tokens, one left-padded batch) on the cut
    SmolLM2 (tests/truncated.py), once for both policies: (tokenizer, prompt ids, EOS ids,
    new tokens int[4, 32], their log-softmax float[4, 32, V])."""
    import transformers
    tok = smollm2_tok  # the cut folder holds the same tokenizer files
    texts, ids = _chat_ids(tok, PROMPTS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_short).eval()
    batch = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # the cut model never writes <|im_end|>; the EOS id is also the first token that row 0
    # of transformers' free run writes (from step 4 on) and row 3 never does: row 0 then
    # stops early, row 3 runs to the budget
    free, _ = _hf_greedy(hf, batch, 32, [im_end], tok.pad_token_id)
    stop_id = int(next(t for t in free[0, 4:] if t not in free[3]))
    assert stop_id != tok.pad_token_id
    eos = [stop_id, im_end]
    return (tok, ids, eos, *_hf_greedy(hf, batch, 32, eos, tok.pad_token_id))


@pytest.mark.parametrize("policy", [PLAIN, XLA_CPU], ids=lambda p: p.name)
def test_greedy_equals_transformers_generate(smollm2_short, short_reference, policy):
    """Greedy decoding of four prompts of different lengths in one left-padded batch, on the
    real SmolLM2 weights cut to two layers (tests/truncated.py: depth adds nothing here but
    compile time): the tokens are transformers' generate's, their recorded log-probs its
    log-softmax, and rows stop at an EOS id where transformers' rows do, the rest running
    to the budget. With the XLA:CPU policy the 32 steps run in two decode stages."""
    tok, ids, eos, ref, ref_logp = short_reference
    assert len({len(i) for i in ids}) == 4  # four different prompt lengths
    model = car_jax.load_model(smollm2_short, policy=policy)
    ours = generate_ids(model, tok, ids, max_new_tokens=32, eos=np.array(eos, np.int32))
    assert ours.eos[0] and not ours.stopped[3] and int(ours.length[3]) == 32
    for b in range(4):
        n = int(ours.length[b])
        np.testing.assert_array_equal(ours.tokens[b, :n], ref[b, :n])
        # float32 on both sides, two layers and a 49,152-way log-softmax: up to 5e-5 apart here
        np.testing.assert_allclose(ours.logp[b, :n], ref_logp[b, np.arange(n), ref[b, :n]], atol=2e-4)
        if n < 32:  # we stopped at EOS: transformers did too, and only pads follow
            assert ours.eos[b] and (ref[b, n:] == tok.pad_token_id).all()


@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def vocab(request):
    tok = request.getfixturevalue("smollm2_tok") if request.param == "smollm2" else qwen_tokenizer()
    patterns = ["</search>", "</answer>", ("```python", "```"), Balanced("\\boxed{")]
    return tok, token_texts(tok), stop_tables(tok, patterns), patterns


FRAGMENTS = ["</search>", "</answer>", "</", "search", ">", "\n", "\n\n", ">\n\n", "```", "```python\n",
             "python", "print(1)", " the", "<answer>", "Paris", "sea", "rch>", "`", "``", "</sea", " ", "ans",
             "\\boxed{", "\\box", "ed{", "{", "}", "}}", "\\frac{1}{2}", "x}", "{{"]


@settings(max_examples=80, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=12), split=st.booleans())
def test_stop_automaton_agrees_with_text_search(vocab, parts, split):
    tok, texts, tables, patterns = vocab
    if split:  # force token boundaries at fragment edges (as a sampler may produce)
        ids = [i for p in parts for i in tok(p, add_special_tokens=False)["input_ids"]]
    else:  # let BPE merge across fragments (">\n\n", "`\n" ...)
        ids = tok("".join(parts), add_special_tokens=False)["input_ids"]
    for p, pattern in enumerate(patterns):
        state, fired_at = 0, None
        for i, t in enumerate(ids):
            state = tables[p, state, t]
            if state == STOP:
                fired_at = i
                break
        prefix_hits = [matches("".join(texts[t] for t in ids[: i + 1]), pattern) for i in range(len(ids))]
        expected = prefix_hits.index(True) if True in prefix_hits else None
        assert fired_at == expected, (pattern, [texts[t] for t in ids])


def test_stop_strings_end_generation(tmp_path, smollm2_tok):
    build("llama", tmp_path, vocab_size=49152)
    model = car_jax.load_model(tmp_path)
    tok = smollm2_tok
    texts = token_texts(tok)
    kwargs = dict(max_new_tokens=40, sampler=Sampler(1.0), seed=3, eos=np.array([], np.int32))
    free = generate_ids(model, tok, [tok("hello")["input_ids"]], **kwargs).tokens[0]
    stop = texts[free[6]]  # a string the free run is known to produce
    assert stop.strip()
    expected = next(i for i in range(40) if stop in "".join(texts[t] for t in free[: i + 1]))
    out = generate_ids(model, tok, [tok("hello")["input_ids"]], stop=[stop], **kwargs)
    # same seed, same draws: the stopped run is the free run cut right after the stop
    assert out.stopped[0] and not out.eos[0] and out.pattern[0] == 0
    assert int(out.length[0]) == expected + 1
    np.testing.assert_array_equal(out.tokens[0, : expected + 1], free[: expected + 1])


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build("qwen2", folder, vocab_size=16)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return car_jax.load_model(tiny_folder)


def _Tok():  # a tokenizer stub for the 16-token tiny model
    return StubTokenizer(16)


@pytest.mark.parametrize("policy", [PLAIN, XLA_CPU], ids=lambda p: p.name)
def test_sampling_frequencies_match_softmax(tiny_folder, policy):
    """Both policies' draws (Gumbel-max, inverse CDF) follow the softmax."""
    tiny = car_jax.load_model(tiny_folder, policy=policy)
    prompt = [3, 7, 1, 4]
    temperature = 1.7
    n = 4000
    out = generate_ids(tiny, _Tok(), [prompt] * n, max_new_tokens=1, sampler=Sampler(temperature),
                       eos=np.array([], np.int32), seed=0)
    logits = np.asarray(tiny.logits(np.array([prompt])))[0, -1]
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    counts = np.bincount(out.tokens[:, 0], minlength=16)
    # chi-square goodness of fit, 15 dof: the 0.999 quantile is 37.7
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
    assert chi2 < 37.7
    # recorded log-probs are those of the temperature-scaled policy
    np.testing.assert_allclose(out.logp[:, 0], np.log(p)[out.tokens[:, 0]], atol=1e-5)


def test_inverse_cdf_draws_match_softmax_over_blocks():
    """The two-level CDF inversion against numpy's softmax on a vocabulary that is not a
    multiple of the block (1000 = 3 x 256 + 232), with the mass spread over tokens in
    several blocks and a whole block (and scattered tokens) truncated away."""
    from car_jax.models.xla_cpu import inverse_cdf
    rng = np.random.default_rng(1)
    v, n = 1000, 20000
    logits = np.full(v, np.finfo(np.float32).min, np.float32)
    live = np.concatenate([rng.choice(256, 10, replace=False), 512 + rng.choice(488, 14, replace=False)])
    logits[live] = rng.normal(size=live.size).astype(np.float32) * 1.5  # block 1 (256..511) has no mass
    p = np.zeros(v)
    p[live] = np.exp(logits[live] - logits[live].max())
    p /= p.sum()
    draws = np.asarray(inverse_cdf(jnp.asarray(np.tile(logits, (n, 1))), jax.random.key(0)))
    counts = np.bincount(draws, minlength=v)
    assert counts[p == 0].sum() == 0  # truncated tokens are never drawn
    expected = n * p[live]
    chi2 = ((counts[live] - expected) ** 2 / expected).sum()
    assert chi2 < 49.7  # chi-square goodness of fit, 23 dof: the 0.999 quantile is 49.7


def test_seed_reproducible(tiny):
    kwargs = dict(max_new_tokens=12, sampler=Sampler(1.0, top_p=0.9, top_k=8), eos=np.array([], np.int32))
    a = generate_ids(tiny, _Tok(), [[1, 2, 3], [4, 5]], seed=7, **kwargs)
    b = generate_ids(tiny, _Tok(), [[1, 2, 3], [4, 5]], seed=7, **kwargs)
    c = generate_ids(tiny, _Tok(), [[1, 2, 3], [4, 5]], seed=8, **kwargs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).any()


def test_a_rows_draws_do_not_depend_on_the_other_rows(tiny):
    """Per-episode randomness (`decode.episode_keys`, a row's episode is its index): with the
    same seed, a row's sampled tokens are the same whatever the other rows hold."""
    kwargs = dict(max_new_tokens=12, sampler=Sampler(1.0), eos=np.array([], np.int32), seed=7)
    a = generate_ids(tiny, _Tok(), [[1, 2, 3], [4, 5]], **kwargs)
    b = generate_ids(tiny, _Tok(), [[1, 2, 3], [9, 9, 9, 9]], **kwargs)
    np.testing.assert_array_equal(a.tokens[0], b.tokens[0])
    np.testing.assert_allclose(a.logp[0], b.logp[0], atol=1e-6)
    assert (a.tokens[1] != b.tokens[1]).any()


def test_truncate_matches_numpy():
    """top-k first, then the nucleus of the renormalised top-k distribution (the order
    transformers applies its warpers in)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 20)).astype(np.float32) * 2
    for top_k, top_p in [(5, 1.0), (0, 0.7), (4, 0.5), (0, 0.05)]:
        kept = np.asarray(truncate(jnp.asarray(logits), top_k, top_p)) > -1e30
        for row, keep in zip(logits, kept):
            order = np.argsort(-row)
            if top_k:
                order = order[:top_k]
            allowed = set(order)
            probs = np.exp(row[order] - row.max())
            probs /= probs.sum()
            mass_before = np.concatenate([[0], np.cumsum(probs)[:-1]])
            nucleus = set(order[mass_before < top_p])
            assert set(np.flatnonzero(keep)) == allowed & nucleus


@pytest.mark.parametrize("policy", [PLAIN, XLA_CPU], ids=lambda p: p.name)
def test_top_k_one_is_greedy(tiny_folder, policy):
    tiny = car_jax.load_model(tiny_folder, policy=policy)
    prompts = [[1, 2, 3], [9, 9]]
    greedy = generate_ids(tiny, _Tok(), prompts, max_new_tokens=8, eos=np.array([], np.int32))
    top1 = generate_ids(tiny, _Tok(), prompts, max_new_tokens=8, sampler=Sampler(1.3, top_k=1),
                        eos=np.array([], np.int32), seed=5)
    np.testing.assert_array_equal(greedy.tokens, top1.tokens)


def test_bad_sampler_settings_are_refused():
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")]:
        with pytest.raises(ValueError, match=field):
            Sampler(**kwargs)


def test_generate_text_api(smollm2_hf, smollm2_tok):
    """The API users call, on the whole embedded model (30 layers, the backend's policy): chat
    messages in, text out, the answer right, and the text that of transformers' greedy
    decoding of the same prompt up to <|im_end|>. 16 tokens: the answer and its EOS fit, and
    the decode loop runs in one stage (the staged loop is compared on the cut model above)."""
    import transformers
    model = car_jax.load_model(smollm2_hf)
    tok = smollm2_tok
    question = "What is the capital of France?"
    [text] = generate(model, tok, [[{"role": "user", "content": question}]], max_new_tokens=16)
    assert "Paris" in text
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf).eval()
    texts, _ = _chat_ids(tok, [question])
    batch = tok(texts, add_special_tokens=False, return_tensors="pt")
    ref, _ = _hf_greedy(hf, batch, 16, tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]),
                        tok.pad_token_id)
    assert text == tok.decode(ref[0], skip_special_tokens=True)


def test_balanced_stop_counts_nested_braces():
    """The boxed stop fires on the brace that closes `\\boxed{`, however the text is split."""
    assert matches("\\boxed{\\frac{1}{2}}", Balanced("\\boxed{"))
    assert not matches("\\boxed{\\frac{1}{2}", Balanced("\\boxed{"))  # the first } is not the end
    assert not matches("{}} \\boxed{", Balanced("\\boxed{"))  # braces before the opener do not count
    with pytest.raises(ValueError, match="open"):
        Balanced("\\boxed(")
