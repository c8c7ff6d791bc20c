"""What a model is to layerwise: the family table, named flavors (configs only), the adapter
that splits an HF decoder into ``embed | layers.{i} | head`` units, and the names of units and
checkpoint groups with their HF key map. No training state lives here."""

from .adapter import DecoderAdapter, ParamSpec, Unit
from .families import FAMILIES, FamilySpec, family_of
from .registry import FLAVORS, Flavor, get_flavor

__all__ = ["DecoderAdapter", "ParamSpec", "Unit", "FAMILIES", "FamilySpec", "family_of", "FLAVORS",
           "Flavor", "get_flavor"]
