/*
 * kernels/kernels.h -- the C kernels over a mapped shmkv segment (umbrella header).
 *
 * Every kernel is `noexcept nogil` from Cython's point of view: it returns a status
 * (SHMKV_OK or SHMKV_E*) and never touches Python.  One translator in _core.pyx turns a
 * status into the exception the API contract names (docs/reference/index.md).
 *
 * Kernels whose name ends in `_locked` run with ctx->sh->pool_lock held by the caller.
 * Kernels are all-or-nothing: they check capacity and validate every index they will use
 * before they mutate anything.  Every index or length read from the segment is checked
 * against the trusted copy of the config in the ctx (validated once, at bind) before use.
 *
 * One file per concern, included bottom-up in the order of layers.txt (checked by
 * tools/kernel_layers.py): the primitives (base .. prefix), which assume their locks are
 * held, never take one and never recover -- a dead holder is reported as EDEADHOLDER --
 * then the coordinators, recover.h (the recovery pass) and ops.h (the waits that
 * recover, the process caches' slow paths, registration).  No file uses what a file
 * above it defines.  _layout.h owns the layout.
 */
#ifndef SHMKV_KERNELS_H
#define SHMKV_KERNELS_H

#include "base.h"
#include "quant.h"
#include "lock.h"
#include "events.h"
#include "alloc.h"
#include "seq.h"
#include "pcache.h"
#include "copy.h"
#include "prefix.h"
#include "recover.h"
#include "ops.h"

#endif /* SHMKV_KERNELS_H */
