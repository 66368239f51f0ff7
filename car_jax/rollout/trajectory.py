"""An episode's record on the host (`Trajectory`), the rollout's counters (`EpisodeStats`),
and how an observation is tokenized within its budget (`observation_ids`)."""
from __future__ import annotations

import dataclasses

import numpy as np


def _ids(x) -> np.ndarray:
    return np.asarray(x, np.int32).reshape(-1)


@dataclasses.dataclass
class Trajectory:
    """One episode on the host, as numpy arrays: prompt_ids int32[P]; response_ids int32[R]
    (sampled and observation tokens), logprobs float32[R] (the sampler's, 0 on
    observations), loss_mask bool[R] (True: sampled by the model). Lists given to the
    constructor are converted."""
    prompt_ids: np.ndarray
    response_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    logprobs: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    loss_mask: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    n_turns: int = 0  # segments generated
    n_tool_calls: int = 0
    tool_log: list[dict] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)  # each tool turn's observation, before truncation
    text: str = ""  # the response decoded (sampled and observation tokens)
    # the response as (text, written by the model) pieces, one per run of sampled or of
    # observation tokens: what the reward parses (answers and confidences are read from
    # the model's own pieces only, never from a tool's)
    pieces: list[tuple[str, bool]] = dataclasses.field(default_factory=list)
    answered: bool = False  # ended with an answer action (or EOS in the last turn)
    void_turns: int = 0  # TIR turns with neither code nor answer

    def __post_init__(self):
        self.prompt_ids, self.response_ids = _ids(self.prompt_ids), _ids(self.response_ids)
        self.logprobs = np.asarray(self.logprobs, np.float32).reshape(-1)
        self.loss_mask = np.asarray(self.loss_mask, bool).reshape(-1)
        if not len(self.response_ids) == len(self.logprobs) == len(self.loss_mask):
            raise ValueError(f"response_ids, logprobs and loss_mask differ in length: {len(self.response_ids)}, "
                             f"{len(self.logprobs)}, {len(self.loss_mask)}")

    def spans(self) -> list[tuple[int, int, bool]]:
        """(start, end, sampled) of each maximal run of sampled / observation tokens."""
        edges = np.flatnonzero(np.diff(self.loss_mask.astype(np.int8))) + 1
        bounds = [0, *edges.tolist(), len(self.loss_mask)]
        return [(a, b, bool(self.loss_mask[a])) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def decode_pieces(self, tokenizer) -> list[tuple[str, bool]]:
        """The response decoded run by run (special tokens skipped): (text, by the model)."""
        return [(tokenizer.decode(self.response_ids[a:b], skip_special_tokens=True), sampled)
                for a, b, sampled in self.spans()]

    def add(self, ids, logps=None, sampled: bool = True):
        """Appends a segment: sampled tokens with their log-probs, or (sampled=False) an
        observation (log-prob 0, loss mask False)."""
        ids = _ids(ids)
        logps = np.asarray(logps, np.float32).reshape(-1) if sampled else np.zeros(len(ids), np.float32)
        self.response_ids = np.concatenate([self.response_ids, ids])
        self.logprobs = np.concatenate([self.logprobs, logps])
        self.loss_mask = np.concatenate([self.loss_mask, np.full(len(ids), sampled, bool)])


@dataclasses.dataclass
class EpisodeStats:
    """A rollout's counters, for this process's episodes (slots and decode steps are the
    whole rollout's: every process runs the same decode calls)."""
    seconds_device: float = 0.0  # prefill and decode calls, outputs fetched
    seconds_tools: float = 0.0  # tool calls, summed (they overlap decoding and each other)
    seconds_tool_wait: float = 0.0  # the device loop idle, waiting for a tool result
    prefilled_tokens: int = 0  # tokens written by prefills (prompt + pending + observations)
    sampled_tokens: int = 0
    slots: int = 0  # episode slots (rows of the KV caches: decode rows + park rows), all processes together
    decode_slots: int = 0  # of them, rows that decode (at the start; the tail narrows them)
    park_slots: int = 0  # rows that hold episodes waiting for a tool while their decode row is reused
    capacity: int = 0  # KV-cache slots per row
    decode_steps: int = 0  # decode loop steps (each samples for every live slot)
    slot_steps: int = 0  # decode rows x steps, summed over decode calls (the rows each call computed)
    parkings: int = 0  # episodes parked while waiting for a tool
    narrowings: int = 0  # times the tail halved the decode rows
    waiting_steps: int = 0  # episodes waiting for a slot, summed over decode steps
    compactions: int = 0  # times the cache was packed to make room
    # idle slot-steps of the decode calls (this process's slots), by cause: a free slot
    # while episodes wait for one (refill lag) or while none does (the tail), a slot whose
    # episode waits for its tool result, a slot that stopped within a call
    idle_refill: int = 0
    idle_tail: int = 0
    idle_tool: int = 0
    idle_stopped: int = 0

    def utilisation(self, sampled_tokens: int | None = None) -> float:
        """Sampled tokens / slot-steps (decode rows x decode steps, summed over the decode
        calls; the rows a call computed, whether they sampled or idled): the share that
        sampled a token (pass the token count of every process with several); NaN before
        any step."""
        tokens = self.sampled_tokens if sampled_tokens is None else sampled_tokens
        return tokens / self.slot_steps if self.slot_steps else float("nan")

    def mean_waiting(self, waiting_steps: int | None = None) -> float:
        """Episodes waiting for a slot, averaged over the decode steps."""
        steps = self.waiting_steps if waiting_steps is None else waiting_steps
        return steps / max(self.decode_steps, 1)


def observation_ids(tokenizer, parts: tuple[str, str, str], budget: int) -> list[int]:
    """Token ids of the observation head + body + tail, at most `budget` of them: when
    the whole does not fit, the body (the tool's result) is cut and the wrapper kept, so
    `</information>` is never lost to a long result (if the wrapper alone exceeds the
    budget, the whole is cut at it)."""
    text = "".join(parts)
    if not text:
        return []
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= budget:
        return ids
    head, body, tail = (tokenizer(p, add_special_tokens=False)["input_ids"] if p else [] for p in parts)
    room = budget - len(head) - len(tail)
    return head + body[:room] + tail if room >= 0 else ids[:budget]
