"""Adapters: per-pass functions f(x, y) applied at a projection site of the model (fwd.adapter).

A site is a projection name -- "q", "k", "v", "o" (attention), "gate", "up", "down" (MLP) -- in
every layer, or "layers.<i>.<name>" in one. At that site, for the rows of the pass that attached
it, the projection's output y becomes f(x, y), x being the projection's input rows: a LoRA adapter
is f(x, y) = y + (x @ A) @ B. Passes without adapters run the model unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["SITES", "AdapterUse", "parse_site", "adapt"]

SITES = ("q", "k", "v", "o", "gate", "up", "down")

AdapterFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AdapterUse:
    """One adapter in one batch: where it applies and to which batch rows."""

    site: str
    layer: int | None               # None: every layer
    start: int                      # batch rows [start, end) of the pass that attached it
    end: int
    fn: AdapterFn


def parse_site(site: object, num_layers: int) -> tuple[str, int | None]:
    """("o", None) for "o"; ("o", 3) for "layers.3.o"; ValueError naming the valid sites."""
    if isinstance(site, str):
        name, layer = site, None
        parts = site.split(".")
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
            name, layer = parts[2], int(parts[1])
        if name in SITES and (layer is None or layer < num_layers):
            return name, layer
    raise ValueError(f"unknown adapter site {site!r}: one of {', '.join(SITES)}, or layers.<i>.<site> "
                     f"with i < {num_layers}")


def adapt(uses: list[AdapterUse], layer: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y with every adapter of (`layer`, `site`) applied to its pass's rows."""
    for use in uses:
        if use.site == site and use.layer in (None, layer):
            rows = slice(use.start, use.end)
            out = use.fn(x[rows], y[rows])
            if out.shape != y[rows].shape:
                raise ValueError(f"adapter at {site!r} returned shape {list(out.shape)}, expected "
                                 f"{list(y[rows].shape)} (the projection's output rows)")
            y = y.clone()
            y[rows] = out.to(y.dtype)
    return y
