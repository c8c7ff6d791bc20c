"""Model adapters (pre | layers[i] | post), flavors, loading and export."""

from .adapter import DecoderAdapter, ParamSpec, Unit
from .registry import FAMILIES, FLAVORS, Flavor, check_family, get_flavor

__all__ = ["DecoderAdapter", "ParamSpec", "Unit", "FAMILIES", "FLAVORS", "Flavor",
           "check_family", "get_flavor"]
