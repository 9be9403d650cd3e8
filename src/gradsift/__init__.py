"""gradsift: communication-efficient data-parallel training by gradient sparsification."""

from .compressors import available, parse_spec
from .memory.factory import make_compressor, sparsify
from .payload import Payload

__version__ = "0.1.0"
__all__ = ["Payload", "available", "make_compressor", "parse_spec", "sparsify", "__version__"]
