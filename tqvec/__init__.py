"""tqvec: TurboQuant vector quantization for ANN indexes and LLM KV caches."""
from .codebook import Codebook, lloyd_max_codebook
from .index import Index
from .quantizer import Codes, TurboQuantizer

__all__ = ["Codebook", "Codes", "Index", "TurboQuantizer", "lloyd_max_codebook"]
__version__ = "0.1.0"
