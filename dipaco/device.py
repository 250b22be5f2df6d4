"""Where and in what precision a model runs: `hardware.device` and `hardware.precision`.

    from dipaco.device import resolve_device, resolve_precision, autocast
    device = resolve_device("auto")            # CUDA when present, else the CPU
    resolve_precision("auto", device)          # "bf16" where it is fast, else "fp32" (logged once)
    with autocast(device, "auto"): loss = model(...).loss

`auto` (the default) picks bf16 autocast only where it is fast: a CUDA GPU with native bf16 (Ampere
and later), or a CPU with AVX512-BF16 or AMX, as `torch.cpu.get_capabilities()` reports. Elsewhere it
picks fp32: bf16 autocast on an AVX2-only CPU is emulated and measured 10-12x slower than fp32 (see
docs/configuration.md). When torch cannot say, a tiny timed matmul decides. An explicit `bf16` where
it is slow is honoured, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present, else the CPU; `cuda` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(name)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast when `precision` (`auto` resolved for `device`) is bf16, else nothing."""
    if resolve_precision(precision, device) == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16), from what torch reports;
    None when this torch does not say."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        try:
            caps = capabilities()
            return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
        except Exception:  # an older or unusual build: fall back to the capability string
            pass
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    if capability in ("DEFAULT", "AVX2", "NO AVX"):
        return False
    return None


def bf16_matmul_is_faster(*, size: int = 256, repeats: int = 5) -> bool:
    """A tiny timed matmul: bf16 autocast against fp32 on the CPU (used when detection is unsure)."""
    a, b = torch.randn(size, size), torch.randn(size, size)

    def best(bf16: bool) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                (a @ b).sum().item()
            times.append(time.perf_counter() - start)
        return min(times)

    best(True)  # warm up both kernels
    best(False)
    return best(True) < best(False)


@functools.cache
def _resolve(device_type: str, precision: str, cuda_bf16: bool) -> tuple[str, str, bool]:
    """(precision to use, why, whether it will be slow) — computed once per device kind and setting."""
    if device_type == "cuda":
        native, reason = cuda_bf16, ("the GPU supports bf16" if cuda_bf16 else "this GPU has no native bf16 (pre-Ampere)")
    else:
        native = cpu_has_native_bf16()
        capability = torch.backends.cpu.get_cpu_capability()
        reason = "the CPU has AVX512-BF16 / AMX" if native else f"the CPU has no native bf16 ({capability})"
        if native is None:
            native = bf16_matmul_is_faster()
            reason = f"a timed matmul found bf16 autocast {'faster' if native else 'slower'} than fp32 on this CPU"
    if precision == "auto":
        return ("bf16" if native else "fp32"), reason, False
    if precision == "bf16" and not native:
        return "bf16", (f"bf16 was asked for, but {reason}: autocast is emulated and much slower than fp32 "
                        f"(about 10x on an AVX2 CPU); set precision: auto or fp32"), True
    return precision, "as configured", False


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` → bf16 where it is fast (a CUDA GPU with bf16; a CPU with AVX512-BF16 or AMX), else fp32.

    The choice for `auto` and its reason are logged once per device kind; an explicit `bf16` where it
    is slow is kept, with a warning logged once."""
    if precision == "fp32":
        return "fp32"
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    chosen, reason, slow = _resolve(device.type, precision, cuda_bf16)
    if (device.type, precision) not in _LOGGED:
        _LOGGED.add((device.type, precision))
        if slow:
            log.warning("precision: %s", reason)
        elif precision == "auto":
            log.info("precision auto -> %s on %s: %s", chosen, device.type, reason)
    return chosen


_LOGGED: set[tuple[str, str]] = set()
