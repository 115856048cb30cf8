# shmkv._sequences: the sequence-life link of the method chain (create, fork, free, tables,
# ownership); _kvdata.DataOps subclasses it.
from libc.stdint cimport uint64_t

from shmkv._prefix cimport PrefixOps


cdef class SequenceOps(PrefixOps):
    cdef int _set_owner(self, object sid, uint64_t owner) except -1
