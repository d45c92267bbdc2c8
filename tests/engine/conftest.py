import functools

import pytest

from deltaserve.engine.engine import Engine
from deltaserve.engine.llm import LLM, load

from .faults import CHUNK, GREEDY, N


@pytest.fixture(scope="session")
def reference():
    """prompt (text or a tuple of ids) -> the greedy tokens of a fault-free LLM over the embedded model,
    whose model is its own."""
    llm = LLM(None, max_len=256, prefill_chunk=CHUNK, checkpoint_interval=CHUNK)
    return functools.cache(lambda prompt: llm.generate(list(prompt) if isinstance(prompt, tuple) else prompt,
                                                       max_tokens=N, **GREEDY).token_ids)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded model, shared by the engines of the tests (faults are undone)."""
    return load(None)


@pytest.fixture
def engine(embedded):
    """engine(**kwargs): a fresh Engine over the embedded model, per test (faults go on its model or its
    parts); closed at the end of the test."""
    made = []

    def make(**kwargs) -> Engine:
        model, tokenizer = embedded
        made.append(Engine(model, tokenizer, **{"n_slots": 2, "max_len": 256, "prefill_chunk": CHUNK,
                                                "checkpoint_interval": CHUNK, **kwargs}))
        return made[-1]

    yield make
    for e in made:
        e.close()
