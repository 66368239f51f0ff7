"""Why MSCR (b1 = b2 = 1) learns the control's confidences more slowly than Brier: a numpy
simulation of one GRPO group's policy-gradient estimate for the confidence.

Model: a group of G = 16 rollouts of one kind (success probability p) states confidences
q ~ N(m, s) (clipped to [0, 1]); each rollout draws its own coin c ~ Bernoulli(p). The
advantage is Dr.GRPO's (r - group mean, as the control's arms use), and the score-function
estimate of d E[r] / dm is sum_i A_i (q_i - m) / s^2. Per group: its mean (the signal; the
same for Brier and MSCR with b1 = b2, whose rewards differ by c alone: MSCR = 2c - (q - c)^2,
Brier = c - (q - c)^2) and its SD (the noise; c's extra weight adds to it). The ratio of
squared signal-to-noise ratios is how many more groups MSCR needs for a Brier-quality step.

Written after MSCR seed 0's first 400 steps had stalled where Brier's had moved (README).
Run: python results/control_five_long/gradient_noise.py (numpy only, a few seconds).
"""
import numpy as np

G, GROUPS, SD, SEED = 16, 200_000, 0.2, 0


def brier(c, q):
    return c - (q - c) ** 2


def mscr(c, q, b1=1.0, b2=1.0):
    return c * (1 + b1 * (1 - (1 - q) ** 2)) - (1 - c) * b2 * q**2


def estimates(reward, p, m, rng):
    """float[GROUPS]: one gradient estimate per simulated group."""
    q = np.clip(rng.normal(m, SD, (GROUPS, G)), 0.0, 1.0)
    c = (rng.random((GROUPS, G)) < p).astype(np.float64)
    r = reward(c, q)
    a = r - r.mean(axis=1, keepdims=True)
    return (a * (q - m) / SD**2).sum(axis=1)


def main():
    print(f"G = {G}, q ~ N(m, {SD}), {GROUPS:,} groups per cell")
    print("| p | m | Brier: mean, SD | MSCR: mean, SD | groups MSCR needs per Brier group |")
    print("|---|---|---|---|---|")
    for p in (0.1, 0.3, 0.5, 0.7, 0.9):
        for m in (0.3, 0.6):
            rng = np.random.default_rng(SEED)
            gb = estimates(brier, p, m, rng)
            rng = np.random.default_rng(SEED)  # the same q and c: only the reward differs
            gm = estimates(mscr, p, m, rng)
            ratio = (gb.mean() / gb.std()) ** 2 / (gm.mean() / gm.std()) ** 2
            print(f"| {p} | {m} | {gb.mean():+.2f}, {gb.std():.2f} | {gm.mean():+.2f}, {gm.std():.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
