"""A toy GRPO world for studying calibration rewards (notebooks/reward_ablations.ipynb).

Nothing here touches a language model: a "policy" answers questions of known difficulty and
states a verbal confidence, and GRPO trains it under one of car_jax's rewards. Everything is
pure and jitted (`lax.scan` over steps): a 600-step run takes about a second once compiled,
and `run_family` trains many rewards at once under `vmap`.

Shapes are written in words here, not in `car_jax.dims`' letters (those name the model's and
the trainer's dimensions): questions (of the pool), prompts (a step's), group (samples per
prompt, one GRPO group), bins (the verbal confidence is an integer k in 0..bins-1,
q = k / (bins - 1), so 101 bins are "0..100"), steps, grid (points of a q grid), probs (values
of p), runs (of a sweep); B is a flat batch of rows, as elsewhere.

The policy (`Params`), for question n of difficulty d_n ~ N(difficulty_mean, difficulty_std^2):
    self-knowledge  h_n = p_n = sigmoid(skill - d_n)                  (a learnable skill)
    attempt         a ~ Bernoulli(sigmoid(attempt[0] + attempt[1] h_n))
    answer          c ~ Bernoulli(p_n) if a, else c = 0                (no answer is wrong)
    confidence      k ~ Categorical(conf_bias + conf_slope * (a ? h_n : 0)
                                    + (a ? 0 : conf_abstain))
Abstaining ("I don't know") is the cheapest way to be wrong with q = 0: under Brier at w = 1 it
earns 0, exactly what a correct answer stated at q = 0 earns (Brier's reward overlap).
`SimConfig.abstain=False` removes the action, as a control.
The confidence head reads h_n, the policy's own chance of being right, as an LLM's stated
confidence reads the same hidden state as its answer; its gradient reaches `skill` through h_n.
Logits linear in h can represent a peak at q = h exactly: -(q_k - h)^2 / t = -q_k^2 / t +
(2 q_k / t) h + const. The initial head is a discretized Gaussian with mean init_conf_mean +
init_conf_slope * h and width init_conf_width (an overconfident pretrained model); an
abstention initially states q near 0.

Training: one GRPO step per batch, on-policy, so the PPO ratio is 1, clipping is inactive and
the loss reduces to -mean(A * log pi(a, c, k)) with A = (r - mean_group r) / (std_group(r, ddof=1) + eps)
(the trainer's `rl.grpo.group_advantages`), or A = r - mean_group r with `std_norm=False`
(Dr.GRPO). Adam; the skill's steps are `skill_lr_scale` times the heads' (RL moves knowledge less than style);
no KL or entropy term (there is no reference model here).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from car_jax.calibration import metrics, rewards
from car_jax.rl import grpo

# (correct bool[B], q f32[B]) -> r f32[B]: a reward with the format always valid.
OutcomeReward = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Static settings of one simulated run (hashable: shapes and flags, jit-static)."""

    n_questions: int = 512  # N
    difficulty_mean: float = 2.0  # d ~ N(mean, std^2); p = sigmoid(skill - d)
    difficulty_std: float = 2.0
    prompts_per_step: int = 64  # prompts
    group_size: int = 8  # group
    steps: int = 600
    lr: float = 0.05  # Adam step size
    skill_lr_scale: float = 0.05  # the skill's step is lr * skill_lr_scale (knowledge moves slowly)
    n_bins: int = 101  # bins: verbal confidence 0..n_bins-1
    init_skill: float = 0.0
    init_attempt_logit: float = 3.0  # P(attempt) = sigmoid(3) = 0.95 at the start
    init_conf_mean: float = 0.6  # initial peak of q at mean + slope * h (cut to [0, 1])
    init_conf_slope: float = 0.3
    init_conf_width: float = 0.15  # std of the initial discretized Gaussian over q
    abstain: bool = True  # the policy may give no answer (always wrong)
    std_norm: bool = True  # GRPO divides by the group std; False: Dr.GRPO (mean only)
    eps: float = 1e-6  # GRPO's std epsilon


class Params(NamedTuple):
    """The policy. skill f32[]; attempt f32[2] (bias, slope on h of the attempt logit);
    conf_bias, conf_slope, conf_abstain f32[bins] (confidence logits, see the module doc)."""

    skill: jax.Array
    attempt: jax.Array
    conf_bias: jax.Array
    conf_slope: jax.Array
    conf_abstain: jax.Array


def outcome_reward(cfg: rewards.RewardConfig) -> OutcomeReward:
    """A `RewardConfig`'s reward as (correct bool[B], q f32[B]) -> f32[B], format always valid."""
    fn = rewards.reward_fn(cfg)
    return lambda correct, q: fn(correct, q, jnp.ones(jnp.shape(correct), bool))


def expected_reward(reward: OutcomeReward, p, q) -> jax.Array:
    """E[R] = p R(1, q) + (1 - p) R(0, q) for p f32[probs] and q f32[grid] -> f32[probs, grid]."""
    q = jnp.asarray(q, jnp.float32)
    right = reward(jnp.ones(q.shape, bool), q)  # f32[grid]
    wrong = reward(jnp.zeros(q.shape, bool), q)  # f32[grid]
    p = jnp.asarray(p, jnp.float32)[:, None]
    return p * right + (1.0 - p) * wrong


def numeric_q_star(reward: OutcomeReward, p, q) -> jax.Array:
    """argmax over the grid q f32[grid] of E[R](p, q), for each p f32[probs] -> f32[probs].

    Ties go to the smallest q (so a reward flat in q, like binary, reports q = 0).
    """
    return jnp.asarray(q, jnp.float32)[jnp.argmax(expected_reward(reward, p, q), axis=1)]


def mscr_q_star(p, b1=1.0, b2=1.0) -> jax.Array:
    """Analytic optimum of MSCR: q* = p b1 / (p b1 + (1 - p) b2), f32[...] -> f32[...].

    Brier and weighted Brier (any w > 0) are proper: their q* = p, which is b1 = b2 here.
    """
    p = jnp.asarray(p, jnp.float32)
    return p * b1 / (p * b1 + (1.0 - p) * b2)


def group_advantages(r: jax.Array, eps: float = 1e-6, std_norm: bool = True) -> jax.Array:
    """GRPO advantages with each row of r f32[prompts, group] a group (`rl.grpo.group_advantages`, the
    trainer's): (r - mean_group) / (std_group(ddof=1) + eps), f32[prompts, group]; with std_norm=False
    (Dr.GRPO) just r - mean_group.

    A group whose rewards are all equal gets A = 0: it carries no learning signal.
    """
    p, g = r.shape
    groups = jnp.repeat(jnp.arange(p, dtype=jnp.int32), g)
    return grpo.group_advantages(r.reshape(-1), groups, std_norm=std_norm, eps=eps).reshape(p, g)


def difficulties(cfg: SimConfig, key: jax.Array) -> jax.Array:
    """The question pool: f32[questions] difficulties, N(difficulty_mean, difficulty_std^2)."""
    return cfg.difficulty_mean + cfg.difficulty_std * jax.random.normal(key, (cfg.n_questions,))


def init_params(cfg: SimConfig) -> Params:
    """The initial policy: skill = init_skill, mostly attempting, a discretized-Gaussian
    confidence head whose mean rises with h (overconfident when init_conf_mean is high);
    an abstention states q near 0."""
    qk = jnp.linspace(0.0, 1.0, cfg.n_bins)  # f32[bins]
    t = 2.0 * cfg.init_conf_width**2
    bias = -((qk - cfg.init_conf_mean) ** 2) / t
    slope = 2.0 * cfg.init_conf_slope * qk / t  # shifts the peak by init_conf_slope * h
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    abstain = -(qk**2) / t - bias  # moves the peak to q = 0 for an abstention
    return Params(f32(cfg.init_skill), f32([cfg.init_attempt_logit, 0.0]), f32(bias), f32(slope),
                  f32(abstain))


class Sample(NamedTuple):
    """`group` draws for each of the prompts: attempted, correct bool[prompts, group];
    k int32[prompts, group] (q = k / (bins - 1))."""

    attempted: jax.Array
    correct: jax.Array
    k: jax.Array


def _heads(params: Params, d: jax.Array):
    """d f32[prompts] -> (answer logit z f32[prompts], attempt logit f32[prompts], self-knowledge h f32[prompts])."""
    z = params.skill - d
    h = jax.nn.sigmoid(z)
    attempt = params.attempt[0] + params.attempt[1] * h
    return z, attempt, h


def _conf_logits(params: Params, h: jax.Array, attempted: jax.Array) -> jax.Array:
    """h f32[prompts], attempted bool[prompts, group] -> confidence logits
    f32[prompts, group, bins]; an abstention reads
    h = 0 (no answer cannot be right) plus its own offset conf_abstain."""
    a = attempted[..., None]
    return (params.conf_bias + params.conf_slope * jnp.where(a, h[:, None, None], 0.0)
            + jnp.where(a, 0.0, params.conf_abstain))


def sample(cfg: SimConfig, params: Params, d: jax.Array, key: jax.Array, g: int) -> Sample:
    """Samples g (attempt, correctness, confidence) triples per question of d f32[prompts]."""
    z, attempt, h = _heads(params, d)
    ka, kc, kq = jax.random.split(key, 3)
    shape = (d.shape[0], g)
    attempted = jax.random.bernoulli(ka, jax.nn.sigmoid(attempt)[:, None], shape)
    if not cfg.abstain:
        attempted = jnp.ones(shape, bool)
    correct = attempted & jax.random.bernoulli(kc, jax.nn.sigmoid(z)[:, None], shape)
    k = jax.random.categorical(kq, _conf_logits(params, h, attempted))  # int32[prompts, group]
    return Sample(attempted, correct, k.astype(jnp.int32))


def log_prob(cfg: SimConfig, params: Params, d: jax.Array, s: Sample) -> jax.Array:
    """log pi(attempt, c, k | question) for d f32[prompts] and a Sample of [prompts, group] -> f32[prompts, group]."""
    z, attempt, h = _heads(params, d)
    lp_a = jnp.where(s.attempted, jax.nn.log_sigmoid(attempt)[:, None],
                     jax.nn.log_sigmoid(-attempt)[:, None])
    if not cfg.abstain:
        lp_a = jnp.zeros_like(lp_a)
    lp_c = jnp.where(s.correct, jax.nn.log_sigmoid(z)[:, None], jax.nn.log_sigmoid(-z)[:, None])
    lp_c = jnp.where(s.attempted, lp_c, 0.0)  # no answer, no correctness draw
    logp_k = jax.nn.log_softmax(_conf_logits(params, h, s.attempted))  # f32[prompts, group, bins]
    lp_k = jnp.take_along_axis(logp_k, s.k[..., None], -1)[..., 0]
    return lp_a + lp_c + lp_k


def optimizer(cfg: SimConfig) -> optax.GradientTransformation:
    """Adam at lr (as LLM RL uses; plain SGD would let the bias logits of the bins crawl), the skill's
    step scaled by skill_lr_scale."""
    scale = Params(cfg.skill_lr_scale, 1.0, 1.0, 1.0, 1.0)
    return optax.chain(optax.adam(cfg.lr),
                       optax.stateless(lambda u, _: jax.tree.map(jnp.multiply, u, scale)))


def grpo_step(cfg: SimConfig, reward: OutcomeReward, state: tuple[Params, optax.OptState],
              pool: jax.Array, key: jax.Array):
    """One GRPO step on cfg.prompts_per_step prompts drawn from the pool f32[questions]: (params, opt_state) ->
    ((params, opt_state), metrics of f32[]).

    Metrics are over the P * G training samples: accuracy, ece, mean_confidence, reward,
    attempt_rate, dead_groups (fraction of groups with zero reward spread, hence no signal),
    and the skill after the step.
    """
    params, opt_state = state
    kp, ks = jax.random.split(key)
    d = pool[jax.random.randint(kp, (cfg.prompts_per_step,), 0, pool.shape[0])]  # f32[prompts]
    s = sample(cfg, params, d, ks, cfg.group_size)  # [prompts, group] each
    q = s.k.astype(jnp.float32) / (cfg.n_bins - 1)
    r = reward(s.correct.reshape(-1), q.reshape(-1)).reshape(q.shape)  # f32[prompts, group]
    adv = group_advantages(r, cfg.eps, cfg.std_norm)

    def loss(p: Params) -> jax.Array:
        return -jnp.mean(adv * log_prob(cfg, p, d, s))

    updates, opt_state = optimizer(cfg).update(jax.grad(loss)(params), opt_state)
    params = optax.apply_updates(params, updates)
    cal = metrics.calibration_arrays(s.correct.reshape(-1), q.reshape(-1))
    out = {
        "accuracy": cal["accuracy"],
        "ece": cal["ece"],
        "mean_confidence": cal["mean_confidence"],
        "reward": jnp.mean(r),
        "attempt_rate": jnp.mean(s.attempted),
        "dead_groups": jnp.mean(jnp.all(r == r[:, :1], axis=1)),
        "skill": params.skill,
    }
    return (params, opt_state), out


def simulate(cfg: SimConfig, reward: OutcomeReward, key: jax.Array):
    """A full run (pure; jit it, or call `run`). key -> (final Params, history {name: f32[steps]},
    pool f32[questions]). The pool depends on `key` only, so runs with one key share their questions."""
    k_pool, k_train = jax.random.split(key)
    pool = difficulties(cfg, k_pool)

    def body(state, k):
        return grpo_step(cfg, reward, state, pool, k)

    params = init_params(cfg)
    state = (params, optimizer(cfg).init(params))
    (params, _), hist = jax.lax.scan(body, state, jax.random.split(k_train, cfg.steps))
    return params, hist, pool


def evaluate(cfg: SimConfig, params: Params, pool: jax.Array, key: jax.Array,
             samples: int = 16) -> dict[str, jax.Array]:
    """Fresh samples, `samples` per question of the pool f32[questions] -> metrics.calibration_arrays
    over the questions x samples (correct, q) pairs (dict of f32[])."""
    s = sample(cfg, params, pool, key, samples)
    q = s.k.astype(jnp.float32) / (cfg.n_bins - 1)
    out = metrics.calibration_arrays(s.correct.reshape(-1), q.reshape(-1))
    return {**out, "attempt_rate": jnp.mean(s.attempted)}


def _run(cfg: SimConfig, reward: OutcomeReward, key: jax.Array):
    params, hist, pool = simulate(cfg, reward, key)
    final = evaluate(cfg, params, pool, jax.random.fold_in(key, 1))
    return params, hist, final


@functools.partial(jax.jit, static_argnums=(0, 1))
def run(cfg: SimConfig, reward: OutcomeReward, key: jax.Array):
    """Jitted `simulate` + `evaluate`: -> (Params, history {name: f32[steps]}, final {name: f32[]}).

    `reward` is static: pass the same function object to reuse the compiled run.
    """
    return _run(cfg, reward, key)


def family_reward(correct, q, theta) -> jax.Array:
    """R = c [a + b (1 - (1 - q)^2)] - (1 - c) g q^2 with theta = (a, b, g) f32[3]:
    bool[B], f32[B] -> f32[B]. Every reward of car_jax is one point (`family_theta`), so one
    compiled program can train under all of them and under a whole b1/b2 grid."""
    c, q = jnp.asarray(correct, jnp.float32), jnp.asarray(q, jnp.float32)
    return c * (theta[0] + theta[1] * (1.0 - (1.0 - q) ** 2)) - (1.0 - c) * theta[2] * q**2


def family_theta(cfg: rewards.RewardConfig) -> tuple[float, float, float]:
    """(a, b, g) of a RewardConfig's reward (format ignored): binary (1, 0, 0); weighted Brier
    c - w (q - c)^2 = c [(1 - w) + w (1 - (1 - q)^2)] - (1 - c) w q^2, so (1 - w, w, w) and
    Brier (0, 1, 1); MSCR (1, b1, b2)."""
    if cfg.kind == "binary":
        return (1.0, 0.0, 0.0)
    if cfg.kind in ("brier", "weighted_brier"):
        w = 1.0 if cfg.kind == "brier" else cfg.weight
        return (1.0 - w, w, w)
    return (1.0, cfg.b1, cfg.b2)


@functools.partial(jax.jit, static_argnums=0)
def run_family(cfg: SimConfig, thetas: jax.Array, key: jax.Array):
    """`run` under M rewards of the family at once (vmap, one compile per cfg):
    thetas f32[runs, 3] -> (history {name: f32[runs, steps]}, final {name: f32[runs]}), row i for thetas[i].

    Every run uses the same key, hence the same question pool and the same random stream.
    """
    def one(theta):
        _, hist, final = _run(cfg, lambda c, q: family_reward(c, q, theta), key)
        return hist, final

    return jax.vmap(one)(jnp.asarray(thetas, jnp.float32))


def row(tree: dict, i: int) -> dict:
    """Row i of every array of a batched result ({name: f[runs, ...]} -> {name: f[...]})."""
    return {k: v[i] for k, v in tree.items()}


def moving_average(x, window: int = 20) -> np.ndarray:
    """Host smoothing for plots: x f[steps] -> float64[steps - window + 1], means of `window` steps."""
    return np.convolve(np.asarray(x, np.float64), np.ones(window) / window, mode="valid")


def summarize(hist: dict, final: dict, window: int = 20) -> dict[str, float]:
    """One run's numbers as floats: the final metrics (from `run`) plus collapse markers of the
    history: start_accuracy (first window), min_accuracy and min_attempt (smoothed minima)."""
    out = {k: float(v) for k, v in final.items()}
    acc = moving_average(hist["accuracy"], window)
    out.update(start_accuracy=float(acc[0]), min_accuracy=float(acc.min()),
               min_attempt=float(moving_average(hist["attempt_rate"], window).min()))
    return out
