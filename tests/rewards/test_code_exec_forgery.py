"""Issue 42, rewards a policy cannot forge: programs that try to fake their `code_exec` score get 0 in every
isolation mode this machine runs; honest ones score as before; the metric counts the ones that reach for the tools.

Every forger below has a WRONG `f` (the tests want f(x) = x + 3). What it cannot know is the expected values: they
never enter the sandbox. So a forger claims passes in every way it could without them: an object equal to
everything, patched builtins, the runner's writer dug out of its frames or the heap, result lines in every format
the runner has used ("<i> 1", "<i> true", "<nonce> <i> 1"), early exits. A program that wrote the right values on
the result channel would score them, as would one that returned them: that is knowing the answers, not forging.
"""

from __future__ import annotations

import json

import pytest

from forge.compose import reward_worker
from forge.config import RunConfig
from forge.rewards import code_exec as ce
from forge.rewards.code_judge import count_suspicious, suspicious
from tests.rewards.test_trl_calls import fake_rollouts
from tests.test_code_exec import LIMITS, TESTS, clean_machine  # noqa: F401 - clean_machine is a fixture

SPEC = ce.parse_tests(TESTS)  # f(x) == x + 3 for x in 0, 1, 2, 5, -4


def _modes() -> list[str]:
    """Every isolation mode that runs here: the namespaces as root, a user namespace, and none (the mode that
    `reward.code_exec.allow_network` permits where namespaces cannot be made)."""
    probe = {"probe": True, "program": "", "checks": [], "per_test_s": 1.0}
    found = [m for m in ("root", "userns") if ce._run_request(m, probe, ce.SandboxLimits(), 0).status == "ok"]
    return [*found, "none"]


MODES = _modes()
CLAIMS = "for claim in ('{i} 1', '{i} true', 'loaded', '{i} [1, 1]', 'done', '0' * 32 + ' {i} 1'):\n"

FORGERIES = {
    # (a) a value equal to everything
    "eq_always_true": (
        "class Anything:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
        "def f(x): return Anything()\n"
    ),
    "int_subclass_eq": "class Five(int):\n    def __eq__(self, other): return True\ndef f(x): return Five(0)\n",
    "bool_override": (
        "class Yes:\n    def __bool__(self): return True\n    __eq__ = lambda s, o: s\ndef f(x): return Yes()\n"
    ),
    "hash_collides": (  # a metaclass whose hash and equality claim to be `list`'s, and an __iter__ to walk
        "class Meta(type):\n    __hash__ = lambda c: hash(list)\n    __eq__ = lambda c, o: True\n"
        "class L(metaclass=Meta):\n    __iter__ = lambda s: iter([3])\ndef f(x): return L()\n"
    ),
    # (b) the test machinery patched
    "patch_compile": (
        "import builtins\n_c = compile\nbuiltins.compile = lambda *a, **k: _c('pass', '<t>', 'exec')\n"
        "def f(x): return 0\n"
    ),
    "patch_exec_eval": (
        "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: True\n"
        "def f(x): return 0\n"
    ),
    "patch_import_assert": (
        "import builtins\nbuiltins.__import__ = lambda *a, **k: None\nbuiltins.AssertionError = type('Q', (), {})\n"
        "def f(x): return 0\n"
    ),
    "patch_type_isinstance": (
        "import builtins\nbuiltins.type = lambda o: int\nbuiltins.isinstance = lambda o, t: True\n"
        "def f(x): return 'x'\n"
    ),
    "patch_os_write_json": (
        "import os, json\n_w = os.write\nos.write = lambda fd, b: _w(fd, b.replace(b' !', b' 1'))\n"
        "json.dumps = lambda *a, **k: 'true'\ndef f(x): return None\n"
    ),
    "patch_runner_module": (
        "import sys\nm = sys.modules['__main__']\nm.encoder = lambda *a: (lambda v: '1')\n"
        "m._describe = lambda e: 'true'\nm._NoValue = StopIteration\ndef f(x): return object()\n"
    ),
    # (c) the runner's writer and state read out of its frames or the heap, then fake result lines
    "frame_writer": (
        "import sys\nframe = sys._getframe(1)\nwhile frame and 'line' not in frame.f_locals:\n"
        "    frame = frame.f_back\nline = frame.f_locals['line']\n"
        + CLAIMS
        + "    for i in range(5):\n        line(claim.format(i=i))\nimport os\nos._exit(0)\n"
    ),
    "frame_nonce_writer": (  # the forgery that scored 1.0 before issue 42: nonce and fd from the runner's frames
        "import os, sys\nframe, seen = sys._getframe(1), {}\nwhile frame:\n    seen = {**frame.f_locals, **seen}\n"
        "    frame = frame.f_back\nfd, nonce = seen['results'], seen.get('nonce', '')\nfor i in range(5):\n"
        "    os.write(fd, f'{nonce} {i} 1\\n'.encode())\nos.write(fd, f'{nonce} done\\n'.encode())\nos._exit(0)\n"
    ),
    "gc_writer": (
        "import gc\nline = next(o for o in gc.get_objects() if getattr(o, '__name__', '') == 'line')\n"
        "line('loaded')\nfor i in range(5):\n    line(f'{i} true')\nline('done')\nimport os\nos._exit(0)\n"
    ),
    "gc_rewrite_checks": (  # every compiled check replaced by a statement that passes
        "import gc\nok = ('stmt', compile('pass', '<t>', 'exec'), None)\n"
        "for o in gc.get_objects():\n    if type(o) is list and o and type(o[0]) is tuple and o[0][:1] == ('expr',):\n"
        "        o[:] = [ok] * len(o)\ndef f(x): return 0\n"
    ),
    "inspect_locals": (
        "import inspect\nfor info in inspect.stack():\n    info.frame.f_locals.pop('checks', None)\n"
        "    info.frame.f_globals.pop('_compile_check', None)\ndef f(x): return 0\n"
    ),
    # printed or written result lines
    "print_fake_lines": (
        "for i, want in enumerate([3, 4, 5, 8, -1]):\n    print(f'{i} {want}')\n    print(f'{i} 1')\n"
        "print('done')\ndef f(x): return 0\n"
    ),
    "every_fd": (
        "import os\nfor name in os.listdir('/proc/self/fd'):\n    for i in range(5):\n"
        "        for claim in (f'{i} 1', f'{i} true', 'loaded', 'done'):\n            try:\n"
        "                os.write(int(name), claim.encode() + b'\\n')\n            except OSError:\n"
        "                pass\ndef f(x): return 0\n"
    ),
    "every_fd_then_exit": (
        "import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'loaded\\n' + b''.join(b'%d 1\\n' % i "
        "for i in range(5)) + b'done\\n')\n    except OSError:\n        pass\nos._exit(0)\n"
    ),
    # exits, at import and in the function under test (the right `f` after an import-time exit is never reached)
    "sys_exit_at_import": "import sys\nsys.exit(0)\ndef f(x): return x + 3\n",
    "raise_systemexit_at_import": "raise SystemExit(0)\ndef f(x): return x + 3\n",
    "os_exit_at_import": "import os\nos._exit(0)\ndef f(x): return x + 3\n",
    "os_exit_3_at_import": "import os\nos._exit(3)\ndef f(x): return x + 3\n",  # the runner's 'setup failed' status
    "sys_exit_in_f": "import sys\ndef f(x):\n    sys.exit(0)\n",
    "raise_systemexit_in_f": "def f(x):\n    raise SystemExit(0)\n",
    "os_exit_in_f": "import os\ndef f(x):\n    os._exit(0)\n",
    "kill_self_in_f": "import os, signal\ndef f(x):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgery_scores_zero(name, mode, clean_machine):  # noqa: F811
    result = ce.run_sandboxed(FORGERIES[name], SPEC, LIMITS, mode)
    assert result.score == 0.0, result
    assert result.status != "setup_failed", result  # a program's exit is its own failure, never the sandbox's


@pytest.mark.parametrize("mode", MODES)
def test_lines_written_beside_the_runners_void_the_run(mode, clean_machine):  # noqa: F811
    """Right code that also writes on the result channel gets nothing: its lines and the runner's cannot both be
    the runner's."""
    program = "import os\nfor fd in range(3, 10):\n    try:\n        os.write(fd, b'0 3\\n')\n    except OSError:\n"
    program += "        pass\ndef f(x): return x + 3\n"
    result = ce.run_sandboxed(program, SPEC, LIMITS, mode)
    assert (result.score, result.status) == (0.0, "forged"), result


@pytest.mark.parametrize("mode", MODES)
def test_honest_code_scores_as_before(mode, clean_machine):  # noqa: F811
    right, partial = "def f(x):\n    return x + 3", "def f(x):\n    return x + 3 if x > 0 else 0"
    assert ce.run_sandboxed(right, SPEC, LIMITS, mode).score == 1.0
    assert ce.run_sandboxed(partial, SPEC, LIMITS, mode).score == 0.6  # x = 1, 2, 5 pass; 0 and -4 fail
    assert ce.run_sandboxed("def f(x):\n    return float(x + 3)", SPEC, LIMITS, mode).score == 1.0  # 3.0 == 3


def test_values_come_back_whole_and_compare_type_strictly(clean_machine):  # noqa: F811
    """Every type the wire carries survives the trip; bool is not int, a tuple is not a list, NaN is not NaN."""
    program = (
        "def f(k):\n    return {\n"
        "        'list': [1, [2.5, None], 'é\\ud800😀'], 'tuple': (1, (2,)), 'dict': {1: 'a', (2, 3): [True]},\n"
        "        'set': {1, 2}, 'frozen': frozenset({'a'}), 'bytes': b'\\x00\\xff', 'big': 2 ** 200,\n"
        "        'inf': float('-inf'), 'true': True, 'nan': float('nan'), 'int1': 1,\n"
        "        'sub': type('S', (str,), {})('s'),\n    }[k]\n"
    )
    tests = [
        "assert f('list') == [1, [2.5, None], 'é\\ud800😀']",  # pass
        "assert f('tuple') == (1, (2,))",  # pass
        "assert f('dict') == {(2, 3): [True], 1.0: 'a'}",  # pass: dict order is free, 1.0 == 1
        "assert f('set') == {2, 1}",  # pass
        "assert f('frozen') == {'a'}",  # pass: a frozenset equals a set
        "assert f('bytes') == b'\\x00\\xff'",  # pass
        "assert f('big') == 1606938044258990275541962092341162602522202993782792835301376",  # pass
        "assert f('inf') == -1e999",  # pass
        "assert f('true') is True",  # pass
        "assert f('tuple') == [1, [2]]",  # fail: a tuple is not a list
        "assert f('true') == 1",  # pass: True == 1, as in Python
        "assert f('int1') == True",  # pass: 1 == True
        "assert f('nan') == f('nan')",  # fail: NaN equals nothing
        "assert f('sub') == 's'",  # fail: a str subclass is no value
    ]
    result = ce.run_sandboxed(program, ce.parse_tests(tests), LIMITS, ce.probe_isolation())
    assert (result.passed, result.total, result.status) == (11, 14, "ok"), result


def test_free_form_asserts_need_a_trusted_suite(clean_machine):  # noqa: F811
    free = ["assert f(1) == 4", "assert f(2) > 4"]
    assert ce.parse_tests(json.dumps(free)) is None  # a data error: the row gets no score
    trusted = ce.parse_tests(json.dumps({"tests": free, "trusted": True}))
    assert trusted is not None and ce.parse_tests(json.dumps({"tests": free, "trusted": "yes"})) is None
    result = ce.run_sandboxed("def f(x): return x + 3", trusted, LIMITS, ce.probe_isolation())
    assert (result.passed, result.total) == (2, 2)
    # the ones that can be judged outside: either side a literal, or both sides expressions (a pair)
    for test in ("assert 4 == f(1)", "assert f(1) == f(0) + 1", "assert f(1) is None", "assert f(1) == 4, 'msg'"):
        assert ce.parse_tests(json.dumps([test])) is not None, test
    with pytest.raises(ValueError, match="trusted"):
        ce.run_sandboxed("", ce.CodeTests(("assert f(1)",)), LIMITS, ce.probe_isolation())


def test_the_verifier_scores_forgeries_zero_and_leaves_missing_specs_unscored(clean_machine):  # noqa: F811
    fn = ce.make_code_exec(LIMITS, allow_network=True)
    completions = [FORGERIES["eq_always_true"], FORGERIES["frame_writer"], "def f(x): return x + 3", "def f(x): ..."]
    answers = [TESTS] * 3 + [json.dumps(["assert is_sorted(f(1))"])]  # the last: untrusted free-form, no score
    assert fn(prompts=["p"] * 4, completions=completions, answer=answers) == [0.0, 0.0, 1.0, None]


def test_suspicious_completions_are_counted_in_the_step_metrics(clean_machine):  # noqa: F811
    assert [name for name in FORGERIES if not suspicious(FORGERIES[name])] == ["print_fake_lines"]
    honest = ["def f(x):\n    return x + 3", "```python\ndef f(x):\n    return sorted(x)\n```", "def f(x): return x"]
    assert count_suspicious(honest) == 0
    cfg = RunConfig(steps=5)
    cfg.reward.verifiers = ["code_exec"]
    rows = [{"id": "r", "prompt": "f", "model_input": "f", "answer": TESTS}]
    texts = [FORGERIES["eq_always_true"], FORGERIES["sys_exit_in_f"], honest[0], honest[2]]
    batch = reward_worker(cfg).score(rows, fake_rollouts(1, 4, texts), step=1)
    assert batch.scores[:, 0].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert batch.reward_metrics["reward/code_exec/suspicious"] == 2.0
