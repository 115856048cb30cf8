# shmkv._inspect: the link of the method chain above _core.Segment (stats, check, recover).
from shmkv._core cimport Segment


cdef class InspectOps(Segment):
    pass
