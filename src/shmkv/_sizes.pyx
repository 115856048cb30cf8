# cython: language_level=3, binding=False
"""shmkv._sizes: the segment's layout from a config's fields, computed by the C layout
itself (_layout.h), and the codes a segment stores for a dtype and a hash.  The bottom of
the package: shmkv.config checks every config with it, shmkv._core creates segments with
it; it imports neither."""
from libc.string cimport memset

from shmkv._layout cimport SHMKV_OK, shmkv_config_t, shmkv_layout_t, shmkv_layout_compute

#: dtype name -> (code stored in the segment, bytes per element)
DTYPES = {"float16": (1, 2), "float32": (2, 4), "bfloat16": (3, 2), "int8": (4, 1),
          "float8_e4m3": (5, 1)}
#: block-hash algorithm name -> code stored in the segment
HASHES = {"fast": 1, "sha256": 2}


cdef shmkv_config_t config_struct(object cfg) except *:
    cdef shmkv_config_t c
    memset(&c, 0, sizeof(c))
    c.num_layers = cfg.num_layers
    c.num_kv_heads = cfg.num_kv_heads
    c.head_dim = cfg.head_dim
    c.block_size = cfg.block_size
    c.num_blocks = cfg.num_blocks
    c.max_seqs = cfg.max_seqs
    c.max_blocks_per_seq = cfg.max_seq_len // cfg.block_size
    c.max_procs = cfg.max_procs
    c.dtype, c.itemsize = DTYPES[cfg.dtype]
    c.hash_algo = HASHES[cfg.hash]
    c.event_capacity = cfg.event_capacity
    return c


cdef dict layout_dict(const shmkv_layout_t *l):
    return dict(token_bytes=l.token_bytes, block_bytes=l.block_bytes,
                layer_stride=l.layer_stride, index_capacity=l.index_capacity,
                off_blocks=l.off_blocks, off_free=l.off_free, off_procs=l.off_procs,
                off_seqs=l.off_seqs, off_seq_free=l.off_seq_free, off_tables=l.off_tables,
                off_tokens=l.off_tokens, off_index=l.off_index, off_kpool=l.off_kpool, off_vpool=l.off_vpool,
                segment_size=l.segment_size, off_events=l.off_events,
                event_record_bytes=l.event_record_bytes, scale_bytes=l.scale_bytes,
                scale_stride=l.scale_stride, off_kscale=l.off_kscale,
                off_vscale=l.off_vscale, off_hscale=l.off_hscale)


def layout_of(cfg):
    """The region layout (sizes and offsets, in bytes) a config gives; ValueError if the
    C layout rejects it."""
    cdef shmkv_config_t c = config_struct(cfg)
    cdef shmkv_layout_t l
    if shmkv_layout_compute(&c, &l) != SHMKV_OK:
        raise ValueError(
            "config: the segment would be too large (over 2^48 bytes) or a field is out "
            f"of range: {cfg!r}")
    return layout_dict(&l)
