"""The CAR training loop: rollout (device + tools) -> rewards -> GRPO updates, with
checkpoints, metrics and resume. `car-jax train --config configs/X.yaml key=value ...`.

One step:
  1. take the next `prompts_per_step` examples (the data position is checkpointed),
  2. run G episodes per prompt with the current policy (KV cache kept across tool calls),
  3. parse them on the host (answer, confidence, format: string work) into a HostBatch,
  4. cross to the device once (`batches.to_device`); there the configured reward, the group
     advantages and the reference log-probs (if kl_coef > 0) are computed from the batch,
  5. `epochs` passes of shuffled mini-batches, gathered on the device, through the jitted
     train step. Only metrics come back to the host.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from car_jax import hosts
from car_jax.calibration import metrics as cal
from car_jax.calibration.rewards import RewardInputs, reward_fn, reward_inputs, shaped_rewards
from car_jax.checkpoints.loader import save_hf_folder
from car_jax.checkpoints.peft import save_peft_folder
from car_jax.checkpoints.train_state import TrainCheckpointer, abstract_state
from car_jax.config import ConfigError, dump_config, save_config
from car_jax.data import DatasetError, chance, load_dataset, make_prompt, world_retriever
from car_jax.data.chat_tools import tool_prompts
from car_jax.loading import Model
from car_jax.models.policy import device_kind
from car_jax.rl import dynamic
from car_jax.rl.batches import TrainBatch, chunked_logprobs, micro_batches, share_prompts, to_device
from car_jax.rl.group_stats import group_stats
from car_jax.rl.host_batch import HostBatch, host_batch, longest, micro_plan
from car_jax.rl.steps import OptimConfig, init_state, make_optimizer, make_sft_step, state_shardings, with_frozen
from car_jax.rollout.episode import EpisodeStats, run_episodes
from car_jax.train import flops
from car_jax.train.config import TrainConfig
from car_jax.train.log import MetricsLogger, NullLogger, Progress, Timer
from car_jax.train.loggers import Sample, import_wandb
from car_jax.train.setup import Setup, build_setup, overlong
from car_jax.train.sft import TOOL_DEMOS, chance_demos, read_demos, run_sft, tokenize_demos, tool_demos, world_demos


class Trainer:
    """Holds the run's state; `run()` trains to `rl.steps`, resuming if it can.

    With several processes (`jax.distributed`) every process runs this same loop: each
    rolls out its block of a step's rows (whole GRPO groups; `hosts.local_rows`) and
    calls the tools for those, the device arrays are assembled from every process's
    block, metrics are gathered so that all processes log the same values, checkpoints
    are written by all (orbax), and only process 0 writes files (`hosts.is_writer`)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        if "wandb" in cfg.run.loggers and hosts.is_writer():
            import_wandb()  # a missing `wandb` extra fails here, before the data and the model load
        self.step_samples: list[Sample] = []  # the last step's samples, for the loggers (`samples`)
        self.examples = training_examples(cfg)  # before the model loads: a bad data path fails in seconds
        self.setup: Setup = build_setup(cfg)
        # the scorer's reward, on the host too: dynamic sampling's filter reads the rewards
        self.rewards = jax.jit(functools.partial(shaped_rewards, reward_fn(cfg.reward), overlong(cfg)))
        self.dir = Path(cfg.run.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if hosts.is_writer():
            save_config(cfg, self.dir / "config.yaml")
        self.ckpt = TrainCheckpointer(self.dir / "checkpoints", keep=cfg.run.keep, every=cfg.run.checkpoint_every)
        # the data sources (`QAExample.data_source`): with several, the metrics break q and
        # accuracy down by source (the chance task: one source per coin kind)
        self.sources = sorted({ex.data_source for ex in self.examples})
        self._source_index = {name: i for i, name in enumerate(self.sources)}
        self.data_pos = 0
        self.start_step = 0
        # the SFT result is saved once (dir/warm_start): it is the KL reference of every
        # later step, so a resumed run must read it back, not fall back to the base model
        self.warm_ckpt = TrainCheckpointer(self.dir / "warm_start", keep=1, async_save=False)
        warm = bool(cfg.sft.steps and cfg.sft.data)
        if cfg.run.resume and self.ckpt.latest_step() is not None:
            if warm and self.setup.ref_params is not None:  # before the restore: SFT starts from the loaded model
                self.setup.set_reference(self.warm_start_params(), copy=False)
            self._restore()
        elif warm:
            params = self.warm_start_params()
            self.setup.state = init_state(params, make_optimizer(cfg.rl.optim), self.setup.model.mesh)
            if self.setup.ref_params is not None:
                self.setup.set_reference(params)

    def warm_start_params(self):
        """The policy after the SFT warm start: read from dir/warm_start when a previous
        attempt of this run saved it (and run.resume is on), else trained on the
        configured demonstrations from the loaded model and saved there. It becomes both
        the RL starting policy and (with KL) the reference. Losses go to
        sft_metrics.jsonl."""
        cfg, s = self.cfg, self.setup
        target = {"params": abstract_state(s.state.params)}
        if cfg.run.resume and self.warm_ckpt.latest_step() == cfg.sft.steps:
            return self.warm_ckpt.restore(None, target)[0]["params"]
        if cfg.sft.data == "world" and cfg.data.template in TOOL_DEMOS:  # both tools: the run's own
            demos = tool_demos(self.examples, s.toolbox.tools, template=cfg.data.template)
        elif cfg.sft.data == "world":
            demos = world_demos(self.examples, world_retriever(), cfg.data.template)
        elif cfg.sft.data == chance.NAME:  # the positive control: the layout, uninformative confidences
            demos = chance_demos(self.examples, "random", cfg.seed)
        else:
            demos = read_demos(cfg.sft.data)
        trajs = tokenize_demos(demos, s.tokenizer)
        opt = make_optimizer(OptimConfig(lr=cfg.sft.lr, total_steps=cfg.sft.steps, weight_decay=0.0))
        state = init_state(jax.tree.map(jnp.copy, s.state.params), opt, s.model.mesh)
        with self._logger(self.dir / "sft", loggers=(),
                          progress=Progress(cfg.sft.steps, desc="sft", show=("sft_loss",))) as log:
            step_fn = make_sft_step(s.model.module, opt, s.model.mesh, state_shardings(state) if s.model.mesh else None,
                                    frozen_shardings=s.frozen_shardings())
            step_fn = with_frozen(step_fn, s.frozen)  # LoRA: the adapters train over the frozen base
            state, _ = run_sft(state, step_fn, trajs, cfg.sft, pad_id=s.tokenizer.pad_token_id or 0, seed=cfg.seed,
                               log=lambda step, loss: log.log(step, {"sft_loss": loss}), mesh=s.model.mesh)
        if self.warm_ckpt.all_steps():  # another sft.steps' result, or resume off: stale
            self.warm_ckpt.close()
            if hosts.is_writer():
                shutil.rmtree(self.warm_ckpt.directory)
            hosts.sync("warm_start removed")
            self.warm_ckpt = TrainCheckpointer(self.dir / "warm_start", keep=1, async_save=False)
        # the SFT step keeps the sharding table's layout (a jitted train step over several
        # processes refuses any other layout of its inputs)
        self.warm_ckpt.save(cfg.sft.steps, {"params": state.params}, {"sft_steps": cfg.sft.steps})
        return state.params

    @staticmethod
    def _logger(run_dir, **kwargs):
        """The metrics logger: the JSONL, the run.loggers and the bar in process 0, nothing elsewhere."""
        return MetricsLogger(run_dir, **kwargs) if hosts.is_writer() else NullLogger()

    # -- data -------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.cfg.data.shuffle_seed, epoch]).permutation(len(self.examples))

    def next_examples(self, n: int):
        """The next n examples of the shuffled stream (a new shuffle each pass)."""
        picked = []
        while len(picked) < n:
            epoch, offset = divmod(self.data_pos, len(self.examples))
            picked.append(self.examples[self._order(epoch)[offset]])
            self.data_pos += 1
        return picked

    # -- checkpoints --------------------------------------------------------------------
    def _state_tree(self):
        st = self.setup.state
        return {"params": st.params, "opt_state": st.opt_state, "step": st.step}

    def _restore(self):
        tree, meta = self.ckpt.restore(None, abstract_state(self._state_tree()))
        self.setup.state = dataclasses.replace(self.setup.state, params=tree["params"],
                                               opt_state=tree["opt_state"], step=tree["step"])
        self.data_pos = int(meta["data_pos"])
        self.start_step = int(meta["step"])

    def _save(self, step: int, force: bool = False):
        meta = {"step": step, "data_pos": self.data_pos}
        if force:
            self.ckpt.save(step, self._state_tree(), meta)
        else:
            self.ckpt.maybe_save(step, self._state_tree(), meta)

    # -- one step -------------------------------------------------------------------------
    def rollout(self, step: int, timer: Timer):
        """G episodes for each of this process's share of the next prompts (all of them
        with one process), parsed on the host: (trajectories, HostBatch of these rows with
        the step's global ids and widths, episode stats, int64[b] each row's index in
        self.sources, the examples of these rows: one per group of G rows, the dynamic
        sampling metrics). With rl.dynamic_sampling on, more rounds of prompts are sampled
        until every process holds its share of groups that carry a signal (`rl.dynamic`)."""
        cfg, s = self.cfg, self.setup
        g, ds = cfg.rollout.group_size, cfg.rl.dynamic_sampling
        policy = Model(s.model.config, s.policy_params(), s.model.module, s.model.mesh, s.model.source)
        stats = EpisodeStats()
        rounds, signal = [], []  # per round: (examples, trajectories, reward inputs), bool[groups]
        for r in range(ds.max_rounds if ds.filter != "off" else 1):
            rounds.append(self._sample(step, r, policy, stats, timer))
            if ds.filter == "off":
                break
            examples, trajs, inputs = rounds[-1]
            lengths = np.array([t.loss_mask.sum() for t in trajs])
            rewards = np.asarray(self.rewards(inputs.correct, inputs.q, inputs.format_ok, lengths))
            keep = np.array([t.void_turns == 0 for t in trajs])
            signal.append(dynamic.group_signal(rewards, inputs.correct, keep, g, ds.filter))
            if not hosts.allgather(np.array([dynamic.short(signal, len(examples))])).any():
                break
        examples, trajs, inputs, extra = self._selected(rounds, signal)
        with timer("host_batch"):
            lengths = tuple(hosts.allgather(np.array([longest(trajs)])).max(axis=0).tolist())
            # group ids by position: with several rounds one example may come back in a later one
            groups = [(i // g) if ds.filter != "off" else examples[i // g].group_id for i in range(len(trajs))]
            host = host_batch(trajs, s.tokenizer.pad_token_id or 0, inputs=inputs,
                              keep=np.array([t.void_turns == 0 for t in trajs]),  # TIR: void trajectories leave the loss
                              groups=groups, lengths=lengths)
            host = share_prompts(host, s.tokenizer.pad_token_id or 0)
        source = np.array([self._source_index[ex.data_source] for ex in examples for _ in range(g)], np.int64)
        return trajs, host, stats, source, examples, extra

    def _sample(self, step: int, round_: int, policy: Model, stats: EpisodeStats, timer: Timer):
        """One round of a step: this process's share of the next rl.prompts_per_step
        examples, G episodes each, and their reward inputs. Round 0's episode seed and
        chance draws are the step's (as without dynamic sampling); later rounds' differ."""
        cfg, s = self.cfg, self.setup
        g = cfg.rollout.group_size
        examples = self.next_examples(cfg.rl.prompts_per_step)  # every process: the same stream
        rows = len(examples) * g  # every process's
        mine = hosts.local_rows(rows, s.model.mesh)
        if mine.start % g or mine.stop % g:
            raise ValueError(f"{hosts.count()} processes cannot each take whole groups of the {len(examples)} "
                             f"prompts x {g} rows of a step; make rl.prompts_per_step a multiple of "
                             f"{hosts.count()}")
        examples = examples[mine.start // g:mine.stop // g]
        prompts = [make_prompt(ex, cfg.data.template) for ex in examples for _ in range(g)]
        if cfg.rollout.protocol == "qwen":  # native tool calls: the chat template describes the tools
            prompts = tool_prompts(s.tokenizer, prompts, tuple(s.toolbox.tools))
        seed = cfg.seed * 1_000_003 + step + round_ * 1_000_000  # rounds apart while steps < 1e6
        with timer("rollout"):
            trajs = run_episodes(policy, s.tokenizer, prompts, s.toolbox.tools, config=cfg.rollout,
                                 protocol=s.protocol, seed=seed, stats=stats)
        with timer("host_batch"):  # parsing the episodes into reward inputs
            golds = [ex.golden_answers for ex in examples for _ in range(g)]
            # the chance task's grading draws: the round's, over every process's rows, this process's slice
            draws = chance.draws(cfg.seed, step, rows, round_)[mine]
            inputs = reward_inputs([t.pieces for t in trajs], golds, [ex.task for ex in examples for _ in range(g)],
                                   draws, grammar=s.protocol.grammar)
        return examples, trajs, inputs

    def _selected(self, rounds: list, signal: list):
        """The step's examples, trajectories and reward inputs: the one round's as they are
        without dynamic sampling, else the groups `dynamic.select` picks of the rounds;
        and the dynamic sampling metrics (every process's groups, gathered)."""
        if not signal:
            examples, trajs, inputs = rounds[0]
            return examples, trajs, inputs, {}
        g = self.cfg.rollout.group_size
        need = len(rounds[0][0])
        picked = dynamic.select(signal, need)
        rows = [(r, u * g + i) for r, u in picked.picked for i in range(g)]
        examples = [rounds[r][0][u] for r, u in picked.picked]
        trajs = [rounds[r][1][i] for r, i in rows]
        inputs = RewardInputs(*(np.array([getattr(rounds[r][2], f)[i] for r, i in rows])
                                for f in RewardInputs._fields))
        counts = [sum(len(x) for x in signal), sum(int(x.sum()) for x in signal), picked.filled]
        sampled, with_signal, filled = hosts.allgather(np.array([counts])).sum(axis=0)
        extra = {"dynamic/rounds": float(len(rounds)),
                 "dynamic/prompts": float(len(rounds) * self.cfg.rl.prompts_per_step),
                 "dynamic/groups_dropped": float(sampled - with_signal),
                 "dynamic/signal_share": float(with_signal / sampled), "dynamic/filled": float(filled)}
        return examples, trajs, inputs, extra

    def _sizes(self, n: int) -> tuple[int, int]:
        cfg, mesh = self.cfg, self.setup.model.mesh
        mini = cfg.rl.mini_batch or n
        micro = cfg.rl.micro_batch or mini
        if n % mini or mini % micro:
            raise ValueError(f"rl.mini_batch={mini} must divide the {n} trajectories of a step and "
                             f"rl.micro_batch={micro} must divide rl.mini_batch")
        if mesh is not None and micro % mesh.shape["fsdp"]:
            raise ValueError(f"rl.micro_batch={micro} trajectories cannot be split over mesh axis fsdp of size "
                             f"{mesh.shape['fsdp']}; use a multiple of {mesh.shape['fsdp']}")
        return mini, micro

    def update(self, batch: TrainBatch, prompt_of: np.ndarray, timer: Timer, step: int) -> dict[str, float]:
        """`epochs` passes of shuffled mini-batches of the device batch through the train
        step; prompt_of int32[B] (the HostBatch's) lays out the micro-batches. With
        rl.recompute_old_logp the old policy's log-probs are the trainer's (the sampler's stay
        in batch.sampler_logp, for TIS), and the gap between the two is logged
        (`TrainBatch.mismatch`)."""
        cfg, s = self.cfg, self.setup
        n = batch.tokens.shape[0]
        mini, micro = self._sizes(n)
        mesh = s.model.mesh
        share = mesh is None  # on a mesh each device keeps its own rows' prompts (host_batch.micro_plan)
        mismatch = {}
        with timer("logprobs"):
            every_row = micro_plan(prompt_of, np.arange(n), micro, share)
            if cfg.rl.loss.kl_coef:
                batch = batch.replace(ref_logp=chunked_logprobs(s.ref_logprob_fn or s.logprob_fn, s.ref_params, batch,
                                                                every_row, mesh))
            if cfg.rl.recompute_old_logp:
                batch = batch.replace(old_logp=chunked_logprobs(s.logprob_fn, s.policy_params(), batch, every_row,
                                                                mesh))
                mismatch = batch.mismatch(cfg.rl.loss.tis_cap)  # device scalars
            jax.block_until_ready(batch)
        history = []
        rng = np.random.default_rng([cfg.seed, step])
        with timer("update"):
            for _ in range(cfg.rl.epochs):
                order = rng.permutation(n)
                for start in range(0, n, mini):
                    plan = micro_plan(prompt_of, order[start:start + mini], micro, share)
                    s.state, m = s.train_step(s.state, micro_batches(batch, plan, mesh))
                    history.append(m)
            jax.block_until_ready(s.state.params)
        return {**{k: float(np.mean([float(h[k]) for h in history])) for k in history[0]},
                **{k: float(v) for k, v in mismatch.items()}}

    def step(self, step: int, timer: Timer) -> dict[str, float]:
        trajs, host, stats, source, examples, extra = self.rollout(step, timer)
        self._sizes(host.rows * hosts.count())  # a bad batch layout fails before anything is sent
        batch, rewards = self.setup.score(to_device(host, self.setup.model.mesh))
        train_metrics = self.update(batch, hosts.allgather(host.prompt_of), timer, step)
        split = timer.split()
        perf = self._perf_metrics(trajs, host, split["time/step"])
        # this process's rows of the device results, in host order (for the group statistics)
        scored = np.stack([hosts.fetch_local(x, self.setup.model.mesh) for x in (rewards, batch.advantages)], axis=1)
        self.step_samples = self.samples(examples, trajs, host, scored[:, 0])
        return {**self._rollout_metrics(trajs, host, rewards, scored, stats, split),
                **self._source_metrics(host, source), **extra, **train_metrics, **split, **perf}

    def samples(self, examples, trajs, host: HostBatch, rewards: np.ndarray) -> list[Sample]:
        """The first run.samples_per_step of this process's rows of the step (whole groups of
        its first prompts), as the loggers show them. examples: one per group of G rows;
        rewards float32[b]: the scorer's, in host order."""
        g = self.cfg.rollout.group_size
        return [Sample(prompt=examples[i // g].question, response=trajs[i].text,
                       gold=" | ".join(examples[i // g].golden_answers), reward=float(rewards[i]),
                       correct=bool(host.correct[i]), confidence=float(host.q[i]))
                for i in range(min(self.cfg.run.samples_per_step, len(trajs)))]

    def _source_metrics(self, host: HostBatch, source: np.ndarray) -> dict[str, float]:
        """With several data sources: `q/<source>` (the mean sampled confidence) and
        `accuracy/<source>` over every process's rows of each source in the step (a source
        without rows this step is left out of the row)."""
        if len(self.sources) < 2:
            return {}
        q, correct, index = hosts.allgather(np.column_stack([host.q, host.correct, source]).astype(np.float64)).T
        out = {}
        for i, name in enumerate(self.sources):
            rows = index == i
            if rows.any():
                out[f"q/{name}"] = float(q[rows].mean())
                out[f"accuracy/{name}"] = float(correct[rows].mean())
        return out

    def _perf_metrics(self, trajs, host: HostBatch, seconds: float) -> dict[str, float]:
        """Model TFLOP/s per device and MFU of the step (`train.flops`), over every process's rows."""
        cfg, mesh = self.cfg, self.setup.model.mesh
        update = flops.update_counts(host.prompts_valid, host.prompt_of, host.valid)
        rollout = flops.rollout_counts([len(t.prompt_ids) for t in trajs], [len(t.response_ids) for t in trajs],
                                       [int(t.loss_mask.sum()) for t in trajs])
        passes = int(bool(cfg.rl.loss.kl_coef)) + int(bool(cfg.rl.recompute_old_logp))
        local = flops.step_flops(self.setup.model.config, update, rollout, cfg.rl.epochs, passes)
        total = float(hosts.allgather(np.array([local])).sum())
        return flops.perf_metrics(total, seconds, mesh.size if mesh is not None else 1, device_kind())

    @staticmethod
    def _rollout_metrics(trajs, host: HostBatch, rewards, scored: np.ndarray, stats: EpisodeStats,
                         split: dict) -> dict[str, float]:
        """The step's rollout metrics over every process's rows (gathered; the times are
        this process's). rewards float32[B]: the scorer's, on the device; scored float32[b, 2]:
        this process's rows of the rewards and the advantages, in host order.
        accuracy, ece and auroc are over every row (kept or not): auroc is the AUROC of the
        sampled confidence q (as parsed, 0 when missing) as a score for correctness,
        `calibration.metrics.auroc`. calib/* and groups/* (`rl.group_stats`) are over the
        kept rows, in their GRPO groups; calib/auroc is auroc over those rows."""
        local = np.column_stack([host.correct, host.q, host.format_ok, [t.loss_mask.sum() for t in trajs],
                                 [t.n_turns for t in trajs], [t.n_tool_calls for t in trajs], host.group, host.keep,
                                 scored]).astype(np.float64)  # float64 holds each of them exactly
        correct, q, format_ok, sampled, turns, calls, group, keep, reward, adv = hosts.allgather(local).T
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # single-class batches: AUROC is NaN, logged as such
            calib = cal.calibration(correct.astype(bool), q.astype(np.float32))
        return {
            "reward": float(jnp.mean(rewards)), "accuracy": calib["accuracy"], "ece": calib["ece"],
            "auroc": calib["auroc"], "confidence": float(np.float32(q).mean()), "format_ok": float(format_ok.mean()),
            "response_tokens": float(sampled.mean()), "turns": float(turns.mean()), "tool_calls": float(calls.mean()),
            "tokens_per_s": float(sampled.sum()) / max(split.get("time/rollout", 0.0), 1e-9),
            "time/tools": stats.seconds_tools,
            # the engine's (rollout/engine.py): sampled tokens / (slots x decode steps), device and
            # tool seconds (tool calls overlap decoding), episodes waiting for a slot per decode step
            "rollout/slot_utilisation": stats.utilisation(int(sampled.sum())),
            "rollout/device_s": stats.seconds_device, "rollout/tool_s": stats.seconds_tools,
            "rollout/waiting_episodes": stats.mean_waiting(int(hosts.allgather(np.array([stats.waiting_steps])).sum())),
            **group_stats(correct.astype(bool), q.astype(np.float32), reward.astype(np.float32),
                          adv.astype(np.float32), group.astype(np.int64), keep.astype(bool)),
        }

    def run(self) -> list[dict]:
        cfg = self.cfg
        timer = Timer()
        rows = []
        with self._logger(self.dir, loggers=cfg.run.loggers, wandb=cfg.run.wandb, config=dump_config(cfg),
                          progress=Progress(cfg.rl.steps, initial_step=self.start_step),
                          truncate_after=self.start_step) as log:
            for step in range(self.start_step + 1, cfg.rl.steps + 1):
                row = self.step(step, timer)
                log.log(step, row, samples=self.step_samples)
                rows.append({"step": step, **row})
                self._save(step, force=step == cfg.rl.steps)
        self.ckpt.wait()
        if cfg.run.export_hf:  # every process gathers, process 0 writes
            s = self.setup
            out = save_hf_folder(s.policy_params(), s.model.config, self.dir / "hf")  # LoRA: merged
            if hosts.is_writer():
                s.tokenizer.save_pretrained(str(out))
            if s.frozen is not None:  # and the adapters alone, in PEFT's layout
                save_peft_folder(s.state.params, s.model.config, self.dir / "peft", base_model=cfg.model.path or None)
        if hosts.is_writer():
            (self.dir / "last_step.json").write_text(json.dumps({"step": cfg.rl.steps, "time": time.time()}))
        self.ckpt.close()
        self.warm_ckpt.close()
        self.setup.toolbox.close()
        return rows


def training_examples(cfg: TrainConfig) -> list:
    """data.train's examples, and a check that sft.data names a file when it is one. A
    missing or unreadable source is a ConfigError naming its key (one line from the CLI)."""
    try:
        examples = load_dataset(cfg.data.train, cfg.data.train_split, cfg.data.limit)
    except (FileNotFoundError, DatasetError) as err:
        raise ConfigError(f"data.train: {err}") from None
    if not examples:
        raise ConfigError(f"data.train: {cfg.data.train!r} (split {cfg.data.train_split}) has no examples")
    demos = cfg.sft.data
    if cfg.sft.steps and demos not in ("world", chance.NAME) and not Path(demos).is_file():
        raise ConfigError(f"sft.data: {demos!r} is not a file; give a JSONL of demonstrations, 'world' or "
                          f"'{chance.NAME}' (or set sft.steps=0)")
    return examples


def train(cfg: TrainConfig) -> list[dict]:
    """Trains per `cfg`; returns the per-step metric rows of this process's steps."""
    return Trainer(cfg).run()


__all__ = ["Trainer", "train", "training_examples"]
