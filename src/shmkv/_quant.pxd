# shmkv._quant: quantized pools, the link between the sequences and the K/V data
# (_kvdata.DataOps subclasses it).
from libc.stdint cimport uint32_t, uint64_t, int64_t
cimport numpy as cnp

from shmkv._sequences cimport SequenceOps


cdef class QuantOps(SequenceOps):
    cdef list _qbufs                # quantization scratch kept between calls: [K, V]
    cdef cnp.ndarray _scratch(self, int i, size_t nbytes)
    cdef int _scratch_back(self, int i, cnp.ndarray q) except -1
    cdef int64_t _layer(self, object layer) except -1
    cdef cnp.ndarray _farray(self, object a, str what, int ndim)
    cdef tuple _quantize(self, cnp.ndarray x, uint32_t layers, uint64_t n, uint32_t layer0,
                         int is_v, str what)
    cdef object _dequantize(self, cnp.ndarray q, cnp.ndarray sc, uint32_t layers,
                            uint64_t n, int is_v, cnp.ndarray out)
    cdef object _hscale_view(self, bint is_k)
    cdef object _scale_view(self, object layer, bint is_k)
    cdef object _gather_quant(self, object sid, object start, object stop, object out,
                              bint raw)
    cdef tuple _check_out(self, object out, tuple shape)


cdef object _aligned_empty(tuple shape, object dtype)
