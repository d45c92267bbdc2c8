"""GGML tensor types in torch: raw little-endian bytes -> float32, and a Q8_0 quantiser.

Each block decoder reads `[n, type_size]` uint8 blocks and writes `[n, block_size]` float32, in
element order, into a slice of the preallocated output (no per-chunk float temporaries: on a
loaded machine fresh allocations cost more than the arithmetic). Layouts follow ggml's `block_*`
structs; products are taken in the order of ggml's reference dequantisers, so results match
them bit for bit. Types not listed here (the IQ1/IQ2/IQ3 grids, TQ*, NVFP4) are refused by name.
"""

import math

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
_CHUNK_ELEMENTS = 1 << 18  # decoded at once: keeps the small integer temporaries in cache
FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _f16_at(b: torch.Tensor, byte: int) -> torch.Tensor:
    """[n, 1] float32: the float16 at `byte` of each block (all type sizes are even)."""
    return b.view(torch.float16)[:, byte // 2, None].float()


def _int8(b: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return b.view(torch.int8)[:, start:stop]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] -> [n, 32]: the low nibbles are elements 0..15, the high nibbles 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[n, m] -> [n, 8m]: bit i of the little-endian bit string held in the bytes."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q4_0(b, out):  # d f16 | qs[16]: y = d * (q - 8)
    out.copy_(_nibbles(b[:, 2:18])).sub_(8).mul_(_f16_at(b, 0))


def _q4_1(b, out):  # d f16 | m f16 | qs[16]: y = d * q + m
    out.copy_(_nibbles(b[:, 4:20])).mul_(_f16_at(b, 0)).add_(_f16_at(b, 2))


def _q5_0(b, out):  # d f16 | qh[4] (bit 4 of each element) | qs[16]: y = d * (q - 16)
    out.copy_(_nibbles(b[:, 6:22]) | (_bits(b[:, 2:6]) << 4)).sub_(16).mul_(_f16_at(b, 0))


def _q5_1(b, out):  # d f16 | m f16 | qh[4] | qs[16]: y = d * q + m
    q = _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8]) << 4)
    out.copy_(q).mul_(_f16_at(b, 0)).add_(_f16_at(b, 2))


def _q8_0(b, out):  # d f16 | qs int8[32]
    out.copy_(_int8(b, 2, 34)).mul_(_f16_at(b, 0))


def _q8_k(b, out):  # d f32 | qs int8[256] | bsums int16[16] (only used by dot products)
    out.copy_(_int8(b, 4, 260)).mul_(b.view(torch.float32)[:, 0:1])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins ([n, 8] each).

    Sub-blocks 0..3 keep scale and min in the low 6 bits of bytes 0..3 and 4..7; sub-blocks 4..7
    keep their low 4 bits in bytes 8..11 and their top 2 bits in the spare bits of bytes 0..7.
    """
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=-1)
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return scale.float(), mins.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 8, 32]: each 32-byte run holds sub-block 2j (low) and 2j+1 (high)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32)


def _k_affine(b, q, out):  # y = (d * scale) * q - dmin * min, per 32-element sub-block
    scale, mins = _k_scales(b[:, 4:16])
    step = (_f16_at(b, 0) * scale).unsqueeze(-1)  # [n, 8, 1]
    offset = (_f16_at(b, 2) * mins).unsqueeze(-1)
    out.view(-1, 8, 32).copy_(q).mul_(step).sub_(offset)


def _q4_k(b, out):  # d f16 | dmin f16 | scales[12] | qs[128]
    _k_affine(b, _k_low_nibbles(b[:, 16:144]), out)


def _q5_k(b, out):  # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> shifts) & 1  # [n, 8, 32]: bit j is sub-block j's bit 4
    _k_affine(b, _k_low_nibbles(b[:, 48:176]) | (high << 4), out)


def _q6_k(b, out):  # ql[128] | qh[64] | scales int8[16] | d f16
    # Each 128-element half reads 64 ql bytes twice (low then high nibbles) and 32 qh bytes
    # four times (2 bits each): element 32k + l of a half is (ql, qh) nibble/pair k at byte l.
    ql = b[:, :128].reshape(-1, 2, 2, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # [n, 2, 4, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    step = (_f16_at(b, 208) * _int8(b, 192, 208).float()).unsqueeze(-1)  # one per 16 elements
    out.view(-1, 16, 16).copy_((low | (high << 4)).view(-1, 16, 16)).sub_(32).mul_(step)


def _q2_k(b, out):  # scales[16] (4-bit scale | 4-bit min) | qs[64] | d f16 | dmin f16
    # Each 128-element half reads its 32 qs bytes four times (2 bits each, shift 2j): elements
    # 32j + l of a half are bits 2j of byte l; every 16 elements take the next scale byte.
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    q = (b[:, 16:80].reshape(-1, 2, 1, 32) >> shifts) & 3  # [n, 2, 4, 32]
    sc = b[:, :16]
    step = (_f16_at(b, 80) * (sc & 0xF).float()).unsqueeze(-1)  # [n, 16, 1]
    offset = (_f16_at(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    out.view(-1, 16, 16).copy_(q.view(-1, 16, 16)).mul_(step).sub_(offset)


def _q3_k(b, out):  # hmask[32] | qs[64] | scales[12] | d f16: y = d * (scale - 32) * (q - 4 * !hbit)
    # Low 2 bits as in Q2_K; the third bit of element 32g + l is bit g of hmask byte l, and a set
    # bit means no offset (q - 0), a clear one q - 4. Six-bit scales: the low nibbles are bytes 0..7
    # (low nibbles for scales 0..7, high for 8..15), the top 2 bits of scale i are bits 2 (i // 4)
    # of byte 8 + i % 4.
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    low = ((b[:, 32:96].reshape(-1, 2, 1, 32) >> shifts) & 3).view(-1, 8, 32)
    bit = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    offset = (((b[:, :32].unsqueeze(1) >> bit) & 1) ^ 1) << 2  # [n, 8, 32]
    s = b[:, 96:108]
    nibbles = torch.cat([s[:, :8] & 0xF, s[:, :8] >> 4], dim=-1)
    top = ((s[:, 8:12].unsqueeze(1) >> shifts.view(1, 4, 1)) & 3).reshape(-1, 16)
    scale = (nibbles | (top << 4)).float().sub_(32)
    step = (_f16_at(b, 108) * scale).unsqueeze(-1)  # [n, 16, 1]
    out.view(-1, 8, 32).copy_(low).sub_(offset)
    out.view(-1, 16, 16).mul_(step)


# IQ4's 16 non-uniform levels (kvalues_iq4nl) and MXFP4's e2m1 values doubled (kvalues_mxfp4).
_IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_FP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _levels(values: tuple[int, ...], codes: torch.Tensor) -> torch.Tensor:
    """The float32 level of each 4-bit code."""
    return torch.tensor(values, dtype=torch.float32, device=codes.device)[codes.long()]


def _iq4_nl(b, out):  # d f16 | qs[16]: y = d * level(q)
    out.copy_(_levels(_IQ4_LEVELS, _nibbles(b[:, 2:18]))).mul_(_f16_at(b, 0))


def _iq4_xs(b, out):  # d f16 | scales_h u16 | scales_l[4] | qs[128]: y = d * (scale - 32) * level(q)
    # Sub-block i (32 elements): low 4 scale bits in nibble i of scales_l, top 2 in bits 2i of
    # scales_h; its 16 qs bytes hold elements 0..15 (low nibbles) and 16..31 (high nibbles).
    low = torch.cat([b[:, 4:8, None] & 0xF, b[:, 4:8, None] >> 4], dim=-1).reshape(-1, 8)
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)
    high = (b.view(torch.int16)[:, 1:2].int() >> shifts) & 3  # [n, 8]
    scale = (low.int() | (high << 4)).float().sub_(32)
    step = (_f16_at(b, 0) * scale).unsqueeze(-1)  # [n, 8, 1]
    qs = b[:, 8:136].reshape(-1, 8, 16)
    out.view(-1, 8, 32).copy_(_levels(_IQ4_LEVELS, torch.cat([qs & 0xF, qs >> 4], dim=-1))).mul_(step)


def _mxfp4(b, out):  # e (E8M0 exponent) | qs[16]: y = level(q) * 2^(e - 128), levels doubled
    # ggml's GGML_E8M0_TO_FP32_HALF: exponents 0 and 1 give the subnormals 2^-128 and 2^-127.
    e = b[:, 0:1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    out.copy_(_levels(_FP4_LEVELS, _nibbles(b[:, 1:17]))).mul_(bits.view(torch.float32))


_DECODERS = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.Q2_K: _q2_k, Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.Q8_K: _q8_k, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
    Q.MXFP4: _mxfp4,
}
SUPPORTED_TYPES = frozenset(FLOAT_TYPES) | frozenset(_DECODERS)


def check_supported(qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type as a GGMLQuantizationType, or a ValueError naming it if we cannot decode it."""
    try:
        qtype = Q(qtype)
    except ValueError:
        raise ValueError(f"unknown GGML tensor type {qtype!r}") from None
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"unsupported GGML tensor type {qtype.name} (supported: {names})")
    return qtype


def nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and (torch-order) shape takes; rows must be whole blocks."""
    qtype = Q(qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if block > 1 and (not shape or shape[-1] % block):
        raise ValueError(f"{qtype.name} rows must hold a multiple of {block} elements, "
                         f"got shape {tuple(shape)}")
    return math.prod(shape) // block * type_size


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode `raw` (uint8, 1-D or block-shaped) into a new float32 tensor of `shape`.

    `shape` is in torch order (the reverse of ggml's ne), so rows run along the last dim.
    Works on any device: the output lives where `raw` does.
    """
    qtype = check_supported(qtype)
    shape = tuple(int(s) for s in shape)
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw {qtype.name} data must be uint8 bytes, got {raw.dtype}")
    expected = nbytes(qtype, shape)
    if raw.numel() != expected:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {expected} bytes, "
                         f"got {raw.numel()}")
    out = torch.empty(shape, dtype=torch.float32, device=raw.device)
    flat = raw.reshape(-1)
    if qtype in FLOAT_TYPES:
        dtype = FLOAT_TYPES[qtype]
        if flat.storage_offset() % dtype.itemsize:  # a view needs aligned bytes
            flat = flat.clone()
        out.view(-1).copy_(flat.view(dtype))
        return out
    if flat.storage_offset() % 4:  # scales are read through float16/float32 views
        flat = flat.clone()
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks, rows = flat.view(-1, type_size), out.view(-1, block)
    decode, chunk = _DECODERS[qtype], max(1, _CHUNK_ELEMENTS // block)
    for start in range(0, blocks.shape[0], chunk):
        decode(blocks[start:start + chunk], rows[start:start + chunk])
    return out


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: ties go away from zero (torch.round sends them to even)."""
    a = x.abs()
    whole = a.floor()
    return torch.copysign(whole + (a - whole >= 0.5).float(), x)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes of `x` ([..., C], C a multiple of 32) as uint8 [..., C // 32 * 34].

    Same arithmetic as ggml's reference quantiser: d = amax / 127 in float32, q = roundf(x / d)
    computed as x * (1 / d), d stored as float16.
    """
    if x.ndim == 0 or x.shape[-1] % 32:
        raise ValueError(f"Q8_0 rows must hold a multiple of 32 elements, got shape {tuple(x.shape)}")
    blocks = x.detach().to(torch.float32).reshape(-1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127  # [n, 1]
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _round_half_away(blocks * inv).to(torch.int8)
    packed = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return packed.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)
