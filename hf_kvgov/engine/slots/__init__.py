"""The per-head slot store of eviction caches: each KV head keeps its own tokens (slots) under a budget, chosen
by a policy (`hf_kvgov.policies`); kept slots as codes, evicted pages recalled from the disk tier."""
