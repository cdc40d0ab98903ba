"""`ditq COMMAND --help` answers at once: no command's parser imports torch, diffusers or transformers (they load
in its run), and the choices and defaults the parsers show are the ones the code uses."""

from __future__ import annotations

import subprocess
import sys

from ditq.cli import COMMANDS


def test_no_commands_help_imports_torch() -> None:
    """Every command's --help in one fresh interpreter, then what it had to import (torch alone took 2-5 s)."""
    script = (
        "import sys\n"
        "from ditq.cli import COMMANDS, main\n"
        "for name in COMMANDS:\n"
        "    try:\n"
        "        main([name, '--help'])\n"
        "    except SystemExit as done:\n"
        "        assert done.code == 0, name\n"
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers', 'matplotlib') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert all(f"usage: ditq {name}" in done.stdout for name in COMMANDS)


def test_the_choices_help_shows_are_the_codes() -> None:
    from ditq import commands
    from ditq.commands.probe import PROBE_API_KEY_ENV
    from ditq.commands.report import OBJECTIVES
    from ditq.judge.compare import MAX_SEEDS, TOLERANCE_DB
    from ditq.kernels.attention import ATTENTION_KINDS
    from ditq.kernels.registry import ACCUMULATE_MODES
    from ditq.plan.planner import DEFAULT_SCHEMES
    from ditq.probe import runner
    from ditq.report import schema
    from ditq.runtime.compile import COMPILE_BACKENDS
    from ditq.runtime.kv_cache import KV_CACHE_KINDS
    from ditq.schemes import SCHEMES

    assert tuple(ATTENTION_KINDS) == commands.ATTENTION_CHOICES
    assert tuple(ACCUMULATE_MODES) == commands.ACCUMULATE_CHOICES
    assert commands.COMPILE_BACKENDS == COMPILE_BACKENDS and commands.KV_CACHE_CHOICES == KV_CACHE_KINDS
    assert tuple(SCHEMES) == commands.SCHEME_NAMES and commands.PLAN_SCHEMES == DEFAULT_SCHEMES
    assert (commands.MAX_SEEDS, commands.TOLERANCE_DB) == (MAX_SEEDS, TOLERANCE_DB)
    assert tuple(schema.OBJECTIVES) == OBJECTIVES and PROBE_API_KEY_ENV == runner.PROBE_API_KEY_ENV
