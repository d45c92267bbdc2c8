"""Decoding memory of the hybrid models.

(The per-slot tensors themselves, HybridState, are the models' own: deltaserve/models/state.py.)
- prefix.py:      PrefixStore, recurrent-state checkpoints of token prefixes in a byte budget
- manager.py:     CacheManager, which tokens each slot holds; live reuse, checkpoint save and restore

Speculative decoding (drafters, the acceptance rule) is scheduling and lives in deltaserve.engine.speculative;
it uses the rollback pieces here.
"""
