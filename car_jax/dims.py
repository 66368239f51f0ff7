"""The dimension letters of car_jax: declared once here, used in einsum strings, sharding
names and shape comments (`float32[B, T, V]`) everywhere else. Each letter means one thing.

Model and cache
  B  batch rows (sequences, episodes)
  T  tokens of one forward call (a chunk, or a whole sequence)
  S  KV-cache slots;  W  a window: the first W slots a decode stage attends over
  L  layers            D  model width         F  MLP width          V  vocabulary
  N  query heads       K  kv heads            G  query heads per kv head (N // K)
  H  head dim
  r  a LoRA adapter's rank (`model.lora.rank`; lower case: it is a config size, never a batch axis)

Training batches and GRPO
  U  distinct prompts of a batch            P  prompt length (left-padded)
  R  response length (right-padded; also a decode segment's sampled tokens)
  M  micro-batches of a mini-batch          C  positions per vocabulary chunk (log-prob head)
  X  flattened token rows (B * T) where an op works on a 2-D [X, D]

Rollout and calibration
  E  EOS ids         A  stop automata (one per stop pattern)      Z  automaton states
  Q  confidence bins (ECE, reliability diagrams)

A GRPO group's size is a config value (`group_size`), written out in words: it is never an
array dimension (rows of a group share a prompt through an index, not an axis).
"""
