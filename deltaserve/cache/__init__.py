"""Decoding memory of the hybrid models.

(The per-slot tensors themselves, HybridState, are the models' own: deltaserve/models/state.py.)
- prefix.py:      PrefixStore, recurrent-state checkpoints of token prefixes in a byte budget
- manager.py:     CacheManager, which tokens each slot holds; live reuse, checkpoint save and restore
- speculative.py: drafters (prompt lookup, a draft model) and the acceptance rule
"""
