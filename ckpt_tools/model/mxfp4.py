"""MXFP4 weights, as GPT-OSS's published checkpoints hold its experts (the OCP microscaling format, transformers'
`quant_method: mxfp4`).

A weight [.., out, in] is stored as `<name>_blocks` uint8 [.., out, in / 32, 16] and `<name>_scales` uint8
[.., out, in / 32]: each run of 32 consecutive inputs is 16 bytes of FP4 (E2M1) codes, the low nibble the even element,
the high nibble the odd one, and one E8M0 scale (2 ** (scale - 127)) for the run. transformers names the tensor
without the suffix and gives it transposed ([.., in, out]: GPT-OSS's `gate_up_proj` [experts, hidden, 2 x ffn],
`down_proj` [experts, ffn, hidden]).

Reading dequantizes exactly: every FP4 value times a power of two is a bfloat16 (scales up to 252; 255 is E8M0's NaN).
Writing (`ckpt merge --mxfp4`) quantizes as triton_kernels' downcast_to_mxfp does by default: each run's scale the
smallest power of two that brings its largest magnitude within 6 (DequantScaleRoundingMode.ROUND_UP), each value
rounded to the nearest FP4 value, ties to even. Values that were MXFP4 come back the same values.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_tools.errors import ConfigError, FormatError

if TYPE_CHECKING:
    import torch

BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32  # inputs per scale
VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # code -> value
MAX_SCALE = 252  # 6 x 2 ** (252 - 127) is the largest bfloat16 power-of-two multiple of an FP4 value


def is_mxfp4(config: dict) -> bool:
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def quantized(name: str, family) -> bool:
    """Whether a family's checkpoints hold this HF tensor (or a slice `name[e]` of it) in MXFP4 (Family.mxfp4: the
    names' endings)."""
    return bool(family.mxfp4) and name.split("[")[0].endswith(family.mxfp4)


def config(family) -> dict:
    """config.json's quantization_config for a family's MXFP4 tensors (GPT-OSS's published one)."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(family.mxfp4_unconverted)}


def hf_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized tensor's shape as transformers names it ([.., in, out]) from its blocks' [.., out, in/32, 16]."""
    *lead, out, groups, _ = blocks_shape
    return (*lead, groups * GROUP, out)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, where: str) -> torch.Tensor:
    """blocks uint8 [.., out, G, 16] and scales uint8 [.., out, G] -> the weight, transposed as transformers holds it
    ([.., in, out]), in bfloat16 (exact)."""
    import torch
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape[:-1]) != tuple(scales.shape) \
            or blocks.shape[-1] != GROUP // 2:
        raise FormatError(f"{where}: MXFP4 blocks {list(blocks.shape)} {blocks.dtype} and scales {list(scales.shape)} "
                          f"{scales.dtype}: expected uint8 [.., out, in/32, 16] and uint8 [.., out, in/32]; the "
                          f"checkpoint is damaged, download it again")
    if scales.numel() and int(scales.max()) > MAX_SCALE:
        raise FormatError(f"{where}: an MXFP4 scale of {int(scales.max())} (E8M0 2 ** {int(scales.max()) - 127}; 255 "
                          f"is NaN): beyond bfloat16's range; the checkpoint is damaged, download it again")
    lut = torch.tensor(VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [.., out, G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2) * torch.exp2(scales.float() - 127).unsqueeze(-1)  # [.., out, G, 32]
    return values.flatten(-2).transpose(-1, -2).to(torch.bfloat16)


def check_shape(name: str, shape: tuple[int, ...]) -> None:
    """A weight as transformers holds it ([.., in, out]) can be MXFP4 only with its inputs a multiple of 32."""
    if len(shape) < 2 or shape[-2] % GROUP:
        raise ConfigError(f"{name} {list(shape)}: MXFP4 packs runs of {GROUP} inputs, and its {shape[-2] if shape else 0} "
                          f"inputs are not a multiple of {GROUP}: drop --mxfp4")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as transformers holds it ([.., in, out], in a multiple of 32) -> (blocks, scales) (see the module)."""
    import torch
    check_shape("a weight", tuple(weight.shape))
    w = weight.transpose(-1, -2).float()  # [.., out, in]
    *lead, out, inputs = w.shape
    runs = w.reshape(*lead, out, inputs // GROUP, GROUP)
    amax = runs.abs().amax(dim=-1)
    # the smallest exponent e with amax / 2**e <= 6 (zero runs: the smallest scale)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0))
    exponent = exponent.clamp(-127, MAX_SCALE - 127)
    exponent = exponent + (runs.abs().amax(-1) / torch.exp2(exponent) > 6.0)  # log2's rounding, corrected
    scaled = runs / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(VALUES[:8], dtype=torch.float32)
    # nearest FP4 magnitude, ties to the even code (the lower of two neighbours where its code is even)
    dist = (scaled.abs().unsqueeze(-1) - magnitudes).abs()
    best = dist.min(dim=-1, keepdim=True).values
    ties = dist == best
    code = torch.where(ties.sum(-1) > 1, _even_of(ties), ties.int().argmax(-1))
    code = code | ((scaled < 0) | ((scaled == 0) & torch.signbit(scaled))).long() << 3
    code = code.to(torch.uint8).reshape(*lead, out, inputs // GROUP, GROUP // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def _even_of(ties: torch.Tensor) -> torch.Tensor:
    """Of two equally near FP4 codes (a tie), the even one."""
    import torch
    codes = torch.arange(ties.shape[-1])
    return torch.where(ties & (codes % 2 == 0), codes, ties.shape[-1]).min(-1).values


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks shape, scales shape) of a weight as transformers holds it ([.., in, out])."""
    *lead, inputs, out = shape
    return (*lead, out, inputs // GROUP, GROUP // 2), (*lead, out, inputs // GROUP)
