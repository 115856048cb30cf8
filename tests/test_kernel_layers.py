"""The C kernels' layering (src/shmkv/kernels/layers.txt): no file uses what a file above it
defines (tools/kernel_layers.py, also run by `make lint`).  Reads the source tree, not
the installed package; skipped where the tree is not beside the tests."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "src", "shmkv", "kernels")
if not os.path.exists(os.path.join(KERNELS, "layers.txt")):
    pytest.skip("no source tree beside the tests", allow_module_level=True)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import kernel_layers as kl  # noqa: E402


def test_the_kernels_have_no_upward_use():
    layers = kl.read_layers()
    errors, graph = kl.check(kl.load(KERNELS, layers), layers)
    assert errors == []
    # no call circle: the primitives know nothing of recovery
    for low in ("lock.h", "pcache.h", "seq.h"):
        assert not graph[low] & {"recover.h", "ops.h"}, (low, graph[low])


LAYERS = [["base.h"], ["lock.h"], ["recover.h"]]
BASE = "static inline int shmkv_base(int x) { return x + 1; }\n"
RECOVER = ('#include "lock.h"\n'
           "static int shmkv_recover(int x) {\n    return shmkv_lock(x) + shmkv_base(x);\n}\n")


def _lock(body):
    return "/* lock.h */\n" + body


def test_a_downward_call_passes():
    lock = _lock("static int shmkv_lock(int x) { return shmkv_base(x); }\n")
    src = {"base.h": BASE, "lock.h": lock, "recover.h": RECOVER}
    errors, graph = kl.check(src, LAYERS)
    assert errors == []
    assert graph["recover.h"] == {"lock.h", "base.h"}


@pytest.mark.parametrize("lock_body,what", [
    # a call up (a primitive calling recovery: the call circle)
    ("static int shmkv_lock(int x) {\n    if (x) return shmkv_recover(x);\n    return 0;\n}\n",
     "uses shmkv_recover"),
    # a prototype of a function above is a use too
    ("static int shmkv_recover(int x);\nstatic int shmkv_lock(int x) { return x; }\n",
     "uses shmkv_recover"),
    # through a function-like macro's body
    ("#define LOCK_FIX(x) \\\n    shmkv_recover(x)\nstatic int shmkv_lock(int x) { return x; }\n",
     "uses shmkv_recover"),
    # a pointer to it, no call
    ("static int (*fix)(int) = shmkv_recover;\nstatic int shmkv_lock(int x) { return x; }\n",
     "uses shmkv_recover"),
    # an include of a file above
    ('#include "recover.h"\nstatic int shmkv_lock(int x) { return x; }\n',
     "includes recover.h"),
])
def test_an_upward_use_fails(lock_body, what):
    src = {"base.h": BASE, "lock.h": _lock(lock_body), "recover.h": RECOVER}
    errors, _ = kl.check(src, LAYERS)
    assert any(e.startswith("lock.h:") and what in e for e in errors), errors


def test_comments_and_strings_are_not_uses():
    body = ('/* shmkv_recover(x) is called by the coordinator */\n'
            'static const char *why = "shmkv_recover(x)";\n'
            "static int shmkv_lock(int x) { return x; }  // shmkv_recover\n")
    errors, _ = kl.check({"base.h": BASE, "lock.h": _lock(body), "recover.h": RECOVER}, LAYERS)
    assert errors == []


def test_a_file_without_a_place_fails():
    src = {"base.h": BASE, "lock.h": _lock(""), "recover.h": RECOVER, "new.h": ""}
    errors, _ = kl.check(src, LAYERS)
    assert any(e.startswith("new.h:") and "not in layers.txt" in e for e in errors)


def test_one_line_is_one_room_and_patterns_place_files():
    layers = [["base.h"], ["unit.c", "unit_*.h"]]
    src = {"base.h": BASE,
           "unit.c": "static int helper(int x) { return shmkv_base(x); }\n",
           "unit_isa.h": "static int body(int x) { return helper(x); }\n"}
    assert kl.check(src, layers)[0] == []


def test_the_command_fails_on_an_upward_call(tmp_path, capsys):
    (tmp_path / "layers.txt").write_text("base.h\nlock.h\nrecover.h\n")
    (tmp_path / "base.h").write_text(BASE)
    (tmp_path / "recover.h").write_text(RECOVER)
    up = "static int shmkv_lock(int x) { return shmkv_recover(x); }\n"
    (tmp_path / "lock.h").write_text(_lock(up))
    assert kl.main(["--dir", str(tmp_path)]) == 1
    assert "lock.h:2: uses shmkv_recover, defined above it in recover.h" in capsys.readouterr().out
    (tmp_path / "lock.h").write_text(_lock("static int shmkv_lock(int x) { return x; }\n"))
    assert kl.main(["--dir", str(tmp_path)]) == 0
