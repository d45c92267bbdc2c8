"""llama-server's slot API: GET /slots, and POST /slots/{id}?action=save|restore|erase with {"filename"}; and its
GET /props (the context, the slots, the chat template and special tokens: what its web UI and clients read).

A slot's state (its tokens, their KV rows, its recurrent state) goes to a file in the directory given by
`serve --slot-save-path`; restored into any idle slot, a prompt that extends those tokens prefills only
the rest. Files are plain names inside that directory (no paths), checked against the model and their
checksum when read (cache/persist.py), and the operations run on the engine thread between two steps, so
they never race a forward pass."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from deltaserve import __version__
from deltaserve.engine.engine import Engine
from deltaserve.errors import DeltaserveError, SlotBusyError

from .errors import APIError, echo

FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # no separators, no leading dot: stays in the folder
ACTIONS = ("save", "restore", "erase")


class SlotBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    filename: str | None = None


def install(app: FastAPI, engine: Engine, folder: str | Path | None) -> None:
    cache = engine.runner.cache

    @app.get("/props")
    async def props():
        tokens = engine.tokenizer.special_token_texts
        return {"default_generation_settings": {"n_ctx": engine.max_len, "params": {
                    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}},  # (a request's defaults: schemas)
                "total_slots": cache.n_slots, "model_alias": engine.model_name,
                "modalities": {"vision": False, "audio": False}, "chat_template": engine.tokenizer.template or "",
                "bos_token": tokens["bos_token"] or "", "eos_token": tokens["eos_token"] or "",
                "build_info": f"deltaserve {__version__}"}

    @app.get("/slots")
    async def slots():
        def read():
            return [{"id": s, "n_ctx": engine.max_len, "is_processing": cache.busy[s],
                     "n_tokens": len(cache.history[s])} for s in range(cache.n_slots)]
        return await asyncio.wrap_future(engine.between_steps(read))

    @app.post("/slots/{slot}")
    async def slot_action(slot: int, action: str, body: SlotBody | None = None):
        if action not in ACTIONS:
            raise APIError(400, f"action must be one of {', '.join(ACTIONS)}, got '{echo(action)}'", "action")
        if not 0 <= slot < cache.n_slots:
            raise APIError(400, f"no slot {slot}; this server has slots 0..{cache.n_slots - 1}", "id_slot")
        if action == "erase":
            return {"id_slot": slot, "n_erased": await _run(engine, lambda: cache.erase_slot(slot))}
        path = _file(folder, body)
        if action == "restore" and not path.is_file():
            raise APIError(404, f"no slot file '{path.name}' in the slot save path", "filename", "not_found")
        start = time.perf_counter()
        if action == "save":
            n, size = await _run(engine, lambda: cache.save_slot(slot, path, engine.runner.model))
            return {"id_slot": slot, "filename": path.name, "n_saved": n, "n_written": size,
                    "timings": {"save_ms": 1e3 * (time.perf_counter() - start)}}
        n, size = await _run(engine, lambda: cache.load_slot(slot, path, engine.runner.model))
        return {"id_slot": slot, "filename": path.name, "n_restored": n, "n_read": size,
                "timings": {"restore_ms": 1e3 * (time.perf_counter() - start)}}


def _file(folder: str | Path | None, body: SlotBody | None) -> Path:
    if folder is None:
        raise APIError(501, "slot save / restore is off: start the server with --slot-save-path DIR",
                       code="not_supported", kind="not_supported_error")
    name = body.filename if body is not None else None
    if not name or not FILENAME.fullmatch(name):
        raise APIError(400, "filename must be a plain file name (letters, digits, '_', '-', '.'; at most 128; "
                            f"not starting with '.'), got {echo(repr(name))}", "filename")
    return Path(folder) / name


async def _run(engine: Engine, fn):
    try:
        return await asyncio.wrap_future(engine.between_steps(fn))
    except SlotBusyError as e:
        raise APIError(409, str(e), "id_slot", "slot_busy") from None
    except DeltaserveError as e:  # a file that is damaged, another model's, or too long for this context
        raise APIError(400, str(e), "filename") from None
