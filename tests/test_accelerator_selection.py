"""DeepSpeed selects SUPA_Accelerator: op builder lookup, the SUPA_DS_ACCELERATOR setting and the
get_accelerator wrapper in-process, and selection in fresh processes that contain no selection code of
their own (the `torch.backends` entry point must do it)."""

import json
import pathlib
import sys
import textwrap
import threading
import types

import pytest

from supa_deepspeed.accelerator import deepspeed_selection
from supa_deepspeed.accelerator.supa_accelerator import SUPA_Accelerator

import harness

requires_supa = pytest.mark.skipif(not SUPA_Accelerator().is_available(),
                                   reason="no SUPA device: run on a SUPA card or with SUPA_EMULATE=1")


# ---------------------------------------------------------------------------------------------
# Op builder lookup, on a throwaway package


def _write_builder_package(root, name, with_fallback):
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "builder.py").write_text(
        textwrap.dedent("""
        import abc
        class DemoOpBuilder(abc.ABC):
            NAME = None
            @abc.abstractmethod
            def load(self): ...
        """))
    (package / "adam.py").write_text(
        textwrap.dedent("""
        from .builder import DemoOpBuilder
        class FusedAdamBuilder(DemoOpBuilder):
            NAME = "fused_adam"
            def load(self):
                return "adam-module"
        """))
    if with_fallback:
        (package / "no_impl.py").write_text(
            textwrap.dedent("""
            from .builder import DemoOpBuilder
            class NotImplementedBuilder(DemoOpBuilder):
                def load(self):
                    raise NotImplementedError(type(self).__name__ + " is not implemented on SUPA")
            """))


@pytest.mark.parametrize("with_fallback", [True, False])
def test_op_builder_lookup(tmp_path, monkeypatch, with_fallback):
    name = f"demo_builders_{with_fallback}"
    _write_builder_package(tmp_path, name, with_fallback)
    monkeypatch.syspath_prepend(str(tmp_path))
    a = SUPA_Accelerator()
    monkeypatch.setattr(a, "op_builder_dir", lambda: name)

    adam = a.get_op_builder("FusedAdamBuilder")
    assert adam.__module__ == f"{name}.adam"
    assert a.create_op_builder("FusedAdamBuilder").load() == "adam-module"
    assert "DemoOpBuilder" not in a._builder_classes()
    if with_fallback:
        missing = a.get_op_builder("TransformerBuilder")
        assert missing is a.get_op_builder("TransformerBuilder")
        assert missing.__name__ == "TransformerBuilder"
        assert issubclass(missing, sys.modules[f"{name}.no_impl"].NotImplementedBuilder)
        with pytest.raises(NotImplementedError, match="TransformerBuilder is not implemented on SUPA"):
            a.create_op_builder("TransformerBuilder").load()
    else:
        assert a.get_op_builder("TransformerBuilder") is None
        assert a.create_op_builder("TransformerBuilder") is None


# ---------------------------------------------------------------------------------------------
# The setting and the get_accelerator wrapper, in-process with a stand-in for real_accelerator


@pytest.mark.parametrize("raw, expected", [(None, "project"), ("project", "project"), ("builtin", "builtin"),
                                           (" Builtin ", "builtin"), ("PROJECT", "project")])
def test_selected_implementation(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("SUPA_DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("SUPA_DS_ACCELERATOR", raw)
    assert deepspeed_selection.selected_implementation() == expected


@pytest.mark.parametrize("raw", ["", "ours", "deepspeed", "1"])
def test_selected_implementation_rejects_other_values(monkeypatch, raw):
    monkeypatch.setenv("SUPA_DS_ACCELERATOR", raw)
    with pytest.raises(ValueError, match=r"SUPA_DS_ACCELERATOR.*accepted values: project, builtin"):
        deepspeed_selection.selected_implementation()


def _stand_in_real_accelerator(choice):
    """A module shaped like DeepSpeed's real_accelerator whose own choice is an object named `choice`."""
    module = types.ModuleType("stand_in_real_accelerator")
    module.ds_accelerator = None
    module.choices_made = 0

    class BuiltIn:
        _name = choice

    def get_accelerator():
        if module.ds_accelerator is None:
            module.choices_made += 1
            module.ds_accelerator = BuiltIn()
        return module.ds_accelerator

    def set_accelerator(obj):
        module.ds_accelerator = obj

    module.get_accelerator, module.set_accelerator, module.BuiltIn = get_accelerator, set_accelerator, BuiltIn
    return module


@pytest.mark.parametrize("choice, setting, expected", [("supa", None, "project"), ("supa", "project", "project"),
                                                       ("supa", "builtin", "builtin"), ("cpu", None, "builtin"),
                                                       ("cuda", "project", "builtin")])
def test_wrapper_replaces_only_deepspeeds_supa_choice(monkeypatch, choice, setting, expected):
    if setting is None:
        monkeypatch.delenv("SUPA_DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("SUPA_DS_ACCELERATOR", setting)
    module = _stand_in_real_accelerator(choice)
    deepspeed_selection._wrap_get_accelerator(module)
    chosen = module.get_accelerator()
    assert isinstance(chosen, SUPA_Accelerator if expected == "project" else module.BuiltIn)
    assert module.get_accelerator() is chosen and module.choices_made == 1


def test_wrapper_leaves_an_explicit_set_accelerator_alone(monkeypatch):
    monkeypatch.delenv("SUPA_DS_ACCELERATOR", raising=False)
    module = _stand_in_real_accelerator("supa")
    deepspeed_selection._wrap_get_accelerator(module)
    mine = module.BuiltIn()
    module.set_accelerator(mine)
    assert module.get_accelerator() is mine


def test_wrapper_fails_on_every_call_for_a_bad_setting(monkeypatch):
    monkeypatch.setenv("SUPA_DS_ACCELERATOR", "both")
    module = _stand_in_real_accelerator("supa")
    deepspeed_selection._wrap_get_accelerator(module)
    for _ in range(2):
        with pytest.raises(ValueError, match="SUPA_DS_ACCELERATOR"):
            module.get_accelerator()


def test_wrapping_is_idempotent_and_thread_safe(monkeypatch):
    monkeypatch.delenv("SUPA_DS_ACCELERATOR", raising=False)
    module = _stand_in_real_accelerator("supa")
    deepspeed_selection._wrap_get_accelerator(module)
    wrapped = module.get_accelerator
    deepspeed_selection._wrap_get_accelerator(module)
    assert module.get_accelerator is wrapped
    barrier = threading.Barrier(8)
    results = []

    def ask():
        barrier.wait()
        results.append(module.get_accelerator())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert module.choices_made == 1
    assert len({id(r) for r in results}) == 1 and isinstance(results[0], SUPA_Accelerator)


def test_install_is_idempotent_and_patches_an_already_loaded_module(monkeypatch):
    module = _stand_in_real_accelerator("supa")
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator.real_accelerator", module)
    deepspeed_selection.install()
    deepspeed_selection.install()
    finders = [f for f in sys.meta_path if isinstance(f, deepspeed_selection._RealAcceleratorFinder)]
    assert len(finders) == 1
    assert getattr(module.get_accelerator, "__supa_emu_selection__", False)


# ---------------------------------------------------------------------------------------------
# Selection in fresh processes, with no selection code in them


def _run(code=None, timeout=300, args=(), **env):
    """Run `code` (or the interpreter with `args`) in a fresh interpreter with no DeepSpeed accelerator
    setting but those in `env` (a value of None unsets a variable). The code is passed with -c,
    so the checkout (the working directory) is importable, as for a user in their checkout."""
    command = [sys.executable, *args] if args else [sys.executable, "-c", textwrap.dedent(code)]
    return harness.fresh_process(command, env={"DS_ACCELERATOR": None, "SUPA_DS_ACCELERATOR": None, **env},
                                 timeout=timeout, check=False)


# A user's script: it selects nothing itself.
REPORT_CHOICE = pathlib.Path(__file__).resolve().parent / "data" / "accelerator" / "report_choice.py"


def _report_choice(*args, **env):
    return _run(args=(REPORT_CHOICE, *args), **env)


OURS = "supa_deepspeed.accelerator.supa_accelerator.SUPA_Accelerator"
BUILTIN = "deepspeed.accelerator.supa_accelerator.SUPA_Accelerator"


def _choice(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@requires_supa
@pytest.mark.slow  # several fresh interpreters doing real work
def test_ds_accelerator_supa_selects_the_project_accelerator():
    report = _choice(_report_choice(DS_ACCELERATOR="supa"))
    assert report["class"] == OURS and report["same_everywhere"]
    # The usage of DeepSpeed's SUPA pull request, unchanged.
    assert report["device_name"] == "supa"
    assert report["device"] == report["x_device"] == "supa:0"
    assert report["y"] == 36.0


@requires_supa
def test_builtin_setting_selects_deepspeeds_own_accelerator_which_works_too():
    report = _choice(_report_choice(DS_ACCELERATOR="supa", SUPA_DS_ACCELERATOR="builtin"))
    assert report["class"] == BUILTIN
    assert report["device_name"] == "supa" and report["x_device"] == "supa:0"
    assert report["y"] == 36.0 and report["allocated"] > 0


@requires_supa
@pytest.mark.slow  # several fresh interpreters doing real work
def test_other_accelerators_are_untouched_and_named():
    result = _report_choice("cpu", DS_ACCELERATOR="cpu")
    assert _choice(result)["class"] == "deepspeed.accelerator.cpu_accelerator.CPU_Accelerator"
    # SUPA is registered in this process, so DeepSpeed taking another accelerator is said, once.
    said = [line for line in result.stderr.splitlines() if "not SUPA_DS_ACCELERATOR" in line]
    assert said == ["DeepSpeed uses its 'cpu' accelerator (deepspeed.accelerator.cpu_accelerator.CPU_Accelerator), "
                    "not SUPA_DS_ACCELERATOR=project's SUPA accelerator: DS_ACCELERATOR=cpu"], result.stderr[-2000:]


@requires_supa
def test_bad_setting_is_a_clear_error():
    result = _report_choice(DS_ACCELERATOR="supa", SUPA_DS_ACCELERATOR="deepspeed")
    assert result.returncode != 0
    assert "SUPA_DS_ACCELERATOR='deepspeed'" in result.stderr
    assert "project, builtin" in result.stderr


@requires_supa
@pytest.mark.slow  # a torchrun launch
def test_torchrun_rank_auto_detects_the_project_accelerator():
    # No DS_ACCELERATOR: DeepSpeed's auto-detection, in a rank the launcher started.
    result = _run(args=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", REPORT_CHOICE))
    assert _choice(result)["class"] == OURS


def test_install_imports_nothing_heavy():
    result = _run("""
        import sys
        before = set(sys.modules)  # with SUPA_EMULATE on, supa_emu.pth imported supa_emu.import_hooks
        from supa_deepspeed.accelerator.deepspeed_selection import install
        install()
        print(sorted(m for m in ("torch", "deepspeed", "supa_emu") if m in sys.modules and m not in before))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_project_accelerator_that_cannot_load_is_said_and_deepspeed_keeps_its_own(monkeypatch, caplog):
    import types as _types

    def broken(self):
        raise ImportError("a broken install")

    monkeypatch.setattr(SUPA_Accelerator, "__init__", broken)
    chosen = []
    real_accelerator = _types.SimpleNamespace(set_accelerator=chosen.append)
    builtin = object()
    with caplog.at_level("WARNING", logger=deepspeed_selection.__name__):
        deepspeed_selection._install_project_accelerator(real_accelerator, builtin)
    assert chosen == []  # DeepSpeed's own choice stands
    assert [r.getMessage() for r in caplog.records] == [
        "DeepSpeed uses its built-in SUPA accelerator (builtins.object), not this project's (SUPA_DS_ACCELERATOR=project): "
        "loading supa_deepspeed.accelerator.supa_accelerator failed: ImportError: a broken install"]
