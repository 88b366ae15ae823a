"""Inside a DeepSpeed source tree, both projects keep their own packages.

A DeepSpeed checkout has top-level `accelerator/` and `op_builder/` folders, and its tests put
the checkout's root on sys.path. This project installs its DeepSpeed parts as
`supa_deepspeed.accelerator` and `supa_deepspeed.op_builder` (setup.py), so in such a tree
DeepSpeed still gets this project's SUPA accelerator and op builders, and DeepSpeed's own
`accelerator.*` / `op_builder` imports get DeepSpeed's folders. Checked on the released
DeepSpeed sdist (same layout as a clone), downloaded once into the test cache.
"""

import os
import pathlib
import sys
import tarfile

import pytest

from harness import fresh_process

pytestmark = [pytest.mark.emulation_only, pytest.mark.slow]  # a download once, then a fresh interpreter


def _cache_dir() -> pathlib.Path:
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return base / "supa_emu-tests" / "deepspeed-sdist"


@pytest.fixture(scope="module")
def deepspeed_tree(tmp_path_factory):
    import deepspeed
    version = deepspeed.__version__
    archive = _cache_dir() / f"deepspeed-{version}.tar.gz"
    if not archive.exists():
        archive.parent.mkdir(parents=True, exist_ok=True)
        fetched = fresh_process(
            [sys.executable, "-m", "pip", "download", f"deepspeed=={version}", "--no-binary", ":all:", "--no-deps",
             "--no-build-isolation", "-q", "-d", archive.parent],
            # pip runs the sdist's setup.py for its metadata; that is not under test, so no emulator there.
            env={"SUPA_EMULATE": "0"}, timeout=600, check=False)
        if fetched.returncode != 0 or not archive.exists():
            pytest.skip(f"the package registry did not give DeepSpeed {version}'s sdist: "
                        f"{(fetched.stderr.strip().splitlines() or ['no output'])[-1]}")
    root = tmp_path_factory.mktemp("deepspeed-checkout")
    with tarfile.open(archive) as sdist:
        sdist.extractall(root, filter="data")
    tree = root / f"deepspeed-{version}"
    assert (tree / "accelerator").is_dir() and (tree / "op_builder").is_dir()
    return tree


def _what_each_name_gives() -> dict:
    """In a fresh interpreter whose sys.path starts with the checkout: where each import leads."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    import accelerator.cuda_accelerator  # the checkout's, after DeepSpeed's own imports (as its tests do)
    import op_builder

    acc = get_accelerator()
    adam = acc.create_op_builder("FusedAdamBuilder")
    return {
        "deepspeed": deepspeed.__file__,
        "accelerator_class": type(acc).__module__ + "." + type(acc).__qualname__,
        "cuda_accelerator": accelerator.cuda_accelerator.__file__,
        "op_builder": op_builder.__file__,
        "op_builder_is_deepspeeds": hasattr(op_builder, "__deepspeed__"),
        "fused_adam_builder": type(adam).__module__,
        "fused_adam_compatible": adam.is_compatible(),
    }


def test_checkout_root_on_sys_path_keeps_both_projects_packages(deepspeed_tree):
    # DeepSpeed's tests put the checkout's root on sys.path; PYTHONPATH does the same here.
    result = fresh_process(_what_each_name_gives, env={"PYTHONPATH": str(deepspeed_tree), "DS_ACCELERATOR": None})
    seen = result.value
    assert pathlib.Path(seen["deepspeed"]).is_relative_to(deepspeed_tree)  # really the checkout's DeepSpeed
    assert seen["accelerator_class"] == "supa_deepspeed.accelerator.supa_accelerator.SUPA_Accelerator"
    assert seen["cuda_accelerator"] == str(deepspeed_tree / "accelerator" / "cuda_accelerator.py")
    assert seen["op_builder"] == str(deepspeed_tree / "op_builder" / "__init__.py")
    assert seen["op_builder_is_deepspeeds"]
    assert seen["fused_adam_builder"] == "supa_deepspeed.op_builder.supa.fused_adam"
    assert seen["fused_adam_compatible"]
    assert "not SUPA_DS_ACCELERATOR" not in result.stderr  # the choice asked for is the one made: nothing to say
