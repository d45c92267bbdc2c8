"""Requests run through an Engine's own thread to their end, as a server's clients would submit them."""

from __future__ import annotations

import threading

from deltaserve.engine.request import Done


def run_to_end(engine, prompts: list[list[int]], params, timeout: float = 120) -> list[Done]:
    """Submit every prompt (token ids) at once with `params`, wait until all are done, close the engine; the
    Done event of each, in the prompts' order."""
    done, finished = {}, threading.Event()

    def on_event(i):
        def handle(event):
            if isinstance(event, Done):
                done[i] = event
                if len(done) == len(prompts):
                    finished.set()
        return handle

    try:
        for i, p in enumerate(prompts):
            engine.submit(p, params, on_event(i))
        assert finished.wait(timeout), f"{len(prompts) - len(done)} of {len(prompts)} requests still running"
    finally:
        engine.close()
    return [done[i] for i in range(len(prompts))]
