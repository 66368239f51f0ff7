"""The array sizes a training config implies: the widths the trainer pads to, the rows of a
micro-batch and of the rollout, the KV cache's slots.

    shapes = Shapes.of(cfg, prompt_tokens=512)

Where the config leaves a size open, the planner takes the worst case the config allows:
the response width is every turn's sampling budget plus every tool turn's observation
budget (`EpisodeConfig.max_response_length`), padded as `host_batch` pads
(`generate.length_bucket`); prompts are not cut by car_jax, so their length is an input
(`prompt_tokens`, the longest prompt of a step).
"""
from __future__ import annotations

import dataclasses

from car_jax.rollout.generate import length_bucket, round_up
from car_jax.rollout.schedule import split_rows
from car_jax.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Shapes:
    prompt: int  # P: a train batch's prompt width (length_bucket of the longest prompt)
    response: int  # R: a train batch's response width (length_bucket of the longest response)
    micro_batches: int  # M: micro-batches of a mini-batch
    micro_rows: int  # b: rows of a micro-batch (all devices)
    step_rows: int  # rows of a step (prompts_per_step x group_size)
    rollout_rows: int  # rows the rollout holds in its KV caches (decode and park rows) at once
    park_slots: int  # the config's rollout.park_slots (-1: a quarter of the rows park)
    capacity: int  # S: the rollout cache's slots
    prefill_chunk: int  # T of the widest rollout prefill (the prompt, or a pending token + observation)
    fsdp: int
    tp: int

    @classmethod
    def of(cls, cfg: TrainConfig, fsdp: int, tp: int, prompt_tokens: int = 512) -> "Shapes":
        """The sizes of `cfg` on an fsdp x tp mesh, for prompts of up to `prompt_tokens`.

        The rollout holds every episode of a step at once (prompts_per_step x group_size
        rows) unless the config bounds it with `rollout.max_concurrent`. Its cache has the
        prompt's width (in the `length_bucket` sizes, as the engine pads it) plus every turn's
        sampling budget plus every tool turn's pending token and observation, padded to a
        multiple of 16. (The episode
        engine allocates the widest single write more, `engine.capacity`: 10% more slots
        on the paper config, not counted here yet.)"""
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={prompt_tokens} must be >= 1 (the longest prompt, in tokens)")
        r, rl = cfg.rollout, cfg.rl
        step_rows = rl.prompts_per_step * r.group_size
        mini = rl.mini_batch or step_rows
        micro = rl.micro_batch or mini
        bound = getattr(r, "max_concurrent", None)  # a rollout field that may bound the rows held at once
        rollout_rows = min(step_rows, bound) if bound else step_rows
        obs_chunk = round_up(1 + r.max_obs_tokens)
        capacity = length_bucket(prompt_tokens, 16) + (r.max_turns + 1) * r.max_response_tokens + r.max_turns * obs_chunk
        return cls(prompt=length_bucket(prompt_tokens, 16), response=length_bucket(r.max_response_length, 16),
                   micro_batches=mini // micro, micro_rows=micro, step_rows=step_rows, rollout_rows=rollout_rows,
                   park_slots=r.park_slots, capacity=capacity,
                   prefill_chunk=max(length_bucket(prompt_tokens, 16), obs_chunk if r.max_turns else 0), fsdp=fsdp, tp=tp)

    @property
    def decode_rows(self) -> int:
        """The rollout rows that decode (the rest park episodes waiting for a tool), as the
        engine splits them (`schedule.split_rows`; a park only while episodes outnumber rows)."""
        return split_rows(self.rollout_rows, self.park_slots, self.step_rows, self.fsdp)[0]

    @property
    def narrow_rows(self) -> int:
        """Rows of the narrowed cache the engine allocates beside its caches in the tail
        (`Engine._narrowed`: the decode rows halved once or more, so at most half of them).
        The engine narrows only when the half splits over the processes and fsdp; counted
        here whenever there are two decode rows or more: an upper bound."""
        return self.decode_rows // 2 if self.decode_rows >= 2 else 0
