"""The model-free cache engine, below the transformers boundary (`hf_kvgov.hf`), importing no transformers.

- `block_store`: the block store of every chain without an eviction policy, with its links: `block_sealer`
  (the codec: full blocks sealed into codes), `block_tier` (the disk: cold blocks spilled and read back),
  `paged_prefix` / `prefix_groups` / `disk_prefix` (rows start from a prefix tree's blocks), `paged_pool`.
- `slots`: the per-head slot store of chains with an eviction policy (heads keep different tokens), with its
  codec, recall of evicted pages, layer budgets and statistics.
- `parts` and `quant_config`: the frozen records a chain is built from.
"""
