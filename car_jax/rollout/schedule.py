"""The host side of the engine's slots (`engine.py`): which episode each decode row and
each park row holds, the round's moves between them (numpy only, no device work), and the
round's decisions that the processes agree on (`Round`).

    decode rows (b): free | decoding a segment | holding an episode whose tool is out
    park rows (p):   free | holding an episode whose tool is out (its KV rows moved here)

An episode that goes to its tool while others want a decode row (fresh episodes waiting,
or parked ones whose observation came back) is *parked*: its cache row moves to a park
row and its decode row takes another episode; when its observation comes back it takes
the next free decode row again (before fresh episodes: the started ones finish first).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from car_jax import hosts


class Rows:
    """This process's b decode rows and p park rows: the episode each holds (-1: free),
    whether a decode row is decoding, its segment's tokens so far, automata and draws."""

    def __init__(self, b: int, p: int, n_automata: int):
        self.episode = np.full(b, -1, np.int64)
        self.live = np.zeros(b, bool)
        self.count = np.zeros(b, np.int32)
        self.drawn = np.zeros(b, np.int32)
        self.dfa = np.zeros((b, n_automata), np.int32)
        self.enabled = np.zeros((b, n_automata), bool)
        self.tokens: list[list[int]] = [[] for _ in range(b)]
        self.logps: list[list[float]] = [[] for _ in range(b)]
        self.parked = np.full(p, -1, np.int64)  # episode of each park row
        self.parked_drawn = np.zeros(p, np.int32)  # its draws so far (its RNG stream's position)

    @property
    def b(self) -> int:
        return len(self.episode)

    def start_segment(self, r: int, enabled: np.ndarray) -> None:
        self.live[r], self.count[r], self.dfa[r], self.enabled[r] = True, 0, 0, enabled
        self.tokens[r], self.logps[r] = [], []

    def in_flight(self) -> int:
        return int((self.episode >= 0).sum() + (self.parked >= 0).sum())

    def park(self, rows: list[int]) -> list[tuple[int, int]]:
        """Decode rows `rows` (episodes waiting for a tool) move to free park rows, as many
        as there are; returns the (decode row, park row) moves made."""
        moves = list(zip(rows, np.flatnonzero(self.parked < 0).tolist()))
        for r, q in moves:
            self.parked[q], self.parked_drawn[q] = self.episode[r], self.drawn[r]
            self.episode[r], self.live[r] = -1, False
        return moves

    def unpark(self, episodes: list[int]) -> list[tuple[int, int]]:
        """Parked `episodes` take free decode rows, as many as there are; returns the
        (park row, decode row) moves made."""
        free = np.flatnonzero(self.episode < 0).tolist()
        moves = []
        for e, r in zip(episodes, free):
            q = int(np.flatnonzero(self.parked == e)[0])
            self.episode[r], self.drawn[r], self.live[r] = e, self.parked_drawn[q], False
            self.parked[q] = -1
            moves.append((q, r))
        return moves

    def narrowed(self, b: int) -> tuple["Rows", list[int]]:
        """These rows with the held decode rows packed into b rows (the park kept);
        returns (the new rows, the old row of each held one, in order)."""
        held = np.flatnonzero(self.episode >= 0).tolist()
        if len(held) > b:
            raise ValueError(f"{len(held)} episodes hold decode rows; they do not fit in {b}")
        new = Rows(b, len(self.parked), self.dfa.shape[1])
        for j, r in enumerate(held):
            for name in ("episode", "live", "count", "drawn", "dfa", "enabled"):
                getattr(new, name)[j] = getattr(self, name)[r]
            new.tokens[j], new.logps[j] = self.tokens[r], self.logps[r]
        new.parked, new.parked_drawn = self.parked, self.parked_drawn
        return new, held


def split_rows(rows: int, park: int, episodes: int, split: int) -> tuple[int, int]:
    """(decode rows, park rows) of `rows` KV rows (all processes; a multiple of `split`,
    the mesh's fsdp): `park` of them (-1: a quarter, rounded down to a multiple of split)
    park episodes that wait for a tool, but only when episodes outnumber the rows (else
    nothing waits for a decode row), and at least `split` rows decode."""
    if episodes <= rows:
        return rows, 0
    p = rows // 4 if park < 0 else park
    p = min(p // split * split, rows - split)
    return rows - p, p


def pad_moves(moves: list[tuple[int, int]], n: int, src_start: int, dst_start: int) -> tuple[np.ndarray, np.ndarray]:
    """Moves (local src row, local dst row) as two int32[n] arrays of global rows (offset
    by this process's first row of each cache), padded with no-moves (-1)."""
    src, dst = np.zeros(n, np.int32), np.full(n, -1, np.int32)
    for i, (a, b) in enumerate(moves):
        src[i], dst[i] = a + src_start, b + dst_start
    return src, dst


class Clock:
    """Host timing that sizes a decode call: seconds per decode step and per tool job
    (running means), and when each job out started. `steps_until` answers how many decode
    steps to run before the earliest due job's result is back, so the call can end then
    and its row take the result instead of idling to the end of the call."""

    def __init__(self):
        self.step_s = self.job_s = None
        self.started: dict = {}  # job -> its submit time (perf_counter seconds)

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else 0.75 * old + 0.25 * new

    def decoded(self, seconds: float, steps: int) -> None:
        if steps:
            self.step_s = self._mean(self.step_s, seconds / steps)

    def finished(self, job, seconds: float) -> None:
        self.started.pop(job, None)
        self.job_s = self._mean(self.job_s, seconds)

    def steps_until(self, jobs: list, now: float, floor: int, most: int) -> int:
        """Decode steps (floor..most) until the first of `jobs` is due: its start plus the
        mean job time; `floor` while no job has finished yet or one is overdue, `most`
        without jobs or before any decode call timed a step."""
        if not jobs or self.step_s is None:
            return most
        if self.job_s is None:
            return floor
        due = min(self.started[j] for j in jobs) + self.job_s - now
        return int(min(most, max(floor, -(-due // self.step_s))))


class Round(NamedTuple):
    """What one round of the engine's loop decides from what each process knows locally;
    `agreed()` makes every process's view the same (one allgather), so every process makes
    the same device calls. Each field says how the processes' values combine."""
    new: int  # rows refilled with a fresh episode (summed)
    longest: int  # the longest chunk (pending token + observation) to prefill (the largest)
    live: int  # decode rows decoding (summed)
    waiting: int  # episodes waiting for a decode row (summed)
    jobs: int  # tool jobs out (summed)
    unparked: int  # episodes moved from the park to decode rows (summed)
    parked: int  # episodes moved from decode rows to the park (summed)
    in_flight: int  # episodes holding a decode or park row (the largest)
    limit: int  # decode steps until a result that a row waits for is due (the smallest)
    distinct: int  # distinct prompts of the refilled rows (the largest)

    def agreed(self) -> "Round":
        """This round as every process sees it, each field combined over the processes."""
        gathered = hosts.allgather(np.array([self], np.int64))  # [processes, fields]
        return Round(**{name: int(_COMBINE[name](column)) for name, column in zip(self._fields, gathered.T)})


_COMBINE = dict(new=np.sum, longest=np.max, live=np.sum, waiting=np.sum, jobs=np.sum, unparked=np.sum, parked=np.sum,
                in_flight=np.max, limit=np.min, distinct=np.max)
