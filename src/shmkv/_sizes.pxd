# The C layout's binding at the bottom of the package (_sizes.pyx): cimported by _core
# (the create protocol) and _inspect (snapshots).
from shmkv._layout cimport shmkv_config_t, shmkv_layout_t

cdef shmkv_config_t config_struct(object cfg) except *
cdef dict layout_dict(const shmkv_layout_t *l)
