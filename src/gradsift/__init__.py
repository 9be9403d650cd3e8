"""gradsift: communication-efficient data-parallel training by gradient sparsification."""

from .compressors import available, parse_spec
from .memory.factory import make_compressor, sparsify
from .memory.spec import Spec
from .payload import Payload

__version__ = "0.1.0"
__all__ = ["Payload", "Spec", "available", "make_compressor", "parse_spec", "sparsify", "__version__"]
