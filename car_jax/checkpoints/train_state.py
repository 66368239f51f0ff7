"""Training checkpoints with orbax: a pytree of arrays plus a JSON `meta` dict per step.

    ckpt = TrainCheckpointer(run_dir / "checkpoints", keep=3, every=100)
    if ckpt.latest_step() is not None:
        state, meta = ckpt.restore(abstract_state=abstract_state(state))  # onto the mesh
    for step in ...:
        state, metrics = train_step(state, batch)
        ckpt.maybe_save(step, state, {"data_pos": pos, "config": "tiny"})
    ckpt.close()  # waits for the last async save

Layout (orbax `CheckpointManager`, items "state" and "meta"):
    <directory>/<step>/state/...   arrays (OCDBT/zarr3, each host writes its own shards)
    <directory>/<step>/meta/...    the JSON dict

Kill safety: orbax writes a step into `<step>.orbax-checkpoint-tmp-<id>/` and renames it
to `<step>/` only after every array and the metadata are written (the rename is atomic on
a local/POSIX filesystem). A process killed mid-save leaves only the tmp folder, which
readers ignore; the previous step stays the latest. A writer (`read_only=False`) deletes
such leftovers when it opens the directory.

Typed PRNG keys (`jax.random.key`) are saved and restored by orbax itself (as key data
plus the key implementation); raw uint32 keys (`jax.random.PRNGKey`) are plain arrays.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["TrainCheckpointer", "abstract_state"]

_ITEMS = ("state", "meta")


def abstract_state(tree: Any) -> Any:
    """The restore target of a pytree of arrays: a `jax.ShapeDtypeStruct` per leaf with
    the leaf's shape, dtype and sharding (so restore puts shards straight on the mesh)."""
    def leaf(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


class TrainCheckpointer:
    """Saves and restores `(state, meta)` per training step in `directory`.

    Args:
      directory: the checkpoint folder (created when writing).
      keep: how many of the latest steps to keep (None: all).
      every: `maybe_save` saves the steps that are multiples of this.
      async_save: write in a background thread; `save` returns once the arrays are copied
        to host memory. `wait()` blocks until written.
      read_only: open an existing folder to read (evaluation next to a running trainer):
        no saving, no cleanup of the writer's in-progress tmp folders, and `latest_step`
        re-lists the folder on each call.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3,
                 every: int = 100, async_save: bool = True, read_only: bool = False):
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep} must be >= 1 (or None to keep every step)")
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        if read_only and not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint folder {self.directory} does not exist")
        cm = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=cm.FixedIntervalPolicy(every),
            save_interval_steps=0 if read_only else 1,  # (ignored; avoids a warning)
            preservation_policy=cm.LatestN(keep),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        self._ocp = ocp
        self._mngr = ocp.CheckpointManager(self.directory, item_names=_ITEMS,
                                           options=options)

    # --- saving ----------------------------------------------------------------------

    def maybe_save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None
                   ) -> bool:
        """Saves when `step` is a multiple of `every` and newer than the latest saved step.

        Returns whether a save was started. `state`: a pytree of jax arrays (params,
        optimizer state, step counter, RNG key); `meta`: a JSON-serializable dict.
        """
        return self.save(step, state, meta, force=False)

    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None, *,
             force: bool = True) -> bool:
        """Saves `(state, meta)` as `step` (regardless of `every` when force=True).

        Returns False without writing when `step` is already saved (e.g. a final save
        right after a periodic one). With async_save the write continues in the
        background; a later save, `wait()` or `close()` waits for it.
        """
        if self.read_only:
            raise RuntimeError(f"{self.directory} was opened read_only; open a "
                               f"TrainCheckpointer without read_only=True to save")
        step = int(step)
        meta = dict(meta or {})
        try:
            json.dumps(meta, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint meta must be JSON-serializable ({e}); convert "
                             f"arrays with .tolist() or float()") from None
        if step in self._mngr.all_steps():
            return False
        args = self._ocp.args
        return bool(self._mngr.save(
            step, force=force,
            args=args.Composite(state=args.StandardSave(state), meta=args.JsonSave(meta))))

    def wait(self) -> None:
        """Blocks until every started save is written and committed."""
        self._mngr.wait_until_finished()

    # --- reading ---------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Saved steps, ascending. In a writer, a step counts once its save has started."""
        if self.read_only:
            self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        """The newest saved step, or None when the folder holds no checkpoint."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None = None, abstract_state: Any = None
                ) -> tuple[Any, dict]:
        """Returns `(state, meta)` of `step` (default: the latest).

        `abstract_state`: a pytree of `jax.ShapeDtypeStruct` (with `.sharding`) of the
        same structure as the saved state (e.g. `abstract_state(init_state)` or
        `jax.eval_shape` plus shardings); arrays are read straight into those shardings
        (resharding if they differ from the saved ones) and the pytree comes back with
        its node types (optax namedtuples...). Without it, orbax rebuilds arrays with
        the shardings recorded at save time, which needs the same devices, and
        containers come back as dicts/lists.
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}; nothing to "
                                        f"restore (start from scratch instead)")
            step = steps[-1]
        step = int(step)
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"saved steps: {steps or 'none'}")
        self.wait()  # the step may still be being written by this process
        args = self._ocp.args
        out = self._mngr.restore(step, args=args.Composite(
            state=args.StandardRestore(abstract_state), meta=args.JsonRestore()))
        return out["state"], dict(out["meta"] or {})

    # --- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        """Waits for pending saves (and deletions of old steps), then releases orbax."""
        self._mngr.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
