"""The dtypes a compressor's payload values travel in (:class:`WireDtypes`, a part of
:class:`gradsift.compressors.base.Compressor`)."""

from __future__ import annotations

import math

import torch


class WireDtypes:
    """``value_dtype`` (one dtype for every payload's values, or None), ``sparse_dtype`` (a sparse payload's, bf16
    when the memory keeps the rounding) and ``value_bits`` (int4/int2: coded by the road) -- set by the compressor --
    read into the casts and sizes of the wire."""

    value_dtype: torch.dtype | None
    sparse_dtype: torch.dtype | None
    value_bits: int

    def wire(self, values: torch.Tensor, sparse: bool = True) -> torch.Tensor:
        """Values cast to the wire dtype: ``value_dtype`` when set; else, for a ``sparse`` payload's fp32 values,
        :attr:`sparse_dtype` (bf16 when the memory keeps the rounding); else their own. Beyond a narrower dtype's
        range they saturate at its largest finite value instead of becoming Inf (with error feedback the excess
        stays in memory)."""
        dt = self.sparse_dtype if self.value_dtype is None and sparse and values.dtype == torch.float32 else \
            self.value_dtype
        if dt is None or values.dtype == dt:
            return values
        if torch.finfo(dt).max < torch.finfo(values.dtype).max:
            if not values.is_cuda and values.dtype in (torch.float32, torch.float64):
                # on the host, the plain cast and one read of what it gave (no Inf there: nothing overflowed) instead
                # of four passes (NaN there too: the careful cast); on a GPU the four kernels below take no host sync
                out = values.to(dt)
                if not out.numel():
                    return out
                lo, hi = torch.aminmax(out)
                if math.isfinite(float(lo)) and math.isfinite(float(hi)):
                    return out
            big = torch.finfo(dt).max
            if values.dtype not in (torch.float32, torch.float64):  # (bf16 rounds fp16's 65504 up to 65536: Inf)
                values = values.float()
            return torch.where(values.isinf(), values, values.clamp(-big, big)).to(dt)  # an overflow stays one
        return values.to(dt)

    def wire_whole(self, flats: list[torch.Tensor], natives: list[bool]) -> list[torch.Tensor]:
        """Whole tensors' values as they travel: each in the method's wire dtype (:meth:`wire` of a whole tensor), or
        with ``natives[i]`` in its own. The ones to cast are joined and cast once: the same values as a cast each,
        in a number of operations that does not grow with the tensors."""
        out = list(flats)
        cast = [i for i, (f, native) in enumerate(zip(flats, natives))
                if not native and self.value_dtype is not None and f.dtype != self.value_dtype]
        if len(cast) > 1 and len({flats[i].dtype for i in cast}) == 1:
            joined = self.wire(torch.cat([flats[i] for i in cast]), sparse=False)
            for i, values in zip(cast, joined.split([flats[i].numel() for i in cast])):
                out[i] = values
        else:
            for i in cast:
                out[i] = self.wire(flats[i], sparse=False)
        return out

    def sparse_wire_dtype(self) -> torch.dtype | None:
        """The dtype :meth:`wire` gives a sparse payload's float32 values (None: they stay float32; int4/int2 are
        rounded later, by the road)."""
        if self.value_bits:
            return None
        dt = self.sparse_dtype if self.value_dtype is None else self.value_dtype
        return None if dt == torch.float32 else dt

    def sparse_value_bytes(self, item: int) -> int:
        """Bytes of one sparse value for a gradient of ``item`` bytes an entry (int4/int2: :attr:`value_bits`)."""
        if self.value_dtype is not None:
            return self.value_dtype.itemsize
        return self.sparse_dtype.itemsize if self.sparse_dtype is not None and item == 4 else item
