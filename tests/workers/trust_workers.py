"""Run by tests/test_trust.py as root (``python workers/trust_workers.py CMD NAME [ARG]``):
it imports what it needs, becomes ``nobody`` (uid and gid 65534, no supplementary groups:
setgroups, setresgid, setresuid, so no capability is left), makes one shmkv call and
prints one JSON line with what happened.  It drops privileges itself rather than being
started by ``setpriv``: the interpreter may live where nobody cannot read (/root/.pyenv).

``create NAME MODE``: KVCache.create with that octal mode (the SMALL config).
``attach NAME [TRUSTED]``: KVCache.attach (trusting TRUSTED); the exception's type and
message if it fails.
"""
import json
import os
import sys

import shmkv
import shmkv._shmfile  # noqa: F401  (imported while the stdlib is still readable)
import shmkv.pending  # noqa: F401

NOBODY = 65534


def become_nobody():
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    assert (os.getuid(), os.geteuid(), os.getegid(), os.getgroups()) == (
        NOBODY, NOBODY, NOBODY, [])


def main(cmd, name, arg=None):
    cfg = shmkv.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=64,
                            block_size=4, max_seqs=32)
    become_nobody()
    try:
        if cmd == "create":
            shmkv.KVCache.create(name, cfg, mode=int(arg, 8)).close()
        elif cmd == "attach":
            shmkv.KVCache.attach(name, trusted_owners=arg).close()
        else:
            raise SystemExit(f"unknown command {cmd!r}")
    except Exception as e:
        print(json.dumps({"ok": False, "type": type(e).__name__,
                          "permission": isinstance(e, PermissionError), "msg": str(e)}))
        return
    print(json.dumps({"ok": True}))


if __name__ == "__main__":
    main(*sys.argv[1:])
