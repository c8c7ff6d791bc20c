"""What a run shows while it trains: a tqdm bar only when stdout and stderr are terminals, else a
plain line every ``log_every`` steps, which never fills a log file with carriage returns."""

from __future__ import annotations

import logging
import math
import os
import sys
import time


_log = logging.getLogger(__name__)

PROGRESS_MODES = ("auto", "bar", "lines")


def resolve_progress(mode: str) -> str:
    """``bar`` or ``lines`` for a ``log.progress=`` setting."""
    if mode not in PROGRESS_MODES:
        raise ValueError(f"log.progress={mode!r}: use auto (a bar on a terminal, lines otherwise), "
                         "bar or lines")
    if mode == "auto":
        tty = all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))
        return "bar" if tty and _columns(sys.stderr) != 0 else "lines"
    return mode


def _columns(stream) -> int | None:
    """The terminal's width (0 for a pseudo-terminal never given a size, where a bar would
    draw as nothing); None when it cannot be asked."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def _si(x: float) -> str:
    """3 significant digits with k/M suffix: 812, 12.3k, 1.20M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _duration(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def throughput_text(rec: dict) -> str:
    """``12.3k tok/s, 0.0521 TFLOPS, mem 1.20 GiB`` from a metrics row (mem on CUDA only)."""
    parts = [f"{_si(rec['tokens_per_s'])} tok/s", f"{rec['tflops']:.3g} TFLOPS"]
    if rec.get("device_mem_reserved_bytes") is not None:
        parts.append(f"mem {rec['device_mem_reserved_bytes'] / 2**30:.2f} GiB")
    return ", ".join(parts)


class Progress:
    """The per-step display. ``write`` prints a message without breaking the bar."""

    def __init__(self, mode: str, total_steps: int, start_step: int, log_every: int):
        self.mode = resolve_progress(mode)
        self.total, self.start, self.log_every = total_steps, start_step, max(1, log_every)
        self.t0 = time.perf_counter()
        self.bar = None
        if self.mode == "bar" and total_steps > start_step:
            from tqdm import tqdm  # here: ``layerwise train --help`` imports this module

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, smoothing=0.1, file=sys.stderr)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            with type(self.bar).external_write_mode():
                _log.info(msg)
        else:
            _log.info(msg)

    def eta_s(self, step: int) -> float:
        done = step - self.start
        if done <= 0:
            return math.nan
        return (time.perf_counter() - self.t0) / done * (self.total - step)

    def line(self, rec: dict) -> str:
        """One plain progress line for a metrics row."""
        step = rec["step"]
        ev = f" eval {rec['eval_loss']:.4f}" if "eval_loss" in rec else ""
        timing = f"step {rec['step_s']:.3g} s"  # the prediction: once at the start, checked at the end
        return (f"step {step}/{self.total}: loss {rec['loss']:.4f}{ev} lr {rec['lr']:.2e} "
                f"grad_norm {rec['grad_norm']:.2f} | {throughput_text(rec)} | {timing} | "
                f"ETA {_duration(self.eta_s(step)) if step < self.total else '00:00'}")

    def step(self, rec: dict) -> None:
        step = rec["step"]
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {rec['loss']:.4f}, {throughput_text(rec)}", refresh=False)
            self.bar.update(1)
            if "eval_loss" in rec:
                self.write(f"step {step}/{self.total}: eval loss {rec['eval_loss']:.4f}")
            return
        if step % self.log_every == 0 or step == self.total or "eval_loss" in rec:
            _log.info(self.line(rec))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
